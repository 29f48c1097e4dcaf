"""``Objects.delete_prefix`` against the moto server with the local cloud's patches: DeleteObjects'
1,000-key cap (S3 API reference, DeleteObjects), which moto alone does not enforce."""

from __future__ import annotations

import boto3
import pytest

from petctl.gateway.objects import Objects


def test_more_than_a_page_of_keys_is_deleted_in_requests_aws_accepts(aws) -> None:
    """2,500 objects: three listing pages, three DeleteObjects of <= 1,000 keys; the local cloud's
    moto refuses a request over 1,000 keys as S3 does (MalformedXML), so a bigger batch would fail."""
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bkt")
    for i in range(2500):
        s3.put_object(Bucket="bkt", Key=f"p/{i:05d}", Body=b"")
    s3.put_object(Bucket="bkt", Key="q/kept", Body=b"")
    with pytest.raises(s3.exceptions.ClientError, match="MalformedXML"):
        s3.delete_objects(Bucket="bkt", Delete={"Objects": [{"Key": f"p/{i:05d}"} for i in range(1001)]})
    assert Objects(s3).delete_prefix("bkt", "p/") == 2500
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="bkt")["Contents"]] == ["q/kept"]
