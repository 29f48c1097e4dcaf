"""What a job's boots left, as status shows it: the boot log summary (:class:`BootFailures`: how
many failed, the newest one's tail and error line) and each boot's phases with their seconds.

Pure, as :mod:`petctl.jobs.state`: it reads what ``observe`` gathered (the boot log listing, the
newest log's end, the boot events documents, the agents' reports).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from petctl.jobs.reasons import REASON_LINE_MAX, first_error_line
from petctl.jobs.status import BootFailures

#: How much of the newest boot log status shows.
BOOT_LOG_LINES = 15


def boot_summary(
    logs: list[dict[str, Any]], newest_tail: bytes, prefix: str, docs: list[dict[str, Any]] | None = None
) -> BootFailures:
    """:class:`BootFailures` from the boot log listing (newest last), the newest log's end and the
    boot events documents (``docs``: the error line a failing boot published)."""
    docs = docs or []
    if not logs:
        return BootFailures()
    newest = logs[-1]
    lines = [line for line in newest_tail.decode("utf-8", "replace").splitlines() if line.strip()]
    instance_id = newest["Key"][len(prefix) : -len(".log")]
    return BootFailures(
        count=len(logs),
        instance_id=instance_id,
        at=iso(newest.get("LastModified")),
        last_lines=lines[-BOOT_LOG_LINES:],
        error=published_error(docs, instance_id) or first_error_line(lines),
    )


def published_error(docs: list[dict[str, Any]], instance_id: str) -> str | None:
    """The first error line the boot script of ``instance_id`` published with its ``boot_failed``
    event (it read its whole log; the tail petctl reads may have lost it)."""
    for d in docs:
        if d.get("instance_id") != instance_id:
            continue
        for e in d.get("events") or []:
            if isinstance(e, dict) and e.get("kind") == "boot_failed" and str(e.get("error") or "").strip():
                return str(e["error"]).strip()[:REASON_LINE_MAX]
    return None


#: Boot stages the agent runs itself (after the boot script started it) and reports as events:
#: the job's requirements, installed (not found cached) or failed. Their phase is their own time.
AGENT_BOOT_STAGES = ("requirements_installed", "requirements_failed")


def _agent_stages(reports: list[dict[str, Any]], instance_id: Any, since: float) -> list[dict[str, Any]]:
    return [
        e
        for r in reports
        if r.get("instance_id") == instance_id
        for e in r.get("events") or []
        if isinstance(e, dict)
        and e.get("kind") in AGENT_BOOT_STAGES
        and not e.get("cached")
        and isinstance(e.get("t"), (int, float))
        and e["t"] >= since
    ]


def boot_phases(
    docs: list[dict[str, Any]], reports: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Each boot's timestamped events, oldest boot first, with ``phases`` (each event after the
    first, with the seconds since the one before, or its own ``seconds``: the agent's stages of
    :data:`AGENT_BOOT_STAGES`, from its ``reports``) and ``seconds`` (first to last event)."""
    out = []
    for d in docs:
        events = [
            e for e in d.get("events") or [] if isinstance(e, dict) and isinstance(e.get("t"), (int, float))
        ]
        if not events:
            continue
        events = sorted(
            events + _agent_stages(reports or [], d.get("instance_id"), events[0]["t"]), key=lambda e: e["t"]
        )
        phases = [
            {
                "kind": b["kind"],
                "seconds": round(
                    b["seconds"]
                    if b["kind"] in AGENT_BOOT_STAGES and isinstance(b.get("seconds"), (int, float))
                    else b["t"] - a["t"],
                    2,
                ),
            }
            for a, b in zip(events, events[1:])
        ]
        out.append(
            {
                "instance_id": d.get("instance_id"),
                "role": d.get("role"),
                "events": events,
                "phases": phases,
                "seconds": round(events[-1]["t"] - events[0]["t"], 2),
            }
        )
    return sorted(out, key=lambda d: d["events"][0]["t"])


def iso(value: Any) -> str | None:
    """An ISO 8601 UTC timestamp (JSON keeps these; text shows ages)."""
    if hasattr(value, "isoformat"):
        return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")
    return str(value) if value else None
