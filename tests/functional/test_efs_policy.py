"""`setup --efs-id`: a file system open to mounts without an access point is refused, or given
petctl's Deny statements with `--efs-apply-policy`; the file system petctl creates moves old data
to cheaper classes and backs up on request. Against a real moto server over HTTP (the local
cloud's patches answer the policy calls as EFS does)."""

from __future__ import annotations

import json

import boto3
import pytest

from petctl.infra.efs_policy import petctl_policy
from petctl.local.shims.efs_policy import authorize


def _fs(token: str = "mine") -> tuple[str, str]:
    fs = boto3.client("efs").create_file_system(CreationToken=token, Encrypted=True)
    return fs["FileSystemId"], fs["FileSystemArn"]


def _policy(fs: str) -> dict | None:
    efs = boto3.client("efs")
    try:
        return json.loads(efs.describe_file_system_policy(FileSystemId=fs)["Policy"])
    except efs.exceptions.PolicyNotFound:
        return None


def _put(fs: str, *statements: dict) -> None:
    policy = {"Version": "2012-10-17", "Statement": list(statements)}
    boto3.client("efs").put_file_system_policy(FileSystemId=fs, Policy=json.dumps(policy))


def _stacks() -> list[str]:
    return [s["StackName"] for s in boto3.client("cloudformation").describe_stacks()["Stacks"]]


