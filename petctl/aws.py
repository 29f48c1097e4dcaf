"""boto3 sessions and clients: profile, region, endpoint URL, retries.

Clients are created lazily and cached. The endpoint comes from boto3's own
``AWS_ENDPOINT_URL`` handling (the local cloud sets it), so the code path is
the same against AWS and against the local cloud.
"""

from __future__ import annotations

from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from petctl.errors import AwsError, ConfigError, describe_client_error

_RETRIES = botocore.config.Config(
    retries={"max_attempts": 8, "mode": "standard"}, connect_timeout=10, read_timeout=60
)


class Clients:
    """Factory of boto3 clients for one profile and region."""

    def __init__(
        self, region: str | None, aws_profile: str | None = None, endpoint_url: str | None = None
    ) -> None:
        try:
            available = boto3.session.Session().available_profiles
            use_profile = aws_profile if aws_profile in available else None
            self.session = boto3.session.Session(profile_name=use_profile, region_name=region)
        except botocore.exceptions.BotoCoreError as e:
            raise ConfigError(f"cannot create an AWS session: {e}") from e
        self.region = self.session.region_name
        if not self.region:
            raise ConfigError(
                "no AWS region: pass --region, set AWS_REGION, or record one with `petctl configure --region`"
            )
        self.endpoint_url = endpoint_url
        self._cache: dict[str, Any] = {}

    def __call__(self, service: str) -> Any:
        if service not in self._cache:
            kwargs: dict[str, Any] = {"config": _RETRIES}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            self._cache[service] = self.session.client(service, **kwargs)
        return self._cache[service]

    def check_credentials(self) -> str:
        """Return the caller's account id, or raise a one-line error."""
        try:
            return self("sts").get_caller_identity()["Account"]
        except botocore.exceptions.NoCredentialsError as e:
            raise ConfigError(
                "no AWS credentials found: run `aws configure`, set AWS_PROFILE, or try `petctl --local`"
            ) from e
        except botocore.exceptions.ClientError as e:
            raise AwsError(f"AWS rejected the credentials ({describe_client_error(e)})") from e
        except botocore.exceptions.EndpointConnectionError as e:
            raise AwsError(f"cannot reach AWS ({e}); check the network or AWS_ENDPOINT_URL") from e


def is_not_found(err: Exception) -> bool:
    """True for a ClientError that means "no such thing"."""
    code = (getattr(err, "response", None) or {}).get("Error", {}).get("Code", "")
    msg = (getattr(err, "response", None) or {}).get("Error", {}).get("Message", "")
    return code in ("ValidationError", "NoSuchKey", "NoSuchBucket", "ResourceNotFoundException", "404") and (
        "does not exist" in msg or code != "ValidationError"
    )


ClientError = botocore.exceptions.ClientError
BotoCoreError = botocore.exceptions.BotoCoreError
