"""The agent's AWS paths against a local moto server (127.0.0.1): spec + code from S3,
status documents to S3, worker lines to CloudWatch Logs. Never real AWS."""

from __future__ import annotations

import json
import time

import pytest

from petctl_agent.cloud.aws import client as aws_client
from petctl_agent.cloud.fetch import fetch_code, load_spec
from petctl_agent.cloud.logship import CloudWatchShipper
from petctl_agent.cloud.status import S3StatusWriter, StatusPublisher, make_writer


def test_spec_code_status_and_logs_through_moto(moto_endpoint: str, tmp_path) -> None:
    s3 = aws_client("s3")
    s3.create_bucket(Bucket="bkt")
    spec = {
        "version": 1,
        "job_name": "job-s3",
        "min_nodes": 1,
        "max_nodes": 2,
        "code_url": "s3://bkt/petctl/jobs/job-s3/code/train.py",
        "code_kind": "script",
        "script": "train.py",
        "status_url": "s3://bkt/petctl/jobs/job-s3/status/",
        "log_group": "/petctl/test",
    }
    s3.put_object(Bucket="bkt", Key="petctl/jobs/job-s3/job.json", Body=json.dumps(spec).encode())
    s3.put_object(Bucket="bkt", Key="petctl/jobs/job-s3/code/train.py", Body=b"print('hello')\n")

    js = load_spec("s3://bkt/petctl/jobs/job-s3/job.json")
    assert js.job_name == "job-s3"
    assert fetch_code(js, tmp_path / "code").read_text() == "print('hello')\n"

    writer = make_writer(js.status_url)
    assert isinstance(writer, S3StatusWriter)
    pub = StatusPublisher(writer, js.job_name, "i-0abc", "10.0.0.5", interval=60)
    pub.event("agent_started")
    pub.update(state="RUNNING")
    pub.flush()
    body = s3.get_object(Bucket="bkt", Key="petctl/jobs/job-s3/status/i-0abc.json")["Body"].read()
    assert json.loads(body)["state"] == "RUNNING"

    logs = aws_client("logs")
    logs.create_log_group(logGroupName="/petctl/test")
    shipper = CloudWatchShipper("/petctl/test", "job-s3/i-0abc", lambda: aws_client("logs"), interval=0.2)
    shipper.start()
    shipper.sink("attempt_0/rank0/out", "step=1 world_size=1 loss=0.5")
    deadline = time.monotonic() + 20
    events: list = []
    while time.monotonic() < deadline and not events:
        time.sleep(0.2)
        try:
            events = logs.get_log_events(logGroupName="/petctl/test", logStreamName="job-s3/i-0abc")["events"]
        except logs.exceptions.ResourceNotFoundException:
            pass
    shipper.stop()
    assert events and "step=1 world_size=1" in events[0]["message"]


def test_shipper_tolerates_a_missing_log_group(moto_endpoint: str) -> None:
    shipper = CloudWatchShipper("/petctl/absent", "s", lambda: aws_client("logs"))
    shipper.sink("x", "line")
    shipper.flush()  # logs a warning, does not raise
    assert shipper.dropped == 1


def test_shipper_keeps_put_log_events_limits(moto_endpoint: str) -> None:
    """12,000 lines (~2.4 MB) and one 600 KB line: every batch fits AWS's limits, nothing is lost."""
    from petctl_agent.cloud.logship import MAX_EVENT_BYTES

    logs = aws_client("logs")
    logs.create_log_group(logGroupName="/petctl/big")
    # the patched moto refuses what AWS refuses
    logs.create_log_stream(logGroupName="/petctl/big", logStreamName="probe")
    with pytest.raises(logs.exceptions.InvalidParameterException):
        logs.put_log_events(
            logGroupName="/petctl/big",
            logStreamName="probe",
            logEvents=[{"timestamp": 1, "message": "x" * 200} for _ in range(10_001)],
        )
    shipper = CloudWatchShipper("/petctl/big", "job/i-0big", lambda: aws_client("logs"))
    for i in range(12_000):
        shipper.sink("attempt_0/rank0/out", f"step={i} " + "x" * 200)
    shipper.sink("attempt_0/rank0/out", "é" * 300_000)  # 600 KB of two-byte characters
    shipper.flush()
    assert shipper.dropped == 0
    events, token = [], None
    while True:
        kw = {"nextToken": token} if token else {}
        page = logs.get_log_events(
            logGroupName="/petctl/big", logStreamName="job/i-0big", startFromHead=True, **kw
        )
        if not page["events"]:
            break
        events += page["events"]
        token = page["nextForwardToken"]
    steps = [e for e in events if "step=" in e["message"]]
    assert len(steps) == 12_000
    long_pieces = [e["message"] for e in events if "é" in e["message"]]
    assert len(long_pieces) == 3 and "".join(long_pieces).count("é") == 300_000
    assert all(len(m.encode()) + 26 <= MAX_EVENT_BYTES for m in long_pieces)