MOUNT = ["elasticfilesystem:ClientMount", "elasticfilesystem:ClientWrite"]
ALLOW_EVERYONE = {"Sid": "console", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": MOUNT}
ADMIN = {
    "Sid": "admin",
    "Effect": "Allow",
    "Principal": {"AWS": "arn:aws:iam::123456789012:role/efs-admin"},
    "Action": MOUNT + ["elasticfilesystem:ClientRootAccess"],
}


def _root_mount(policy: dict | None, fs_arn: str) -> str | None:
    """What EFS answers an anonymous TLS mount of the root (the local cloud's mount evaluator)."""
    context = {"aws:SecureTransport": "true", "elasticfilesystem:AccessedViaMountTarget": "true"}
    return authorize("elasticfilesystem:ClientMount", fs_arn, policy, None, [], context)


def test_a_file_system_without_a_policy_is_refused_and_nothing_is_made(run):
    fs, arn = _fs()
    assert _root_mount(None, arn) is None  # EFS's default: anyone mounts the root
    r = run("setup", "--efs-id", fs)
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in r.output
    assert f"EFS file system {fs} has no file system policy" in line
    assert "every other job's checkpoints" in line and f"setup --efs-id {fs} --efs-apply-policy" in line
    assert _stacks() == [] and _policy(fs) is None


@pytest.mark.parametrize(
    "statements, why",
    [
        ([ALLOW_EVERYONE], "does not deny mounts without an access point"),
        # a Deny that also needs something else (no TLS) does not stop a root mount over TLS
        (
            [
                {
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": MOUNT,
                    "Condition": {
                        "Null": {"elasticfilesystem:AccessPointArn": "true"},
                        "Bool": {"aws:SecureTransport": "false"},
                    },
                }
            ],
            "does not deny mounts without an access point",
        ),
        # the Deny is there, but everyone may mount every job's access point
        (petctl_policy()["Statement"] + [ALLOW_EVERYONE], "statement console allows every principal"),
        # ... also when the Allow only asks for *some* access point: any job's
        *(
            (
                petctl_policy()["Statement"] + [{**ALLOW_EVERYONE, "Condition": cond}],
                "statement console allows every principal",
            )
            for cond in (
                {"Null": {"elasticfilesystem:AccessPointArn": "false"}},
                {"StringLike": {"elasticfilesystem:AccessPointArn": "*"}},
                {"StringEquals": {"elasticfilesystem:AccessPointArn": "arn:aws:elasticfilesystem:*"}},
            )
        ),
    ],
)
def test_a_policy_that_lets_one_job_reach_another_is_refused(run, statements, why):
    fs, _ = _fs()
    _put(fs, *statements)
    r = run("setup", "--efs-id", fs)
    assert r.exit_code == 2, r.output
    assert why in r.stderr and "--efs-apply-policy" in r.stderr
    assert _stacks() == []


def test_apply_policy_sets_petctls_policy_and_goes_on(run, profile_data):
    fs, arn = _fs()
    r = run("--output", "json", "setup", "--efs-id", fs, "--efs-apply-policy")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["efs_policy"] == "applied"
    assert _policy(fs) == petctl_policy()
    assert profile_data()["efs_id"] == fs and _stacks() == ["petctl-default"]
    assert _root_mount(_policy(fs), arn) is not None  # the root is closed now
    # setup again: the policy is petctl's already, nothing to change
    r = run("--output", "json", "setup", "--efs-id", fs)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["efs_policy"] == "checked"


def test_apply_policy_keeps_the_owners_statements(run):
    fs, _ = _fs()
    _put(fs, ADMIN)
    r = run("setup", "--efs-id", fs, "--efs-apply-policy")
    assert r.exit_code == 0, r.output
    statements = _policy(fs)["Statement"]
    assert statements[0] == ADMIN and statements[1:] == petctl_policy()["Statement"]


def test_apply_policy_never_removes_an_allow_for_everyone(run):
    fs, _ = _fs()
    _put(fs, ALLOW_EVERYONE)
    r = run("setup", "--efs-id", fs, "--efs-apply-policy")
    assert r.exit_code == 2, r.output
    assert "allows every principal" in r.stderr and "never removes yours" in r.stderr
    assert _policy(fs)["Statement"] == [ALLOW_EVERYONE] and _stacks() == []


def test_the_efs_flags_that_do_not_fit_are_refused_before_any_call(run):
    r = run("setup", "--efs-apply-policy")
    assert r.exit_code == 2 and "--efs-apply-policy goes with --efs-id" in r.stderr
    r = run("setup", "--efs-id", "fs-0123456789abcdef0", "--efs-backup")
    assert r.exit_code == 2 and "put-backup-policy" in r.stderr
    assert _stacks() == []


def test_the_file_system_petctl_makes_tiers_old_data_and_backs_up_on_request(run, profile_data):
    r = run("setup", "--efs-backup")
    assert r.exit_code == 0, r.output
    efs, fs = boto3.client("efs"), profile_data()["efs_id"]
    policies = efs.describe_lifecycle_configuration(FileSystemId=fs)["LifecyclePolicies"]
    assert policies == [
        {"TransitionToIA": "AFTER_30_DAYS"},
        {"TransitionToArchive": "AFTER_90_DAYS"},
        {"TransitionToPrimaryStorageClass": "AFTER_1_ACCESS"},
    ]
    assert efs.describe_backup_policy(FileSystemId=fs)["BackupPolicy"]["Status"] == "ENABLED"
    # setup again without the flag keeps the backups
    r = run("setup")
    assert r.exit_code == 0, r.output
    stack = boto3.client("cloudformation").describe_stacks(StackName="petctl-default")["Stacks"][0]
    assert {p["ParameterKey"]: p["ParameterValue"] for p in stack["Parameters"]}["EfsBackup"] == "ENABLED"


def test_the_local_cloud_answers_policy_calls_as_efs_does(aws):
    efs = boto3.client("efs")
    with pytest.raises(efs.exceptions.FileSystemNotFound):
        efs.describe_file_system_policy(FileSystemId="fs-0123456789abcdef0")
    fs, _ = _fs()
    with pytest.raises(efs.exceptions.InvalidPolicyException):
        efs.put_file_system_policy(FileSystemId=fs, Policy="{not json")
    with pytest.raises(efs.exceptions.InvalidPolicyException):
        efs.put_file_system_policy(FileSystemId=fs, Policy=json.dumps({"Statement": [{"Effect": "Deny"}]}))
    with pytest.raises(efs.exceptions.PolicyNotFound):
        efs.describe_file_system_policy(FileSystemId=fs)
