"""A project on the local cloud, through the CLI a user types: a project directory whose script
reads a data file by a path relative to the project trains to SUCCEEDED on 2 nodes (its output
in the job's shared work dir), and the same script without its data file fails the job in under
a minute with the exception's line, its rank and node in ``run-job --wait``'s error and in
``petctl status``. ~2 min on a loaded 2-core machine (two boots of two instances each).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TRAIN = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
text = open("data/input.txt").read()  # relative to the project, as under `cd project && torchrun`
t = torch.tensor([float(len(text))])
dist.all_reduce(t)
if dist.get_rank() == 0:
    with open("result.txt", "w") as f:  # relative: the job's shared work dir
        f.write(f"{int(t.item())} {dist.get_world_size()}\\n")
print("rank", dist.get_rank(), "read", len(text), flush=True)
"""
LINE = "FileNotFoundError: [Errno 2] No such file or directory: 'data/input.txt'"


@pytest.fixture
def local_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PETCTL_LOCAL_DIR", str(tmp_path / "home" / "local"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield tmp_path / "home"
    from petctl import local

    local.stop()


def petctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "petctl.cli", "--local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _job(started: subprocess.CompletedProcess) -> str:
    for line in (started.stdout + started.stderr).splitlines():
        if "petctl --local kill-job " in line:
            return line.rsplit("kill-job ", 1)[1].split()[0]
    raise AssertionError(started.stdout + started.stderr)


def test_a_project_reads_its_files_and_a_failing_one_says_why(local_home, tmp_path) -> None:
    from petctl import local

    r = petctl("setup")
    assert r.returncode == 0, r.stderr
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        d.mkdir()
        (d / "train.py").write_text(TRAIN)
    (good / "data").mkdir()
    (good / "data" / "input.txt").write_text("hello world\n")

    r = petctl("run-job", "--min", "2", "--max", "2", "--wait", str(good), "--", "train.py", timeout=600)
    job = _job(r)
    assert r.returncode == 0 and "SUCCEEDED" in r.stderr + r.stdout, r.stdout + r.stderr
    efs = Path(local.status()["state_dir"]) / "efs"
    work = list(efs.glob(f"*/petctl/jobs/{job}/work"))
    assert len(work) == 1 and (work[0] / "result.txt").read_text() == "24 2\n", list(efs.rglob("*"))[:20]
    assert (work[0] / "data").is_symlink() and not (work[0] / "result.txt").is_symlink()

    t0 = time.monotonic()
    r = petctl("run-job", "--min", "2", "--max", "2", "--max-restarts", "10", "--wait", str(bad), "--",
               "train.py", timeout=600)  # fmt: skip
    took = time.monotonic() - t0
    job = _job(r)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"job {job} ended FAILED: " in out and LINE in out, out
    assert f"logs {job} --instance i-" in out and "To enable traceback" not in out, out
    st = json.loads(petctl("-o", "json", "status", job).stdout)
    assert st["state"] == "FAILED" and LINE in st["reason"] and " on i-" in st["reason"], st["reason"]
    assert st["restarts"] <= 2, st["restarts"]  # stopped after the second identical failure, not 10
    # from the workers' first start to FAILED: two tries of the script, well within a minute
    kinds = [(e["kind"], e["t"]) for e in st["events"]]
    first = min(t for k, t in kinds if k == "workers_started")
    failed = max(t for k, t in kinds if k == "failed")
    assert failed - first < 60, kinds
    assert took < 240, f"{took:.0f}s"  # with the boot of the local cloud's instances (~30 s)
