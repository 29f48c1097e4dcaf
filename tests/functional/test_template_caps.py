"""CloudFormation's template caps, as the local cloud's moto patches enforce them (moto alone takes
any body and any URL), and run-job creating its stack from the template it uploaded."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import ClientError

from petctl import templates
from petctl.templates import rendering

SMALL = {"AWSTemplateFormatVersion": "2010-09-09", "Resources": {"T": {"Type": "AWS::SNS::Topic"}}}


def _padded(size: int) -> str:
    """A valid template of exactly ``size`` bytes (a YAML comment pads it)."""
    body = json.dumps(SMALL) + "\n#"
    return body + "x" * (size - len(body))


def _bucket(region: str = "us-east-1") -> str:
    s3 = boto3.client("s3", region_name=region)
    name = f"caps-{region}"
    extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    s3.create_bucket(Bucket=name, **extra)
    return name


def _put(bucket: str, key: str, body: str, region: str = "us-east-1") -> None:
    boto3.client("s3", region_name=region).put_object(Bucket=bucket, Key=key, Body=body.encode())


def _error(call, **kwargs) -> str:
    with pytest.raises(ClientError) as e:
        call(**kwargs)
    assert e.value.response["Error"]["Code"] == "ValidationError"
    return e.value.response["Error"]["Message"]


def test_inline_body_over_51200_bytes_is_refused(aws):
    cf = boto3.client("cloudformation")
    cf.create_stack(StackName="fits", TemplateBody=_padded(templates.TEMPLATE_BODY_MAX_BYTES))
    assert "51200" in _error(
        cf.create_stack, StackName="big", TemplateBody=_padded(templates.TEMPLATE_BODY_MAX_BYTES + 1)
    )
    assert "51200" in _error(
        cf.update_stack, StackName="fits", TemplateBody=_padded(templates.TEMPLATE_BODY_MAX_BYTES + 1)
    )
    assert "51200" in _error(
        cf.validate_template, TemplateBody=_padded(templates.TEMPLATE_BODY_MAX_BYTES + 1)
    )


def test_template_url_takes_a_large_template_up_to_one_megabyte(aws):
    cf = boto3.client("cloudformation")
    bucket = _bucket()
    _put(bucket, "ok.yaml", _padded(200_000))
    _put(bucket, "huge.yaml", _padded(templates.TEMPLATE_URL_MAX_BYTES + 1))
    cf.create_stack(StackName="viaurl", TemplateURL=f"https://{bucket}.s3.us-east-1.amazonaws.com/ok.yaml")
    assert cf.describe_stacks(StackName="viaurl")["Stacks"][0]["StackStatus"] == "CREATE_COMPLETE"
    message = _error(
        cf.create_stack,
        StackName="huge",
        TemplateURL=f"https://{bucket}.s3.us-east-1.amazonaws.com/huge.yaml",
    )
    assert str(templates.TEMPLATE_URL_MAX_BYTES) in message


@pytest.mark.parametrize(
    "url",
    [
        "http://caps-us-east-1.s3.us-east-1.amazonaws.com/ok.yaml",  # https only
        "https://example.com/caps-us-east-1/ok.yaml",  # not S3
        "https://caps-us-east-1.s3.us-east-1.amazonaws.com/missing.yaml",  # no such object
        "https://caps-eu-west-1.s3.eu-west-1.amazonaws.com/ok.yaml",  # a bucket of another region
        "https://caps-us-east-1.s3.eu-west-1.amazonaws.com/ok.yaml",  # addressed through another region
    ],
)
def test_template_url_must_be_an_s3_object_of_the_stacks_region(aws, url):
    _put(_bucket(), "ok.yaml", _padded(1000))
    _put(_bucket("eu-west-1"), "ok.yaml", _padded(1000), region="eu-west-1")
    _error(boto3.client("cloudformation").create_stack, StackName="elsewhere", TemplateURL=url)


def test_run_job_creates_its_stack_from_the_uploaded_template(run, ready, monkeypatch):
    """Unstripped, a warm-pool job's template is over the inline cap (the issue's 52 KB): run-job
    must still work, because the stack is created from the template it uploads (TemplateURL)."""
    monkeypatch.setattr(rendering, "strip_comments", lambda text: text)
    r = run(
        "--output",
        "json",
        "run_job",
        "--name",
        "big",
        "--min",
        "1",
        "--max",
        "2",
        "--warm-pool",
        "1",
        str(ready),
    )
    assert r.exit_code == 0, r.output
    cf = boto3.client("cloudformation")
    body = cf.get_template(StackName="petctl-job-big")["TemplateBody"]
    assert len(body.encode()) > templates.TEMPLATE_BODY_MAX_BYTES
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    uploaded = s3.get_object(Bucket=bucket, Key="petctl/jobs/big/template.yaml")
    assert uploaded["Body"].read().decode() == body
    assert uploaded["ServerSideEncryption"] in ("AES256", "aws:kms")


def test_a_failed_job_stack_removes_its_uploaded_template(run, ready, profile_data, monkeypatch):
    import os
    from pathlib import Path

    p = profile_data()
    p["subnet_ids"] = ["subnet-0000000000000dead"]
    Path(os.environ["PETCTL_HOME"], "profiles", "default.json").write_text(json.dumps(p))
    r = run("run_job", "--name", "broken", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 1 and "Traceback" not in r.output
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    assert s3.list_objects_v2(Bucket=bucket, Prefix="petctl/jobs/broken/").get("KeyCount") == 0
