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

from petctl.errors import AwsError, ConfigError, describe_aws_error, describe_client_error
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
        check_region(self.session, self.region)
        check_endpoints(endpoint_url)
        self.endpoint_url = endpoint_url
        self.debug = debug
        self._cache: dict[str, Any] = {}

    def __call__(self, service: str) -> Any:
        if service not in self._cache:
            kwargs: dict[str, Any] = {"config": _RETRIES}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            client = self.session.client(service, **kwargs)
            client.meta.events.register("after-call.*.*", _name_the_service)
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
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (400, 401, 403):
                raise AwsError(f"AWS rejected the credentials ({describe_client_error(e)})") from e
            raise AwsError(describe_aws_error(e)) from e
        except botocore.exceptions.BotoCoreError as e:
            raise AwsError(describe_aws_error(e)) from e


def _name_the_service(parsed: Any, model: Any, **_: Any) -> None:
    """An AWS error names its service (``describe_aws_error``): botocore raises the ClientError
    with this very ``parsed`` dict as its ``response``, after this event."""
    if isinstance(parsed, dict) and isinstance(parsed.get("Error"), dict):
        parsed["Error"].setdefault("PetctlService", model.service_model.service_name)


#: Region names are lower-case words and a number (us-east-1, ap-southeast-7, us-gov-west-1).
_REGION_NAME = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")


def known_regions(session: Any, partitions: tuple[str, ...] | None = None) -> list[str]:
    """Every region botocore's own endpoint data lists, in all partitions (aws, aws-cn, ...)."""
    regions: set[str] = set()
    for partition in partitions or session.get_available_partitions():
        for service in ("cloudformation", "ec2"):
            regions.update(session.get_available_regions(service, partition_name=partition))
    return sorted(regions)


#: Shown when a wrong region resembles none that exists.
_COMMON_REGIONS = ("us-east-1", "us-east-2", "us-west-2", "eu-west-1", "eu-central-1", "ap-northeast-1")


def check_region(session: Any, region: str) -> None:
    """Refuse a region that does not exist before any call (AWS would answer with a DNS failure of
    ``cloudformation.<region>.amazonaws.com`` only after retries), listing some that do."""
    known = known_regions(session)
    if region in known:
        return
    commercial = known_regions(session, ("aws",))
    some = [r for r in commercial if r.startswith(region.split("-")[0] + "-")] or [
        r for r in _COMMON_REGIONS if r in commercial
    ]
    hint = "" if _REGION_NAME.match(region) else " (a region is a name like us-east-1)"
    raise ConfigError(
        f"region {region!r} does not exist{hint}; {len(known)} do, e.g. {', '.join(some[:8])} "
        f"(pass --region; a region newer than this botocore needs `pip install -U botocore`)"
    )


def check_endpoints(endpoint_url: str | None) -> None:
    """An endpoint (``--local``'s, or AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_<SERVICE>) must be an
    http(s) URL with a host: botocore would fail on it with a ValueError at the first client."""
    import os
    from urllib.parse import urlsplit

    named = [("endpoint", endpoint_url)] if endpoint_url else []
    named += [(k, v) for k, v in sorted(os.environ.items()) if k.startswith("AWS_ENDPOINT_URL") and v]
    for name, url in named:
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1) > 0
        except ValueError:  # a port that is not a number
            ok = False
        if not ok:
            raise ConfigError(
                f"{name}={url!r} is not an endpoint URL; use http(s)://HOST[:PORT] (e.g. http://127.0.0.1:5000), "
                f"or unset it to reach AWS"
            )


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
