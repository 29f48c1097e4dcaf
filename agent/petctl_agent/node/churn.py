"""A job that keeps failing after it trained stops itself: node failures since its last progress.

The rule of :mod:`.failure` (``GIVE_UP_AFTER`` failures while no node of the run ever started its
workers) ends a job that never worked. Once one did, each failing node was marked Unhealthy and
replaced, without end: a script deleted from S3 mid-job (every replacement fails its fetch), a job
below ``min_nodes`` whose nodes time out one after another, an etcd download refused for every new
rendezvous server. Each replacement is a billed boot, and with a warm pool the pool refills forever.

So the job counts its node failures *since it last trained*:

- **Progress mark.** While the workers report new steps, the agent writes ``boot/progress/mark``
  (beside the failure records; one small PUT per :data:`MARK_INTERVAL` at most, and none while
  nothing trains). Its time (the object's LastModified) is the job's last training progress.
- **Failures since.** The failure records (``boot/<instance-id>.log``, one per failed boot or
  terminal agent failure) newer than the mark. Without a mark (no step ever reported: a script
  that does not report progress) the cap does not apply; :mod:`.failure`'s rule for a job whose
  workers never started still does.
- **Cap.** :data:`MAX_NODE_FAILURES` (the job spec's ``max_node_failures``, ``run-job
  --max-node-failures``; default 10): the failure that reaches it scales both groups to zero and
  deletes the warm pool (:meth:`.lifecycle.Lifecycle.scale_groups_to_zero`), and the job's reason
  (its newest failure record, which ``petctl status`` shows) says so. The boot scripts' give-up
  (``cfn_templates/user_data/common.sh.j2``) counts the same way, from the same objects.

A job that trains while some replacements fail is not stopped: each step it makes moves the mark.
Its failures cost boots, but the job ends when its training does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("petctl_agent")

#: the default cap on node failures since the job last trained (the spec's ``max_node_failures``)
MAX_NODE_FAILURES = 10
#: the mark's name under the job's ``boot/`` prefix (a sub-prefix: never counted as a failure)
MARK_NAME = "progress/mark"


def mark_interval() -> float:
    """Seconds between two progress marks at most (``PETCTL_PROGRESS_MARK_INTERVAL``, default 60)."""
    return float(os.environ.get("PETCTL_PROGRESS_MARK_INTERVAL") or 60)


class ProgressMark:
    """Wraps the status document's refresh (``StepInfo``): when ``last_step`` moved since the last
    mark and :func:`mark_interval` has passed, writes the mark through ``writer`` (the job's
    ``boot/`` prefix). Best effort: a failed write is tried again at the next refresh."""

    def __init__(
        self, refresh: Callable[[], dict[str, Any]], writer: Any, interval: float | None = None
    ) -> None:
        self.refresh = refresh
        self.writer = writer
        self.interval = mark_interval() if interval is None else interval
        self._marked: Any = None
        self._at = float("-inf")

    def __call__(self) -> dict[str, Any]:
        info = self.refresh()
        step = info.get("last_step")
        now = time.monotonic()
        if step is not None and step != self._marked and now - self._at >= self.interval:
            try:
                self.writer.write(MARK_NAME, f'{{"step": {int(step)}, "t": {time.time():.3f}}}\n'.encode())
                self._marked, self._at = step, now
            except Exception as e:  # noqa: BLE001 - the status thread must go on
                log.warning("could not write the progress mark (will retry): %s", e)
        return info


def _listing(url: str, region: str | None) -> tuple[list[datetime], datetime | None]:
    """The failure records' times directly under ``url`` (``boot/``) and the mark's, if any."""
    u = urlparse(url)
    if u.scheme == "s3":
        from petctl_agent.cloud import aws

        prefix = u.path.lstrip("/")
        s3 = aws.client("s3", region)
        times = [
            o["LastModified"]
            for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=u.netloc, Prefix=prefix, Delimiter="/"
            )
            for o in page.get("Contents", [])
        ]
        # listed, not read: the instance roles may list the job's prefix but not read boot/ (S3
        # answers 403 for an object the caller may not read, never "not found")
        marks = s3.list_objects_v2(Bucket=u.netloc, Prefix=prefix + MARK_NAME).get("Contents", [])
        mark = next((o["LastModified"] for o in marks if o["Key"] == prefix + MARK_NAME), None)
        return times, mark
    d = Path(u.path if u.scheme == "file" else url)

    def when(p: Path) -> datetime:
        return datetime.fromtimestamp(p.stat().st_mtime, timezone.utc)

    times = [when(p) for p in d.iterdir() if p.is_file() and not p.name.startswith(".")] if d.is_dir() else []
    m = d / MARK_NAME
    return times, when(m) if m.is_file() else None


def failures_since_progress(url: str, region: str | None = None) -> tuple[int, datetime | None]:
    """How many failure records under ``url`` (the job's ``boot/``) are newer than the progress
    mark, and the mark's time; ``(0, None)`` without a mark: a job that never reported a step
    (a script that does not call ``ckpt.step``) is left to the rule for jobs that never trained,
    never stopped for failures spread over its whole life."""
    times, mark = _listing(url, region)
    if mark is None:
        return 0, None
    return sum(1 for t in times if t > mark), mark
