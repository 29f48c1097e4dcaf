"""Profiles on disk and the precedence of settings.

Precedence, written down once: command-line flag > environment variable >
profile file > built-in default.

A profile is a JSON file ``$PETCTL_HOME/profiles/<name>.json`` (``PETCTL_HOME``
defaults to ``~/.petctl``; tests point it at a temporary directory). It records
the region and the resources petctl works with: either the outputs of the base
stack written by ``petctl setup``, or existing resources recorded by
``petctl configure``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import petctl
from petctl import naming
from petctl.errors import ConfigError
from petctl.ui import cmd

DEFAULT_PROFILE = "default"
LOCAL_PROFILE = "local"

# Validation of the ids a user may type. Each message names the bad value.
_ID_PATTERNS = {
    "vpc_id": re.compile(r"^vpc-[0-9a-f]{8,17}$"),
    "subnet_id": re.compile(r"^subnet-[0-9a-f]{8,17}$"),
    "security_group_id": re.compile(r"^sg-[0-9a-f]{8,17}$"),
    "efs_id": re.compile(r"^fs-[0-9a-f]{8,40}$"),
    "bucket": re.compile(r"^(?!xn--)(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
    "region": re.compile(r"^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-\d$"),
    "instance_profile_arn": re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]+$"),
}
_HUMAN = {
    "vpc_id": "a VPC id like vpc-0abc1234",
    "subnet_id": "a subnet id like subnet-0abc1234",
    "security_group_id": "a security group id like sg-0abc1234",
    "efs_id": "an EFS file system id like fs-0abc1234",
    "bucket": "an S3 bucket name (3-63 lower-case letters, digits, dots, hyphens)",
    "region": "an AWS region like us-east-1",
    "instance_profile_arn": "an instance profile ARN like arn:aws:iam::123456789012:instance-profile/name",
}


def validate_id(kind: str, value: str, flag: str | None = None) -> str:
    """Return ``value`` if it looks like a ``kind`` id, else raise a ConfigError naming it."""
    if not _ID_PATTERNS[kind].match(value or ""):
        where = f" for {flag}" if flag else ""
        raise ConfigError(f"{value!r}{where} is not {_HUMAN[kind]}")
    return value


#: Profile fields a user records with ``configure`` -> the id kind that validates them.
FIELD_KINDS = {
    "region": "region",
    "vpc_id": "vpc_id",
    "subnet_ids": "subnet_id",
    "security_group_id": "security_group_id",
    "efs_id": "efs_id",
    "bucket": "bucket",
    "worker_instance_profile_arn": "instance_profile_arn",
    "rdzv_instance_profile_arn": "instance_profile_arn",
}


def validate_field(key: str, value: Any) -> Any:
    """A ``configure`` value checked and normalised (subnet ids: a list); ConfigError names it."""
    flag = "--" + key.replace("_", "-")
    if key == "subnet_ids":
        ids = [s.strip() for s in (value if isinstance(value, list) else str(value).split(",")) if s.strip()]
        for s in ids:
            validate_id("subnet_id", s, flag)
        return ids
    if key in FIELD_KINDS:
        validate_id(FIELD_KINDS[key], value, flag)
    return value


def home() -> Path:
    """The petctl state directory (``$PETCTL_HOME`` or ``~/.petctl``: :func:`petctl.home`)."""
    return petctl.home()


def profile_path(name: str) -> Path:
    return home() / "profiles" / f"{name}.json"


@dataclass
class Profile:
    """What petctl knows about one account/region setup."""

    name: str = DEFAULT_PROFILE
    region: str | None = None
    aws_profile: str | None = None  # named AWS credentials profile, when it differs from ``name``
    endpoint_url: str | None = None  # set only for the local cloud
    managed: bool = False  # True when the resources come from petctl's own base stack
    stack_name: str | None = None
    vpc_id: str | None = None
    subnet_ids: list[str] = field(default_factory=list)
    security_group_id: str | None = None
    efs_id: str | None = None
    bucket: str | None = None
    bucket_created: bool = False  # petctl created the bucket, so teardown may empty it
    bucket_kms_key_arn: str | None = None  # the existing bucket's customer KMS key (SSE-KMS)
    worker_instance_profile_arn: str | None = None
    rdzv_instance_profile_arn: str | None = None
    log_group: str | None = None
    vpc_cidr: str | None = None
    # A file system the base stack retained when it was torn down (it holds checkpoints):
    # `teardown --delete-data` can still delete it, `setup` points to it.
    retained_efs_ids: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    # No instance profiles: each job stack makes its own roles unless both ARNs are recorded.
    # vpc_id is looked up from the first subnet when missing (jobs.resolve_vpc).
    REQUIRED_FOR_JOBS = (
        "region",
        "subnet_ids",
        "security_group_id",
        "efs_id",
        "bucket",
    )

    def missing_for_jobs(self) -> list[str]:
        return [k for k in self.REQUIRED_FOR_JOBS if not getattr(self, k)]

    def require_ready(self) -> None:
        """Raise a ConfigError unless the profile can run jobs."""
        missing = self.missing_for_jobs()
        if missing:
            raise ConfigError(
                f"profile {self.name!r} is not set up (missing: {', '.join(missing)}); "
                f"run `{cmd('setup')}` or `{cmd('configure')}` first"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def validate_profile_name(name: str) -> str:
    if not naming.PROFILE_RE.match(name or ""):
        raise ConfigError(
            f"profile name {name!r} is invalid: use letters, digits and '-' (max 32, not starting with 'job-')"
        )
    return name


def load_profile(name: str, must_exist: bool = False) -> Profile:
    """Load a profile; a missing one is an empty profile unless ``must_exist``."""
    validate_profile_name(name)
    path = profile_path(name)
    if not path.exists():
        if must_exist:
            known = ", ".join(list_profiles()) or "none"
            raise ConfigError(
                f"unknown profile {name!r} (known: {known}); run `{cmd('setup')}` or `{cmd('configure')}`"
            )
        return Profile(name=name)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"profile file {path} is unreadable ({e}); fix or delete it") from e
    data["name"] = name
    return Profile.from_dict(data)


def save_profile(profile: Profile) -> Path:
    """Write a profile atomically (temp file + rename), readable only by the user."""
    path = profile_path(profile.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def list_profiles() -> list[str]:
    d = home() / "profiles"
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def resolve_profile_name(flag: str | None) -> str:
    """--profile > PETCTL_PROFILE > AWS_PROFILE > ``default``.

    An AWS profile name may hold characters a petctl profile cannot (``dev.admin``, ``a_b``):
    those become '-' rather than an error the user did not cause.
    """
    explicit = flag or os.environ.get("PETCTL_PROFILE")
    if explicit:
        return explicit
    aws = os.environ.get("AWS_PROFILE")
    if aws:
        mapped = re.sub(r"[^A-Za-z0-9-]+", "-", aws).strip("-")[:32] or DEFAULT_PROFILE
        return mapped if naming.PROFILE_RE.match(mapped) else DEFAULT_PROFILE
    return DEFAULT_PROFILE


def resolve_region(flag: str | None, profile: Profile) -> str | None:
    """--region > AWS_REGION > AWS_DEFAULT_REGION > profile > None (boto3's config file is consulted later)."""
    return flag or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or profile.region
