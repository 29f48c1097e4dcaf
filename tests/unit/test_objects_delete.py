"""``Objects.delete_prefix``: DeleteObjects answers HTTP 200 with per-key ``Errors`` (AccessDenied...)
-- a silent partial deletion would leave a killed job's secrets behind while kill-job says done.
moto never fails a key, so a botocore Stubber answers as S3 does (S3 API reference, DeleteObjects)."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from petctl.errors import AwsError
from petctl.gateway.objects import Objects


def _s3():
    return boto3.client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x",
        endpoint_url="http://127.0.0.1:9",
    )  # fmt: skip


def test_partial_delete_is_an_error_naming_a_key() -> None:
    s3 = _s3()
    stub = Stubber(s3)
    keys = ["petctl/jobs/j/job.json", "petctl/jobs/j/tls/ca.key"]
    stub.add_response("list_objects_v2", {"Contents": [{"Key": k} for k in keys], "IsTruncated": False})
    stub.add_response(
        "delete_objects",
        {"Errors": [{"Key": keys[1], "Code": "AccessDenied", "Message": "Access Denied"}]},
        {"Bucket": "b", "Delete": {"Objects": [{"Key": k} for k in keys], "Quiet": True}},
    )
    with stub, pytest.raises(AwsError, match=r"could not delete 1 of 2 objects .*tls/ca\.key: AccessDenied"):
        Objects(s3).delete_prefix("b", "petctl/jobs/j/")


def test_full_delete_counts_the_keys() -> None:
    s3 = _s3()
    stub = Stubber(s3)
    stub.add_response("list_objects_v2", {"Contents": [{"Key": "p/a"}, {"Key": "p/b"}], "IsTruncated": False})
    stub.add_response("delete_objects", {"Deleted": []})
    with stub:
        assert Objects(s3).delete_prefix("b", "p/") == 2
