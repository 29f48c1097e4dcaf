"""The CloudWatch shipper counts what it could not store (rejected, throttled, failed, queue full),
says so in one rate-limited line and hands the counts to the status document. Against the local
cloud's patched moto server (rejectedLogEventsInfo as the API reference defines it) and, for
throttling (which moto never answers), a botocore Stubber."""

from __future__ import annotations

import logging
import time

import pytest
from botocore.stub import Stubber

from petctl_agent.cloud.aws import client as aws_client
from petctl_agent.cloud.logship import CloudWatchShipper, rejected_count

DAY_MS = 86_400_000


def _stored(logs, group: str, stream: str) -> list[str]:
    page = logs.get_log_events(logGroupName=group, logStreamName=stream, startFromHead=True)
    return [e["message"] for e in page["events"]]


def test_patched_moto_answers_rejected_events_as_aws_does(moto_endpoint: str) -> None:
    logs = aws_client("logs")
    logs.create_log_group(logGroupName="/petctl/rej")
    logs.put_retention_policy(logGroupName="/petctl/rej", retentionInDays=1)
    logs.create_log_stream(logGroupName="/petctl/rej", logStreamName="s")
    now = int(time.time() * 1000)
    ts = [now - 20 * DAY_MS, now - 15 * DAY_MS, now - 3 * DAY_MS, now, now + 3 * 3_600_000]
    resp = logs.put_log_events(
        logGroupName="/petctl/rej",
        logStreamName="s",
        logEvents=[{"timestamp": t, "message": f"m{i}"} for i, t in enumerate(ts)],
    )
    info = resp["rejectedLogEventsInfo"]
    # too old: [0, 2) (exclusive end); expired (retention 1 day): [0, 3); too new: [4, 5)
    assert info == {"tooOldLogEventEndIndex": 2, "expiredLogEventEndIndex": 3, "tooNewLogEventStartIndex": 4}
    assert rejected_count(info, 5) == (4, "too old, expired, too new")


def test_rejected_events_are_counted_logged_once_and_published(
    moto_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    logs = aws_client("logs")
    logs.create_log_group(logGroupName="/petctl/lost")
    published: list[dict] = []
    shipper = CloudWatchShipper(
        "/petctl/lost", "job/i-0lost", lambda: aws_client("logs"), on_lost=published.append
    )
    now = int(time.time() * 1000)
    for i in range(3):  # a clock that stepped 3 days ahead of CloudWatch's, then back
        shipper._q.put_nowait((now + 3 * DAY_MS, f"future {i}"))
    shipper.sink("attempt_0/rank0/out", "fine")
    with caplog.at_level(logging.WARNING, logger="petctl_agent.logs"):
        shipper.flush()
        for i in range(2):
            shipper._q.put_nowait((now + 3 * DAY_MS, f"again {i}"))
        shipper.flush()
    assert shipper.lost == {"rejected": 5, "throttled": 0, "failed": 0, "queue_full": 0}
    assert shipper.dropped == 5
    assert published[-1] == shipper.lost
    lines = [r.getMessage() for r in caplog.records if "not shipped" in r.getMessage()]
    assert len(lines) == 1 and "rejected 3" in lines[0] and "too new" in lines[0]
    assert _stored(logs, "/petctl/lost", "job/i-0lost") == ["[attempt_0/rank0/out] fine"]


def test_throttled_batch_is_counted_after_retries(caplog: pytest.LogCaptureFixture) -> None:
    import boto3

    client = boto3.client(
        "logs",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        endpoint_url="http://127.0.0.1:9",
    )
    stub = Stubber(client)
    stub.add_response("create_log_stream", {})
    stub.add_client_error("put_log_events", "ThrottlingException", "Rate exceeded", 400)
    stub.add_client_error("put_log_events", "ServiceUnavailableException", "down", 503)
    published: list[dict] = []
    shipper = CloudWatchShipper("/g", "s", lambda: client, on_lost=published.append, log_every=3600)
    with stub, caplog.at_level(logging.WARNING, logger="petctl_agent.logs"):
        shipper.sink("r0", "a")
        shipper.sink("r0", "b")
        shipper.flush()
        shipper.sink("r0", "c")
        shipper.flush()
    assert shipper.lost == {"rejected": 0, "throttled": 2, "failed": 1, "queue_full": 0}
    assert published == [
        {"rejected": 0, "throttled": 2, "failed": 0, "queue_full": 0},
        {"rejected": 0, "throttled": 2, "failed": 1, "queue_full": 0},
    ]
    lines = [r.getMessage() for r in caplog.records if "not shipped" in r.getMessage()]
    assert len(lines) == 1 and "throttled 2" in lines[0]


def test_full_queue_is_counted() -> None:
    published: list[dict] = []
    shipper = CloudWatchShipper("/g", "s", lambda: None, max_queue=2, on_lost=published.append)
    for i in range(5):
        shipper.sink("r0", f"line {i}")
    assert shipper.lost["queue_full"] == 3 and published[-1]["queue_full"] == 3
