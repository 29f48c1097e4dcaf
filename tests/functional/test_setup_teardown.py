"""`petctl setup` / `teardown` against a real moto server over HTTP."""

from __future__ import annotations

import json

import boto3


def cf():
    return boto3.client("cloudformation")


def test_setup_creates_base_stack_and_records_outputs(run, profile_data):
    r = run("setup")
    assert r.exit_code == 0, r.output
    assert "base stack petctl-default created" in r.stdout
    assert "creating stack petctl-default" in r.stderr  # visible progress
    p = profile_data()
    assert p["stack_name"] == "petctl-default" and p["managed"] is True and p["region"] == "us-east-1"
    assert len(p["subnet_ids"]) == 2 and all(s.startswith("subnet-") for s in p["subnet_ids"])
    for key in ("vpc_id", "efs_id", "bucket", "security_group_id", "log_group"):
        assert p[key], key
    # each job stack makes its own roles: the profile records no instance profiles
    assert p["worker_instance_profile_arn"] is None and p["rdzv_instance_profile_arn"] is None
    status = cf().describe_stacks(StackName="petctl-default")["Stacks"][0]["StackStatus"]
    assert status == "CREATE_COMPLETE"


def test_setup_clears_instance_profiles_of_an_older_base_stack(run, profile_data):
    """Profiles made by an older petctl record the base stack's instance profiles; once setup has
    run they must go (the roles are gone from the base stack), so jobs make their own."""
    import os
    from pathlib import Path

    assert run("setup").exit_code == 0
    path = Path(os.environ["PETCTL_HOME"]) / "profiles" / "default.json"
    data = profile_data()
    data["worker_instance_profile_arn"] = "arn:aws:iam::123456789012:instance-profile/old-worker"
    data["rdzv_instance_profile_arn"] = "arn:aws:iam::123456789012:instance-profile/old-rdzv"
    path.write_text(json.dumps(data))
    r = run("setup")
    assert r.exit_code == 0, r.output
    p = profile_data()
    assert p["worker_instance_profile_arn"] is None and p["rdzv_instance_profile_arn"] is None


OLD_BASE = """
Resources:
  Handle:
    Type: AWS::CloudFormation::WaitConditionHandle
Outputs:
  WorkerInstanceProfileArn:
    Value: arn:aws:iam::123456789012:instance-profile/old-worker
  RdzvInstanceProfileArn:
    Value: arn:aws:iam::123456789012:instance-profile/old-rdzv
"""


def test_setup_refuses_to_take_roles_from_running_jobs_of_an_older_base_stack(run):
    """An older base stack gives its roles (and self-ingress) to its jobs: updating it while one
    runs would cut that job off, so setup refuses before any change."""
    cf().create_stack(StackName="petctl-default", TemplateBody=OLD_BASE)
    cf().create_stack(
        StackName="petctl-job-old-1",
        TemplateBody=OLD_BASE,
        Tags=[{"Key": "petctl:profile", "Value": "default"}],
    )
    r = run("setup")
    assert r.exit_code != 0
    assert "still gives its instance roles and network to job(s) old-1" in r.stderr
    (stack,) = cf().describe_stacks(StackName="petctl-default")["Stacks"]
    assert {o["OutputKey"] for o in stack["Outputs"]} == {
        "WorkerInstanceProfileArn",
        "RdzvInstanceProfileArn",
    }


OLD_JOB = """
Resources:
  WorkerGroup:
    Type: AWS::CloudFormation::WaitConditionHandle
"""
# Only the logical id matters to setup's check; the real one is an AWS::EFS::AccessPoint (a type
# moto's CloudFormation lists as a resource of the stack is enough here).
NEW_JOB = """
Resources:
  JobAccessPoint:
    Type: AWS::SQS::Queue
"""


def _job_stack(name: str, body: str, profile: str = "default") -> None:
    cf().create_stack(StackName=name, TemplateBody=body, Tags=[{"Key": "petctl:profile", "Value": profile}])


def test_setup_refuses_to_lock_out_jobs_that_mount_the_root(run):
    """Jobs of an earlier petctl mount the file system's root; the file system policy setup sets
    denies that, so their replacements would never mount: setup refuses while one exists, before
    any change, and goes on once it is gone (jobs with an access point do not stop it)."""
    assert run("setup").exit_code == 0
    _job_stack("petctl-job-new-1", NEW_JOB)
    _job_stack("petctl-job-old-1", OLD_JOB)
    _job_stack("petctl-job-other", OLD_JOB, profile="x")  # another profile's: not this setup's business
    before = cf().describe_stacks(StackName="petctl-default")["Stacks"][0]
    r = run("setup", "--az-count", "3")
    assert r.exit_code != 0
    assert "job(s) old-1 mount the file system without an access point" in r.stderr
    assert "Traceback" not in r.output
    after = cf().describe_stacks(StackName="petctl-default")["Stacks"][0]
    assert after.get("LastUpdatedTime") == before.get("LastUpdatedTime")
    assert after["Parameters"] == before["Parameters"]
    cf().delete_stack(StackName="petctl-job-old-1")
    r = run("setup", "--az-count", "3")
    assert r.exit_code == 0, r.output


def test_setup_again_updates_in_place(run):
    assert run("setup").exit_code == 0
    r = run("--output", "json", "setup")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["action"] in ("unchanged", "updated")
    stacks = [s for s in cf().describe_stacks()["Stacks"] if s["StackName"].startswith("petctl-")]
    assert len(stacks) == 1


