"""Job spec parsing, IMDS client, status writer, log tailing, lifecycle calls (no AWS)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from harness import FakeImds

from petctl_agent.cloud import aws
from petctl_agent.cloud.fetch import fetch_code, load_spec
from petctl_agent.cloud.imds import Imds
from petctl_agent.cloud.logship import LogTailer
from petctl_agent.cloud.status import FileStatusWriter, StatusPublisher, make_writer
from petctl_agent.settings import Settings
from petctl_agent.spec import JOB_NAME_RE, JobSpec, SpecError, checkpoint_dir

GOOD = {
    "version": 1,
    "job_name": "train-3f2a",
    "user": "alice",
    "region": "us-east-1",
    "min_nodes": 2,
    "max_nodes": 8,
    "nproc_per_node": "auto",
    "code_url": "s3://bucket/petctl/jobs/train-3f2a/code/train.py",
    "code_kind": "script",
    "script": "train.py",
    "args": ["--epochs", "10"],
    "env": {},
    "checkpoint_dir": "petctl/jobs/train-3f2a/checkpoints",
    "status_url": "s3://bucket/petctl/jobs/train-3f2a/status/",
    "log_group": "/petctl/default",
    "worker_group": "petctl-train-3f2a-workers",
    "rdzv_group": "petctl-train-3f2a-rdzv",
    "lifecycle_hook": "petctl-drain",
    "drain_timeout": 60,
    "rdzv_port": 2379,
}


def test_contract_example_parses() -> None:
    s = JobSpec.from_dict(GOOD)
    assert (s.job_name, s.min_nodes, s.max_nodes, s.args) == ("train-3f2a", 2, 8, ("--epochs", "10"))
    assert s.resolved_nproc() >= 1
    assert JobSpec.from_dict({**GOOD, "nproc_per_node": 2}).resolved_nproc() == 2
    assert JobSpec.from_dict({**GOOD, "future_field": 1}).job_name == "train-3f2a"  # forward compatible


def test_spec_json_round_trip_and_shared_names() -> None:
    s = JobSpec.from_dict({**GOOD, "petctl_version": "0.1.0", "torch_version": "2.13.0", "run_id": "3f9a01"})
    d = json.loads(s.to_json())
    assert d["args"] == ["--epochs", "10"] and d["petctl_version"] == "0.1.0" and d["run_id"] == "3f9a01"
    assert JobSpec.from_dict(GOOD).run_id == ""  # an older spec: an unknown run
    assert JobSpec.from_json(s.to_json()) == s == JobSpec.from_dict(s.to_dict())
    assert checkpoint_dir("train-3f2a") == GOOD["checkpoint_dir"]
    assert JOB_NAME_RE.match("train-3f2a") and not JOB_NAME_RE.match("Train")
    with pytest.raises(SpecError, match="not JSON"):
        JobSpec.from_json("{")


def test_spec_module_is_stdlib_only() -> None:
    """The CLI imports petctl_agent.spec: importing it must pull in neither boto3 nor torch."""
    code = "import sys, petctl_agent.spec; print(sorted(m for m in ('boto3', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"version": 2}, "unsupported job spec version 2"),
        ({"job_name": "Bad_Name"}, "job_name 'Bad_Name'"),
        ({"min_nodes": 3, "max_nodes": 2}, "min=3 max=2"),
        ({"code_kind": "zip"}, "code_kind 'zip'"),
        ({"nproc_per_node": "many"}, "nproc_per_node"),
        ({"args": "--epochs 10"}, "args must be a list"),
        ({"script": ""}, "missing required field(s): script"),
        ({"drain_timeout": "soon"}, "non-numeric"),
        ({"run_id": "../x"}, "run_id must be 1-64 letters"),
        ({"run_id": 7}, "run_id must be 1-64 letters"),
    ],
)
def test_invalid_specs_name_the_field(patch: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobSpec.from_dict({**GOOD, **patch})


def test_load_spec_from_path_and_file_url(tmp_path: Path) -> None:
    p = tmp_path / "job.json"
    p.write_text(json.dumps(GOOD))
    assert load_spec(str(p)).job_name == load_spec(f"file://{p}").job_name == "train-3f2a"
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(str(tmp_path / "missing.json"))
    p.write_text("{not json")
    with pytest.raises(SpecError, match="not JSON"):
        load_spec(str(p))


def test_fetch_script_and_dir(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "train.py").write_text("print('hi')")
    s = JobSpec.from_dict({**GOOD, "code_url": f"file://{src / 'pkg' / 'train.py'}"})
    assert fetch_code(s, tmp_path / "w1").read_text() == "print('hi')"
    tgz = tmp_path / "code.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(src / "pkg", arcname="pkg")
    s = JobSpec.from_dict({**GOOD, "code_kind": "dir", "code_url": str(tgz), "script": "pkg/train.py"})
    assert fetch_code(s, tmp_path / "w2") == (tmp_path / "w2" / "pkg" / "train.py").resolve()
    s = JobSpec.from_dict({**GOOD, "code_kind": "dir", "code_url": str(tgz), "script": "nope.py"})
    with pytest.raises(SpecError, match="not found inside"):
        fetch_code(s, tmp_path / "w3")


def test_imds_v2_token_tags_and_notices() -> None:
    fake = FakeImds()
    try:
        base = fake.add("i-1", "127.0.0.21", {"petctl:spec": "s3://b/job.json"})
        imds = Imds(base, timeout=1)
        assert imds.meta("instance-id") == "i-1"
        assert imds.meta("local-ipv4") == "127.0.0.21"
        assert imds.tag("petctl:spec") == "s3://b/job.json"
        assert imds.get("meta-data/spot/instance-action") is None  # 404
        fake.set("i-1", "spot/instance-action", '{"action": "terminate"}')
        assert "terminate" in imds.get("meta-data/spot/instance-action")
        assert Imds("http://127.0.0.1:9", timeout=0.5).meta("instance-id") is None  # unreachable: None
    finally:
        fake.close()


def test_status_publisher_file_writer(tmp_path: Path) -> None:
    w = make_writer(f"file://{tmp_path}/status/")
    assert isinstance(w, FileStatusWriter)
    pub = StatusPublisher(w, "job", "i-9", "127.0.0.9", interval=60, refresh=lambda: {"last_step": 12})
    pub.start()
    pub.event("rendezvous_done", round=3, world_size=4)
    pub.update(state="RUNNING", world_size=4, round=3)
    pub.close()
    doc = json.loads((tmp_path / "status" / "i-9.json").read_text())
    assert doc["version"] == 1 and doc["state"] == "RUNNING" and doc["last_step"] == 12
    assert doc["events"][-1]["kind"] == "rendezvous_done" and doc["events"][-1]["world_size"] == 4
    for i in range(250):
        pub.event("workers_started", n=i)
    assert len(pub.snapshot()["events"]) == 200


def test_status_write_failure_is_not_fatal() -> None:
    class Boom:
        def write(self, name: str, body: bytes) -> None:
            raise OSError("bucket gone")

    pub = StatusPublisher(Boom(), "job", "i-1", "127.0.0.1")
    pub.flush()  # logs, does not raise


def test_log_tailer_follows_recreated_files(tmp_path: Path) -> None:
    got: list[tuple[str, str]] = []
    f = tmp_path / "run" / "attempt_0" / "0" / "stdout.log"
    f.parent.mkdir(parents=True)
    f.write_text("one\ntwo\npart")
    t = LogTailer(tmp_path, [lambda label, line: got.append((label, line))])
    t.poll()
    assert [line for _, line in got] == ["one", "two"]
    f.write_text("one\ntwo\npartial done\n")
    t.poll()
    assert got[-1][1] == "partial done" and got[-1][0] == "attempt_0/rank0/out"
    f.unlink()  # torch rmtree()s and re-creates attempt_<n> when the restart count is unchanged
    f.write_text("fresh\n")
    t.poll()
    assert got[-1][1] == "fresh"
    # recreated with the old inode number and already longer than the old offset: the first
    # bytes tell it is a new file, so no line loses its beginning ("tep=569" was seen)
    f.write_text("step=567 world_size=2\nstep=568 world_size=2\nstep=569 world_size=2\n")
    t.poll()
    assert [line for _, line in got[-3:]] == [
        "step=567 world_size=2",
        "step=568 world_size=2",
        "step=569 world_size=2",
    ]


def test_lifecycle_completion_and_scale_to_zero_are_tolerant(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Stubber-backed client: the right calls are made; an error is logged, not raised."""
    import boto3
    from botocore.stub import Stubber

    from petctl_agent.node.lifecycle import Lifecycle

    client = boto3.client(
        "autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y"
    )
    stub = Stubber(client)
    stub.add_response(
        "complete_lifecycle_action",
        {},
        {
            "LifecycleHookName": "petctl-drain",
            "AutoScalingGroupName": "petctl-train-3f2a-workers",
            "LifecycleActionResult": "CONTINUE",
            "InstanceId": "i-7",
        },
    )
    stub.add_response(
        "update_auto_scaling_group",
        {},
        {"AutoScalingGroupName": "petctl-train-3f2a-workers", "MinSize": 0, "DesiredCapacity": 0},
    )
    stub.add_client_error("update_auto_scaling_group", "AccessDenied")
    stub.activate()
    monkeypatch.setattr(aws, "client", lambda *a, **k: client)
    a = Lifecycle(JobSpec.from_dict(GOOD), Imds("http://127.0.0.1:9"), Settings(), "i-7")
    a.pending = True
    a.complete_action()
    # second group's call fails: logged, and (one try here) the caller's last resort is due
    assert a.scale_groups_to_zero(delays=()) is False
    stub.assert_no_pending_responses()


def test_log_tailer_ends_lines_at_carriage_returns(tmp_path: Path) -> None:
    """A progress bar redraws with \r: each redraw is a line, never one ever-growing event."""
    got: list[str] = []
    f = tmp_path / "run" / "attempt_0" / "0" / "stderr.log"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"10%|#  \r20%|## \r30%|###\r")
    t = LogTailer(tmp_path, [lambda label, line: got.append(line)])
    t.poll()
    assert got == ["10%|#  ", "20%|## "]  # the last \r may still be the start of \r\n
    with open(f, "ab") as fh:
        fh.write(b"\ndone\r\nnext")
    t.poll()
    assert got == ["10%|#  ", "20%|## ", "30%|###", "done"]


def test_split_event_never_cuts_a_character() -> None:
    from petctl_agent.cloud.logship import split_event

    assert split_event("short") == ["short"]
    pieces = split_event("aé" * 10, limit=5)
    assert "".join(pieces) == "aé" * 10 and all(len(p.encode()) <= 5 for p in pieces)
