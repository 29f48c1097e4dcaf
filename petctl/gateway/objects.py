"""S3: uploads, the files agents and boot scripts publish, and emptying a bucket."""

from __future__ import annotations

import json
from typing import Any

from petctl.errors import AwsError, ConfigError, PetctlError, describe_client_error
from petctl.gateway.session import ClientError
from petctl.storage import Upload


class Objects:
    def __init__(self, s3: Any) -> None:
        self.s3 = s3

    def put_object(self, bucket: str, upload: Upload, kms_key: str | None = None) -> None:
        """Put one object, encrypted at rest: with ``kms_key`` (the bucket's customer key, which
        the job roles may use) when given, else with S3's own keys."""
        extra = (
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": kms_key}
            if kms_key
            else {"ServerSideEncryption": "AES256"}
        )
        try:
            if upload.data is not None:
                self.s3.put_object(Bucket=bucket, Key=upload.key, Body=upload.data, **extra)
            else:
                self.s3.upload_file(upload.path, bucket, upload.key, ExtraArgs=extra)
        except Exception as e:  # boto3's S3 transfer raises several types
            raise AwsError(f"upload to s3://{bucket}/{upload.key} failed: {describe_client_error(e)}") from e

    def https_url(self, bucket: str, key: str) -> str:
        """The object's virtual-hosted https URL in this client's region: what CloudFormation
        takes as a ``TemplateURL`` (an S3 bucket in the stack's region, https only)."""
        region = self.s3.meta.region_name or "us-east-1"
        domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
        return f"https://{bucket}.s3.{region}.{domain}/{key}"

    def exists(self, bucket: str, key: str) -> bool:
        """Whether the object exists; a PetctlError when S3 does not say (no access, ...)."""
        try:
            self.s3.head_object(Bucket=bucket, Key=key)
            return True
        except Exception as e:  # noqa: BLE001 - ClientError, or no access at all
            code = describe_client_error(e)
            if code.startswith(("404", "NoSuchKey", "NoSuchBucket", "NotFound")):
                return False
            raise PetctlError(code) from e

    def listing(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix`` (``Key``, ``LastModified``, ``Size``)."""
        return [
            o
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        ]

    def read(self, bucket: str, key: str) -> bytes | None:
        """The whole object, or None when it does not exist."""
        try:
            return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as e:
            if describe_client_error(e).startswith(("404", "NoSuchKey", "NoSuchBucket")):
                return None
            raise AwsError(f"cannot read s3://{bucket}/{key} ({describe_client_error(e)})") from e

    def tail(self, bucket: str, key: str, size: int) -> bytes:
        """The last ``size`` bytes of an object."""
        return self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=-{size}")["Body"].read()

    def read_json_objects(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        """Every ``*.json`` object under ``prefix``, parsed; unreadable ones are skipped."""
        result = []
        for o in self.listing(bucket, prefix):
            if not o["Key"].endswith(".json"):
                continue
            try:
                body = self.s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                result.append(json.loads(body))
            except Exception:  # noqa: BLE001 - a half-written or foreign object must not break status
                continue
        return result

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many."""
        count = 0
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            # a listing page holds at most 1,000 keys, DeleteObjects' limit per request
            for i in range(0, len(keys), 1000):
                chunk = keys[i : i + 1000]
                resp = self.s3.delete_objects(Bucket=bucket, Delete={"Objects": chunk, "Quiet": True})
                # DeleteObjects answers 200 even when keys fail (AccessDenied...): each one in Errors
                errors = resp.get("Errors") or []
                if errors:
                    e = errors[0]
                    raise AwsError(
                        f"could not delete {len(errors)} of {len(chunk)} objects under s3://{bucket}/{prefix}, "
                        f"e.g. {e.get('Key')}: {e.get('Code')} {e.get('Message', '')}".rstrip()
                    )
                count += len(chunk)
        return count

    def empty_bucket(self, bucket: str) -> int:
        """Delete every object (and version) so CloudFormation can delete the bucket."""
        count = 0
        try:
            for page in self.s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
                batch = [
                    {"Key": o["Key"], "VersionId": o["VersionId"]}
                    for o in page.get("Versions", []) + page.get("DeleteMarkers", [])
                ]
                for i in range(0, len(batch), 1000):
                    chunk = batch[i : i + 1000]
                    self.s3.delete_objects(Bucket=bucket, Delete={"Objects": chunk, "Quiet": True})
                    count += len(chunk)
        except ClientError as e:
            if "NoSuchBucket" in describe_client_error(e):
                return count
            raise AwsError(f"cannot empty bucket {bucket} ({describe_client_error(e)})") from e
        return count

    def require_bucket(self, bucket: str, region: str | None = None) -> None:
        """The bucket exists, is ours to read, and (given ``region``) lives in that region.

        Job stacks are created from a template in this bucket (``TemplateURL``), and CloudFormation
        takes a TemplateURL only from a bucket in the stack's own region: a bucket elsewhere would
        pass ``setup`` and fail every ``run-job``.
        """
        try:
            self.s3.head_bucket(Bucket=bucket)
        except ClientError as e:
            raise PetctlError(
                f"S3 bucket {bucket} was not found or is not accessible ({describe_client_error(e)})"
            ) from e
        if region is None:
            return
        try:
            where = self.s3.get_bucket_location(Bucket=bucket).get("LocationConstraint")
        except ClientError as e:
            raise PetctlError(
                f"cannot read where S3 bucket {bucket} lives ({describe_client_error(e)}); "
                "petctl needs s3:GetBucketLocation on it"
            ) from e
        # GetBucketLocation: no constraint is us-east-1; "EU" is the old name of eu-west-1.
        where = {None: "us-east-1", "": "us-east-1", "EU": "eu-west-1"}.get(where, where)
        if where != region:
            raise ConfigError(
                f"S3 bucket {bucket} is in {where}, not in this profile's region {region}: job stacks "
                f"are created from templates in it, and CloudFormation takes those only from a bucket in "
                f"the stack's region; use a bucket in {region}, or --region {where}"
            )

    def default_kms_key(self, bucket: str) -> str | None:
        """The KMS key id (or alias, or ARN) the bucket encrypts new objects with, else None."""
        try:
            rules = self.s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
        except ClientError as e:
            if "ServerSideEncryptionConfigurationNotFound" in describe_client_error(e):
                return None
            raise AwsError(
                f"cannot read the encryption of bucket {bucket} ({describe_client_error(e)})"
            ) from e
        for rule in rules:
            default = rule.get("ApplyServerSideEncryptionByDefault") or {}
            if str(default.get("SSEAlgorithm", "")).startswith("aws:kms") and default.get("KMSMasterKeyID"):
                return default["KMSMasterKeyID"]
        return None