def test_setup_with_three_azs(run, profile_data):
    r = run("setup", "--az-count", "3")
    assert r.exit_code == 0, r.output
    assert len(profile_data()["subnet_ids"]) == 3


def test_setup_with_existing_bucket_and_efs(run, profile_data):
    boto3.client("s3").create_bucket(Bucket="team-bucket")
    fs = boto3.client("efs").create_file_system(CreationToken="t", Encrypted=True)["FileSystemId"]
    r = run("setup", "--s3-bucket", "team-bucket", "--efs-id", fs, "--efs-apply-policy")
    assert r.exit_code == 0, r.output
    p = profile_data()
    assert p["bucket"] == "team-bucket" and p["efs_id"] == fs and p["bucket_created"] is False
    targets = boto3.client("efs").describe_mount_targets(FileSystemId=fs)["MountTargets"]
    assert sorted(t["SubnetId"] for t in targets) == sorted(p["subnet_ids"])


def test_setup_with_missing_efs_names_it_and_creates_nothing(run):
    r = run("setup", "--efs-id", "fs-0123456789abcdef0")
    assert r.exit_code == 1
    assert "EFS file system fs-0123456789abcdef0 was not found" in r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.output
    assert cf().describe_stacks()["Stacks"] == []


def test_setup_with_malformed_bucket(run):
    r = run("setup", "--s3-bucket", "No_Such_Bucket!")
    assert r.exit_code == 2 and "'No_Such_Bucket!' for --s3-bucket is not an S3 bucket name" in r.stderr


def test_setup_without_credentials(run, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    r = run("setup")
    assert r.exit_code == 2
    assert "no AWS credentials found" in r.stderr and "Traceback" not in r.output


def test_setup_without_region(run, monkeypatch):
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    r = run("--profile", "noregion", "setup")
    assert r.exit_code == 2 and "no AWS region" in r.stderr


def test_teardown_removes_stack_and_empties_bucket(run, profile_data):
    assert run("setup").exit_code == 0
    bucket = profile_data()["bucket"]
    boto3.client("s3").put_object(Bucket=bucket, Key="petctl/leftover.txt", Body=b"x")
    r = run("teardown", "--yes")
    assert r.exit_code == 0, r.output
    assert "removed: petctl-default" in r.stdout and "emptied 1 S3 objects" in r.stdout
    assert [s for s in cf().describe_stacks()["Stacks"] if s["StackStatus"] != "DELETE_COMPLETE"] == []
    assert profile_data()["stack_name"] is None
    # nothing of the stack is left behind (moto leaks the VPC and its route table: swept up)
    assert "left behind: nothing" in r.stdout and "warning:" not in r.stderr
    ec2 = boto3.client("ec2")
    assert ec2.describe_vpcs(Filters=[{"Name": "tag:petctl:profile", "Values": ["default"]}])["Vpcs"] == []
    assert ec2.describe_internet_gateways()["InternetGateways"] == []


def test_teardown_twice_is_harmless(run):
    assert run("setup").exit_code == 0
    assert run("teardown", "--yes").exit_code == 0
    r = run("teardown", "--yes")
    assert r.exit_code == 0 and "nothing to remove" in r.stdout


def test_setup_rejects_bad_vpc_cidr_before_any_call(run):
    r = run("setup", "--vpc-cidr", "10.0.0.0/8")
    assert r.exit_code == 2 and "--vpc-cidr" in r.stderr and "/16" in r.stderr
    assert cf().describe_stacks()["Stacks"] == []


def test_region_other_than_the_profiles_is_refused(run, monkeypatch):
    assert run("setup").exit_code == 0
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    r = run("jobs")
    assert r.exit_code == 2
    assert "profile 'default' lives in us-east-1" in r.stderr and "--region us-east-1" in r.stderr
    assert run("--region", "us-east-1", "jobs").exit_code == 0


def _file_systems() -> list[str]:
    return [f["FileSystemId"] for f in boto3.client("efs").describe_file_systems()["FileSystems"]]


def test_failed_first_setup_leaves_no_file_system(run, monkeypatch):
    """The file system is RetainExceptOnCreate: the failed create that made it deletes it (the local
    cloud's moto patch does what AWS documents), where Retain left an orphan on every failed setup."""
    from moto.efs.models import EFSBackend

    def no_mount_targets(self, *args, **kwargs):
        raise RuntimeError("mount target creation failed")

    monkeypatch.setattr(EFSBackend, "create_mount_target", no_mount_targets)
    r = run("setup")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert _file_systems() == []


def test_teardown_keeps_the_file_system_a_successful_setup_made(run, profile_data):
    assert run("setup").exit_code == 0
    efs_id = profile_data()["efs_id"]
    assert run("teardown", "--yes").exit_code == 0
    assert _file_systems() == [efs_id]


def test_setup_refuses_a_bucket_in_another_region_and_creates_nothing(run):
    """Job stacks are created from a template in the bucket (TemplateURL), which CloudFormation
    takes only from the stack's region: such a bucket would pass setup and fail every run-job."""
    boto3.client("s3", region_name="eu-west-1").create_bucket(
        Bucket="far-bucket", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    r = run("setup", "--s3-bucket", "far-bucket")
    assert r.exit_code == 2, r.output
    assert "S3 bucket far-bucket is in eu-west-1, not in this profile's region us-east-1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert cf().describe_stacks()["Stacks"] == []
    # a bucket of the profile's region is taken (us-east-1: no LocationConstraint at all)
    boto3.client("s3").create_bucket(Bucket="near-bucket")
    assert run("setup", "--s3-bucket", "near-bucket").exit_code == 0
