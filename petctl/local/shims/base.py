"""What every shim shares: its two ways to end (:class:`Refused`, :class:`Failed`), the instance
context from the boot script's environment, and the one way to reach the local cloud's moto."""

from __future__ import annotations

import fcntl
import os
import re
import sys
from pathlib import Path
from typing import Any

#: What each ``bin/`` wrapper of an instance runs: ``exec <python> -I SCRIPT <command> "$@"``.
SCRIPT = Path(__file__).resolve().with_name("__main__.py")


class Refused(Exception):
    """The shim does not do this (exit 2)."""


class Failed(Exception):
    """The command failed as the real one would (exit code ``rc``)."""

    def __init__(self, message: str, rc: int = 1) -> None:
        super().__init__(message)
        self.rc = rc


def env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise Refused(f"{name} is not set: this shim only runs inside a local cloud instance")
    return value


def root() -> Path:
    return Path(env("PETCTL_LOCAL_ROOT"))


def state_dir() -> Path:
    return Path(env("PETCTL_LOCAL_STATE"))


def log(cmd: str, message: str) -> None:
    print(f"{cmd} (petctl local shim): {message}", file=sys.stderr, flush=True)


def inside_root(path: str, what: str) -> Path:
    """``path`` as given by the (rewritten) boot script: it must lie in the instance's root."""
    p = Path(path)
    r = root()
    if not p.is_absolute() or not (p == r or r in p.parents):
        raise Refused(
            f"{what} {path!r} is outside the instance's root {r} (the boot script's paths are mapped there)"
        )
    return p


def locked(path: Path) -> int:
    """An open descriptor of ``path`` holding its exclusive lock (released when closed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def client(service: str) -> Any:
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if not re.match(r"^http://127\.\d+\.\d+\.\d+:\d+/?$", endpoint):
        raise Refused(
            f"AWS_ENDPOINT_URL={endpoint!r} is not the local cloud's moto server: refusing to call AWS"
        )
    import boto3

    return boto3.session.Session().client(
        service, endpoint_url=endpoint, region_name=os.environ.get("AWS_REGION", "us-east-1")
    )
