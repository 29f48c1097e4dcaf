"""boto3 sessions and clients: profile, region, endpoint URL, retries, --debug call logging.

Clients are created lazily and cached. The endpoint comes from boto3's own
``AWS_ENDPOINT_URL`` handling (the local cloud sets it), so the code path is
the same against AWS and against the local cloud.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from petctl.errors import AwsError, ConfigError, describe_client_error
from petctl.ui import cmd

_RETRIES = botocore.config.Config(
    retries={"max_attempts": 8, "mode": "standard"}, connect_timeout=10, read_timeout=60
)


NO_CREDENTIALS = "no AWS credentials found: run `aws configure`, set AWS_PROFILE, or try `petctl --local`"


def default_region() -> str | None:
    """The region aws-cli would use (AWS_REGION, AWS_DEFAULT_REGION, then ~/.aws/config)."""
    try:
        return boto3.session.Session().region_name
    except Exception:  # noqa: BLE001 - a broken ~/.aws/config only loses the default
        return None


class Clients:
    """Factory of boto3 clients for one profile and region."""

    def __init__(
        self,
        region: str | None,
        aws_profile: str | None = None,
        endpoint_url: str | None = None,
        debug: Callable[[str], None] | None = None,
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
                f"no AWS region: pass --region, set AWS_REGION, or record one with `{cmd('configure --region')}`"
            )
        self.endpoint_url = endpoint_url
        self.debug = debug
        self._cache: dict[str, Any] = {}

    def __call__(self, service: str) -> Any:
        if service not in self._cache:
            kwargs: dict[str, Any] = {"config": _RETRIES}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            client = self.session.client(service, **kwargs)
            if self.debug is not None:
                _log_calls(client, self.debug)
            self._cache[service] = client
        return self._cache[service]

    def check_credentials(self) -> str:
        """Return the caller's account id, or raise a one-line error."""
        try:
            return self("sts").get_caller_identity()["Account"]
        except botocore.exceptions.NoCredentialsError as e:
            raise ConfigError(NO_CREDENTIALS) from e
        except botocore.exceptions.ClientError as e:
            raise AwsError(f"AWS rejected the credentials ({describe_client_error(e)})") from e
        except botocore.exceptions.EndpointConnectionError as e:
            raise AwsError(f"cannot reach AWS ({e}); check the network or AWS_ENDPOINT_URL") from e


_SECRET = re.compile(r"secret|password|token|credential|^body$|userdata|policydocument", re.I)


def redact(value: Any, key: str = "") -> Any:
    """API parameters as --debug shows them: secrets hidden, long values cut."""
    if key and _SECRET.search(key):
        return "<hidden>"
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value[:20]] + (["..."] if len(value) > 20 else [])
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, str) and len(value) > 200:
        return value[:80] + f"...<{len(value)} chars>"
    return value


def _log_calls(client: Any, debug: Callable[[str], None]) -> None:
    """--debug: one line per AWS call: service.operation, parameters (secrets hidden), result, latency."""
    events = client.meta.events

    def remember(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["petctl_params"] = redact(params)
        context["petctl_t0"] = time.monotonic()

    def report(
        http_response: Any, parsed: dict[str, Any], model: Any, context: dict[str, Any], **_: Any
    ) -> None:
        ms = (time.monotonic() - context.get("petctl_t0", time.monotonic())) * 1000
        code = (parsed or {}).get("Error", {}).get("Code") or getattr(http_response, "status_code", "?")
        debug(
            f"aws {model.service_model.service_name}.{model.name} {context.get('petctl_params', {})} "
            f"-> {code} in {ms:.0f} ms"
        )

    events.register("provide-client-params.*.*", remember)
    events.register("after-call.*.*", report)


ClientError = botocore.exceptions.ClientError
