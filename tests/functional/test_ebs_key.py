"""run-job refuses an account whose default EBS key Auto Scaling may not use (every launch would
fail), before anything is created; AWS's managed key and a key that allows the role pass.

The moto server (with the local cloud's patches) keeps the account's default EBS key and the
key's policy and grants; petctl reads them over HTTP as it does on AWS.
"""

from __future__ import annotations

import json

import boto3
import pytest

from petctl.jobs.ebs_key import NEEDED, SLR_PATH, grants_allow, policy_allows

ACCOUNT = "123456789012"  # moto's
ROLE = f"arn:aws:iam::{ACCOUNT}:{SLR_PATH}"
ROOT_ONLY = {
    "Version": "2012-10-17",
    "Statement": [
        {
            "Effect": "Allow",
            "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
            "Action": "kms:*",
            "Resource": "*",
        }
    ],
}
# AWS's documented statements for the role (EC2 Auto Scaling User Guide, key-policy-requirements-EBS-encryption)
WITH_ROLE = {
    "Version": "2012-10-17",
    "Statement": ROOT_ONLY["Statement"]
    + [
        {
            "Effect": "Allow",
            "Principal": {"AWS": ROLE},
            "Action": [
                "kms:Encrypt",
                "kms:Decrypt",
                "kms:ReEncrypt*",
                "kms:GenerateDataKey*",
                "kms:DescribeKey",
            ],
            "Resource": "*",
        },
        {
            "Effect": "Allow",
            "Principal": {"AWS": ROLE},
            "Action": "kms:CreateGrant",
            "Resource": "*",
            "Condition": {"Bool": {"kms:GrantIsForAWSResource": True}},
        },
    ],
}


@pytest.fixture
def default_key():
    ec2, kms = boto3.client("ec2"), boto3.client("kms")
    yield ec2, kms
    ec2.reset_ebs_default_kms_key_id()


def dry_run(run, script):
    return run("run_job", "--dry-run", "--min", "1", "--max", "2", str(script))


def test_a_customer_default_key_auto_scaling_may_not_use_is_refused_before_anything_is_made(
    run, ready, default_key
):
    ec2, kms = default_key
    assert ec2.get_ebs_default_kms_key_id()["KmsKeyId"] == "alias/aws/ebs"
    assert dry_run(run, ready).exit_code == 0  # AWS's managed key: nothing to check
    key = kms.create_key(Policy=json.dumps(ROOT_ONLY))["KeyMetadata"]["Arn"]
    ec2.modify_ebs_default_kms_key_id(KmsKeyId=key)
    stacks = boto3.client("cloudformation").list_stacks()["StackSummaries"]
    for args in (("--dry-run",), ()):
        r = run("run_job", *args, "--min", "1", "--max", "2", str(ready))
        assert r.exit_code != 0
        lines = r.output.strip().splitlines()
        assert "Traceback" not in r.output
        assert any(
            key in line and "AWSServiceRoleForAutoScaling" in line and "create-grant" in line
            for line in lines
        ), r.output
    assert boto3.client("cloudformation").list_stacks()["StackSummaries"] == stacks  # nothing made

    kms.put_key_policy(KeyId=key, PolicyName="default", Policy=json.dumps(WITH_ROLE))
    assert dry_run(run, ready).exit_code == 0


def test_a_grant_to_the_role_is_as_good_as_the_key_policy(run, ready, default_key):
    ec2, kms = default_key
    key = kms.create_key(Policy=json.dumps(ROOT_ONLY))["KeyMetadata"]["Arn"]
    ec2.modify_ebs_default_kms_key_id(KmsKeyId=key)
    assert dry_run(run, ready).exit_code != 0
    ops = [
        "Encrypt",
        "Decrypt",
        "ReEncryptFrom",
        "ReEncryptTo",
        "GenerateDataKey",
        "GenerateDataKeyWithoutPlaintext",
        "DescribeKey",
        "CreateGrant",
    ]
    kms.create_grant(KeyId=key, GranteePrincipal=ROLE, Operations=ops)
    assert dry_run(run, ready).exit_code == 0
    kms.disable_key(KeyId=key.rsplit("/", 1)[1])  # (moto's DisableKey takes the id, not the ARN)
    r = dry_run(run, ready)
    assert r.exit_code != 0 and "is Disabled" in r.output


def test_what_the_policy_check_counts():
    assert policy_allows(WITH_ROLE, ROLE)
    assert not policy_allows(ROOT_ONLY, ROLE)  # the role's own policy grants it no KMS action
    star = {"Statement": {"Effect": "Allow", "Principal": "*", "Action": "kms:*"}}
    assert policy_allows(star, ROLE)
    deny = {"Statement": [{"Effect": "Deny", "Principal": {"AWS": ROLE}, "Action": "kms:*"}]}
    assert not policy_allows(deny, ROLE)
    partial = {"Statement": [{"Effect": "Allow", "Principal": {"AWS": [ROLE]}, "Action": ["kms:Decrypt"]}]}
    assert not policy_allows(partial, ROLE)
    assert not grants_allow([{"GranteePrincipal": ROLE, "Operations": ["Decrypt"]}], ROLE)
    assert grants_allow([{"GranteePrincipal": ROLE, "Operations": [n.split(":")[1] for n in NEEDED]}], ROLE)
