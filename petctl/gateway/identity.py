"""STS and KMS: who the caller is, and whether a bucket's key is one petctl can work with."""

from __future__ import annotations

from typing import Any

from petctl.errors import ConfigError, describe_client_error
from petctl.gateway.session import ClientError


class Keys:
    def __init__(self, kms: Any) -> None:
        self.kms = kms

    def customer_key_arn(self, key: str, bucket: str) -> str | None:
        """The ARN of ``key`` when it is a customer key (AWS-managed keys need no grant: None).
        A key petctl cannot even describe cannot work: a ConfigError naming ``bucket``."""
        try:
            meta = self.kms.describe_key(KeyId=key)["KeyMetadata"]
        except ClientError as e:
            raise ConfigError(
                f"bucket {bucket} encrypts with KMS key {key}, which petctl cannot use "
                f"({describe_client_error(e)}): grant kms:DescribeKey on it, or use another bucket"
            ) from e
        return None if meta.get("KeyManager") == "AWS" else meta["Arn"]

    def describe(self, key: str) -> dict[str, Any] | None:
        """``DescribeKey``'s metadata, or None when the key cannot be read."""
        try:
            return self.kms.describe_key(KeyId=key)["KeyMetadata"]
        except ClientError:
            return None

    def policy_and_grants(self, key: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The key's default policy (a JSON string) and its grants; None for what cannot be read."""
        try:
            policy = self.kms.get_key_policy(KeyId=key, PolicyName="default")["Policy"]
        except ClientError:
            return None, None
        try:
            grants = [
                g
                for page in self.kms.get_paginator("list_grants").paginate(KeyId=key)
                for g in page["Grants"]
            ]
        except ClientError:
            grants = None
        return policy, grants
