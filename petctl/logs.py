"""Reading a job's log lines in time order, once each (the agents write stream ``<job>/<instance-id>``)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from petctl.errors import ConfigError

if TYPE_CHECKING:
    from petctl.gateway.logs import Logs

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: ``logs`` without ``--since`` reads this far back (a days-long job has gigabytes of lines).
DEFAULT_WINDOW_S = 3600


def parse_duration(text: str) -> int:
    """``90s``, ``10m``, ``2h``, ``1d`` → seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ConfigError(f"--since {text!r} is not a duration like 30s, 10m, 2h or 1d")
    return int(m.group(1)) * _UNIT[m.group(2)]


class LogFollower:
    """New log events of a job on each ``poll()`` (time order, each event once)."""

    def __init__(
        self,
        logs: Logs,
        group: str,
        job: str,
        since_seconds: int | None = None,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.logs, self.group = logs, group
        # Without --since: a bounded recent window, never the whole group from the epoch.
        window = since_seconds if since_seconds else DEFAULT_WINDOW_S
        self.start_ms = int((clock() - window) * 1000)
        self.prefix = f"{job}/{instance}" if instance else f"{job}/"
        self.seen: set[str] = set()

    def poll(self) -> list[dict[str, Any]]:
        batch = self.logs.events(self.group, self.prefix, self.start_ms)
        new, newest = [], self.start_ms
        for ev in sorted(batch, key=lambda e: (e["timestamp"], e.get("eventId", ""))):
            eid = ev.get("eventId") or f"{ev['logStreamName']}:{ev['timestamp']}:{ev['message']}"
            newest = max(newest, ev["timestamp"])
            if eid not in self.seen:
                self.seen.add(eid)
                new.append(ev)
        # Streams deliver late: look back a little next time; ``seen`` drops repeats.
        self.start_ms = max(self.start_ms, newest - 30_000)
        return new


def iter_events(
    logs: Logs,
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
    follower = LogFollower(logs, group, job, since_seconds, instance, clock)
    polls = 0
    while True:
        yield from follower.poll()
        polls += 1
        if not follow or (max_polls is not None and polls >= max_polls):
            return
        sleep(poll)
