"""How the timeline writes times, durations and event kinds.

ISO 8601 and ``to_json`` for ``--output json``, axis ticks and durations for the charts,
a letter and a label per event kind.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

#: One letter per membership event on the terminal chart (and on the page's events lane).
KIND_LETTERS = {
    "start": "S",
    "join": "J",
    "drain": "D",
    "spot": "P",
    "loss": "L",
    "exclude": "X",
    "etcd_restart": "E",
    "restart": "R",
    "failure": "F",
    "finish": "*",
}
KIND_LABELS = {
    "start": "job start",
    "join": "node joined",
    "drain": "node drained (scale-in)",
    "spot": "spot interruption (drained)",
    "loss": "node lost (hard)",
    "exclude": "node excluded (failed rounds in a row began on it)",
    "etcd_restart": "rendezvous server (etcd) restart",
    "restart": "worker failure, restarted",
    "failure": "agent failed",
    "finish": "job finished",
}


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def tick_step(span: float, width: int) -> float:
    """The smallest round number of seconds between axis ticks that keeps them ten ``width`` units apart."""
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400):
        if step / span * width >= 10:
            return step
    return 86400 * max(1, math.ceil(span / 86400 / 6))


def fmt_tick(s: float, step: float) -> str:
    """An axis label: seconds, minutes or hours, whichever the tick step is counted in."""
    if s == 0:
        return "0"
    if step < 60:
        return f"{s:.0f}s"
    if step < 3600:
        return f"{s / 60:g}m"
    return f"{s / 3600:g}h"


def fmt_dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m < 120 else f"{m // 60}h{m % 60:02d}m"


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}"


def to_json(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every time as ISO 8601 (UTC) plus ``at_s``, seconds since the start."""
    t0 = data["start"]

    def rel(t: float | None) -> float | None:
        return None if t is None or t0 is None else round(t - t0, 3)

    def times(d: dict[str, Any], *keys: str) -> dict[str, Any]:
        out = dict(d)
        for k in keys:
            out[k] = iso(d.get(k))
        if keys:
            out["at_s" if keys[0] in ("t", "ready") else f"{keys[0]}_s"] = rel(d.get(keys[0]))
        return out

    return {
        **{k: v for k, v in data.items() if k not in ("start", "end")},
        "start": iso(data["start"]),
        "end": iso(data["end"]),
        "world": [times(w, "t") for w in data["world"]],
        "progress": [times(p, "t") for p in data["progress"]],
        "throughput": [{**times(s, "t0", "t1"), "t1_s": rel(s["t1"])} for s in data["throughput"]],
        "events": [times(m, "t") for m in data["events"]],
        "rounds": [
            {**times(r, "ready", "stall_from", "training_until"), "stall_from_s": rel(r["stall_from"])}
            for r in data["rounds"]
        ],
    }
