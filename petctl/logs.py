"""CloudWatch Logs of a job: the agents write stream ``<job>/<instance-id>``."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from petctl.errors import ConfigError, PetctlError
from petctl.ui import cmd

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """``90s``, ``10m``, ``2h``, ``1d`` → seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ConfigError(f"--since {text!r} is not a duration like 30s, 10m, 2h or 1d")
    return int(m.group(1)) * _UNIT[m.group(2)]


def has_streams(logs: Any, group: str, job: str) -> bool:
    """Did any instance of ``job`` ever write a log stream?"""
    try:
        streams = logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=f"{job}/", limit=1)
    except Exception as e:  # noqa: BLE001 - a missing group has no streams
        if (getattr(e, "response", None) or {}).get("Error", {}).get("Code") == "ResourceNotFoundException":
            return False
        raise
    return bool(streams.get("logStreams"))


def iter_events(
    logs: Any,
    group: str,
    job: str,
    since_seconds: int | None = None,
    instance: str | None = None,
    follow: bool = False,
    poll: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
    max_polls: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield log events in time order; with ``follow``, keep polling for new ones."""
    start_ms = int((clock() - since_seconds) * 1000) if since_seconds else 0
    prefix = f"{job}/{instance}" if instance else f"{job}/"
    seen: set[str] = set()
    polls = 0
    while True:
        kwargs: dict[str, Any] = {"logGroupName": group, "logStreamNamePrefix": prefix, "startTime": start_ms}
        newest = start_ms
        try:
            paginator = logs.get_paginator("filter_log_events")
            pages = paginator.paginate(**kwargs)
            batch = []
            for page in pages:
                batch.extend(page.get("events", []))
        except Exception as e:  # noqa: BLE001
            code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code")
            if code == "ResourceNotFoundException":
                raise PetctlError(
                    f"log group {group} does not exist; was `{cmd('setup')}` run for this profile?"
                ) from e
            raise
        for ev in sorted(batch, key=lambda e: (e["timestamp"], e.get("eventId", ""))):
            eid = ev.get("eventId") or f"{ev['logStreamName']}:{ev['timestamp']}:{ev['message']}"
            if eid in seen:
                continue
            seen.add(eid)
            newest = max(newest, ev["timestamp"])
            yield ev
        polls += 1
        if not follow or (max_polls is not None and polls >= max_polls):
            return
        # Streams deliver late: look back a little; ``seen`` drops what was already printed.
        start_ms = max(start_ms, newest - 30_000)
        sleep(poll)
