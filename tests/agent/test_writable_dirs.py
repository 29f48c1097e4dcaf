"""A node that cannot write the job's checkpoint or work directory fails at boot, terminally, with
one line naming the upgrade fix, instead of training until its first save and dying of EACCES.

The tests run as root, where permission bits stop nothing: the unwritable directories here are
real ones the kernel refuses (a symlink into /proc: ENOENT on create; a path under a file: ENOTDIR).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import FakeImds

from petctl_agent import EXIT_TERMINAL
from petctl_agent.cloud.imds import Imds
from petctl_agent.node.agent import Agent
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.node.preflight import require_writable_dir
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError


def test_a_writable_dir_is_made_and_left_as_it_was(tmp_path: Path) -> None:
    d = tmp_path / "petctl" / "jobs" / "j" / "checkpoints"
    require_writable_dir(d, "checkpoint directory")
    assert d.is_dir() and os.listdir(d) == []  # the probe file is gone


def test_an_existing_dir_that_refuses_writes_fails_with_the_upgrade_fix(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints"
    d.symlink_to("/proc")  # exists and is a directory, but nothing can be created in it
    with pytest.raises(SpecError) as e:
        require_writable_dir(d, "checkpoint directory")
    msg = str(e.value)
    assert f"cannot write the checkpoint directory {d}" in msg and "'Upgrading'" in msg
    assert "\n" not in msg


def test_a_dir_that_cannot_be_made_fails_the_same_way(tmp_path: Path) -> None:
    (tmp_path / "jobs").write_text("a file where a directory should be")
    with pytest.raises(SpecError, match="cannot write the work directory"):
        require_writable_dir(tmp_path / "jobs" / "j" / "work", "work directory")


class Pub:
    def __init__(self) -> None:
        self.fields: dict = {}

    def update(self, **kw) -> None:
        self.fields.update(kw)

    def event(self, *a, **kw) -> None:
        pass

    def flush(self) -> None:
        pass


@pytest.fixture
def imds():
    f = FakeImds()
    yield f
    f.close()


def test_agent_fails_terminally_before_joining_when_its_checkpoints_are_unwritable(
    tmp_path: Path, imds
) -> None:
    """The resumed job of the review: its checkpoint dir exists but this node cannot write it."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must never run')\n")
    efs = tmp_path / "efs"
    (efs / "petctl" / "jobs" / "again").mkdir(parents=True)
    (efs / "petctl" / "jobs" / "again" / "checkpoints").symlink_to("/proc")
    spec = JobSpec.from_dict(
        {"job_name": "again", "min_nodes": 1, "max_nodes": 1, "code_url": str(script), "script": "train.py"}
    )
    url = imds.add("i-again", "127.0.0.1")
    settings = Settings(efs_mount=efs, agent_dir=tmp_path / "agent", efs_wait=1)
    a = Agent(
        SimpleNamespace(local_addr="127.0.0.1", rdzv_endpoint="127.0.0.1:1"), settings, Imds(url, timeout=1)
    )
    a.lifecycle = Lifecycle(spec, a.imds, settings, a.instance_id)
    a.pub = Pub()
    with pytest.raises(SpecError):  # (without the check, _checked_run below would go on to join)
        a._prepare_node(spec)
    rc = a._checked_run(spec)
    assert rc == EXIT_TERMINAL
    assert a.pub.fields["state"] == "FAILED"
    assert "cannot write the checkpoint directory" in a.pub.fields["reason"]
    assert not (efs / "petctl" / "jobs" / "again" / "work").exists()  # it stopped at the first check
