"""The code fetch retries what S3 answers transiently (5xx, throttling), never what it answers for
good (the object gone, access denied). moto never answers a 500 or a SlowDown: a botocore Stubber
stands in for S3's answers, the retry loop under test is the agent's own."""

from __future__ import annotations

import io

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from petctl_agent.cloud.fetch import read_url


def _client():
    c = boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return c, Stubber(c)


def _body(data: bytes) -> dict:
    return {"Body": StreamingBody(io.BytesIO(data), len(data))}


PARAMS = {"Bucket": "b", "Key": "petctl/jobs/j/code/train.py"}


def test_transient_errors_are_retried_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PETCTL_FETCH_RETRY_SECONDS", "300")
    c, stub = _client()
    stub.add_client_error("get_object", "InternalError", http_status_code=500, expected_params=PARAMS)
    stub.add_client_error("get_object", "SlowDown", http_status_code=503, expected_params=PARAMS)
    stub.add_response("get_object", _body(b"print('hi')"), PARAMS)
    slept: list[float] = []
    with stub:
        data = read_url("s3://b/petctl/jobs/j/code/train.py", lambda: c, sleep=slept.append)
    assert data == b"print('hi')"
    assert slept == [1.0, 2.0]  # two failures, doubling backoff
    stub.assert_no_pending_responses()


@pytest.mark.parametrize("code,status", [("NoSuchKey", 404), ("AccessDenied", 403)])
def test_a_missing_or_forbidden_object_fails_at_once(code: str, status: int) -> None:
    c, stub = _client()
    stub.add_client_error("get_object", code, http_status_code=status, expected_params=PARAMS)
    slept: list[float] = []
    with stub, pytest.raises(Exception, match=code):
        read_url("s3://b/petctl/jobs/j/code/train.py", lambda: c, sleep=slept.append)
    assert slept == []


def test_the_retry_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PETCTL_FETCH_RETRY_SECONDS", "0")
    c, stub = _client()
    stub.add_client_error("get_object", "InternalError", http_status_code=500, expected_params=PARAMS)
    with stub, pytest.raises(Exception, match="InternalError"):
        read_url("s3://b/petctl/jobs/j/code/train.py", lambda: c, sleep=lambda s: None)
