"""cfn-lint rules for the data at rest: EFS encrypted, its policy and mounts confining each job to its
access point; S3 buckets encrypted, private and TLS-only.

A value hidden behind Fn::If or any other intrinsic counts as a violation (see
:mod:`petctl.lint_rules`). cfn-lint loads this file by path: keep it free of relative imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from cfnlint.template import Template

from petctl.lint_rules._common import (
    Finding,
    as_list,
    each_property,
    get_in,
    is_true,
    properties,
    rule,
    strings,
)

BLOCK_SETTINGS = ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")
ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")


@rule("E9103", "https://docs.aws.amazon.com/efs/latest/ug/encryption.html", "efs", "encryption")
def EfsEncrypted(cfn: Template) -> Iterator[Finding]:
    """EFS file systems are encrypted

    Every AWS::EFS::FileSystem sets Encrypted: true.
    """
    for name, encrypted in each_property(cfn, ["AWS::EFS::FileSystem"], "Encrypted"):
        if not is_true(encrypted):
            yield ["Resources", name, "Properties"], f"EFS file system {name} must set Encrypted: true"


@rule(
    "E9104",
    "https://docs.aws.amazon.com/AmazonS3/latest/userguide/access-control-block-public-access.html",
    "s3",
)
def BucketEncryptedAndPrivate(cfn: Template) -> Iterator[Finding]:
    """S3 buckets are encrypted and block public access

    Every AWS::S3::Bucket has default server-side encryption and a PublicAccessBlockConfiguration
    with all four settings true.
    """
    for name, resource in cfn.get_resources(["AWS::S3::Bucket"]).items():
        props = properties(resource)
        entries = get_in(props, "BucketEncryption", "ServerSideEncryptionConfiguration")
        algorithms = [
            entry.get("ServerSideEncryptionByDefault", {}).get("SSEAlgorithm")
            for entry in (entries if isinstance(entries, list) else [])
            if isinstance(entry, dict) and isinstance(entry.get("ServerSideEncryptionByDefault"), dict)
        ]
        if not algorithms or any(a not in ALGORITHMS for a in algorithms):
            yield (
                ["Resources", name, "Properties"],
                f"Bucket {name} must set default encryption ({' or '.join(ALGORITHMS)})",
            )
        block = props.get("PublicAccessBlockConfiguration")
        missing = [s for s in BLOCK_SETTINGS if not is_true(get_in(block, s))]
        if missing:
            yield (
                ["Resources", name, "Properties"],
                f"Bucket {name} must block public access: {', '.join(missing)} not true",
            )


def _denies_plain_http(statement: Any) -> bool:
    if not isinstance(statement, dict) or statement.get("Effect") != "Deny":
        return False
    bool_condition = get_in(statement, "Condition", "Bool")
    if not isinstance(bool_condition, dict):
        return False
    value = bool_condition.get("aws:SecureTransport")
    return value is False or (isinstance(value, str) and value.lower() == "false")


@rule("E9107", "https://docs.aws.amazon.com/AmazonS3/latest/userguide/security-best-practices.html", "s3")
def BucketRequiresTls(cfn: Template) -> Iterator[Finding]:
    """S3 buckets deny requests without TLS

    Every AWS::S3::Bucket has a bucket policy denying requests where aws:SecureTransport is false.
    """
    protected = set()
    for resource in cfn.get_resources(["AWS::S3::BucketPolicy"]).values():
        props = properties(resource)
        bucket = props.get("Bucket")
        statements = as_list(get_in(props, "PolicyDocument", "Statement"))
        if isinstance(bucket, dict) and "Ref" in bucket and any(map(_denies_plain_http, statements)):
            protected.add(bucket["Ref"])
    for name in cfn.get_resources(["AWS::S3::Bucket"]):
        if name not in protected:
            yield (
                ["Resources", name],
                f"Bucket {name} needs a bucket policy denying aws:SecureTransport false",
            )


EFS_CLIENT_ACTIONS = (
    "elasticfilesystem:ClientMount",
    "elasticfilesystem:ClientWrite",
    "elasticfilesystem:ClientRootAccess",
)


def _denies_client_access(statement: Any, operator: str, key: str, value: str) -> bool:
    """A Deny of every EFS client action to every principal when ``operator: {key: value}``."""
    if not isinstance(statement, dict) or statement.get("Effect") != "Deny":
        return False
    if statement.get("Principal") not in ("*", {"AWS": "*"}):
        return False
    actions = {a for a in as_list(statement.get("Action")) if isinstance(a, str)}
    if not ("*" in actions or "elasticfilesystem:*" in actions or set(EFS_CLIENT_ACTIONS) <= actions):
        return False
    wanted = get_in(statement, "Condition", operator, key)
    return str(wanted).lower() == value and len(statement.get("Condition") or {}) == 1


@rule("E9112", "https://docs.aws.amazon.com/efs/latest/ug/iam-access-control-nfs-efs.html", "efs", "iam")
def EfsPolicyConfinesJobs(cfn: Template) -> Iterator[Finding]:
    """EFS file systems admit clients only through an access point, over TLS, never by policy alone

    Every AWS::EFS::FileSystem has a FileSystemPolicy that denies every client action to every
    principal when elasticfilesystem:AccessPointArn is absent (Null) and when aws:SecureTransport
    is false, and allows nothing itself: EFS grants what either the file system policy or the
    client's identity policy allows, so an Allow here would reach every job's access point.
    """
    for name, policy in each_property(cfn, ["AWS::EFS::FileSystem"], "FileSystemPolicy"):
        path = ["Resources", name, "Properties"]
        statements = as_list(get_in(policy, "Statement")) if policy else []
        if not any(
            _denies_client_access(s, "Null", "elasticfilesystem:AccessPointArn", "true") for s in statements
        ):
            yield path, f"EFS file system {name} must deny client access without an access point"
        if not any(_denies_client_access(s, "Bool", "aws:SecureTransport", "false") for s in statements):
            yield path, f"EFS file system {name} must deny client access without TLS"
        for index, statement in enumerate(statements):
            if not isinstance(statement, dict) or statement.get("Effect") != "Deny":
                yield (
                    [*path, "FileSystemPolicy", "Statement", index],
                    f"EFS file system {name}: the policy allows",
                )


#: One EFS mount in a boot script: ``mount -t efs -o OPTS`` or an fstab line of type efs.
EFS_MOUNT = re.compile(r"mount\s+-t\s+efs\s+-o\s+(\S+)|\s(?:/\S+|\$\w+)\s+efs\s+(\S+)\s")


@rule("E9113", "https://docs.aws.amazon.com/efs/latest/ug/mounting-IAM-option.html", "efs", "tls")
def EfsMountsThroughAccessPoint(cfn: Template) -> Iterator[Finding]:
    """Boot scripts mount EFS through an access point, with IAM and TLS

    Every EFS mount in a launch template's user data (``mount -t efs`` and /etc/fstab lines) has
    the options tls, iam and accesspoint=; a ``mount -t efs`` without -o is a violation too.
    """
    for name, data in each_property(cfn, ["AWS::EC2::LaunchTemplate"], "LaunchTemplateData"):
        path = ["Resources", name, "Properties", "LaunchTemplateData", "UserData"]
        for text in strings(get_in(data, "UserData")):
            for line in text.splitlines():
                if re.search(r"mount\s+-t\s+efs\b", line) and not re.search(r"mount\s+-t\s+efs\s+-o\s", line):
                    yield (
                        path,
                        f"{name}: EFS mounted without options (tls, iam, accesspoint=): {line.strip()}",
                    )
                for m in EFS_MOUNT.finditer(line + " "):
                    options = set((m.group(1) or m.group(2)).split(","))
                    missing = [o for o in ("tls", "iam") if o not in options]
                    if not any(o.startswith("accesspoint=") for o in options):
                        missing.append("accesspoint=")
                    if missing:
                        yield path, f"{name}: EFS mounted without {', '.join(missing)}: {line.strip()}"
