"""cfn-lint rules for the data at rest: EFS encrypted; S3 buckets encrypted, private and TLS-only.

A value hidden behind Fn::If or any other intrinsic counts as a violation (see
:mod:`petctl.lint_rules`). cfn-lint loads this file by path: keep it free of relative imports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cfnlint.template import Template

from petctl.lint_rules._common import Finding, as_list, each_property, get_in, is_true, properties, rule

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
