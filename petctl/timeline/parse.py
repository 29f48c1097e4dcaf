"""What the agents' status documents say, cleaned up: events, rendezvous rounds, progress, steps/s.

Agents of several versions wrote these documents, so every field is optional and may be junk:
a value that is not a finite number reads as missing.
"""

from __future__ import annotations

import math
from typing import Any


def number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def integer(v: Any) -> int | None:
    f = number(v)
    return None if f is None else int(f)


def read_events(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that have a time and a kind, oldest first."""
    out = []
    for e in st.get("events") or []:
        t = number(e.get("t"))
        if t is None or not e.get("kind"):
            continue
        out.append({**e, "t": t})
    out.sort(key=lambda e: e["t"])
    return out


def read_rounds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rendezvous rounds that started workers, in time order. A round's ``instances``: the nodes
    whose workers started in it, and any that left as it closed (``rendezvous_done`` with
    ``leaving``: its peers counted it; ``left``: when).

    Rounds are keyed by (epoch, round): an etcd that lost its state numbers rounds from 0
    again, which starts a new epoch.
    """
    rounds: dict[tuple[int, int], dict[str, Any]] = {}
    epoch, max_round = 0, -1
    # the step each instance's workers loaded, per round: ``workers_started`` carries the newest
    # step persisted on EFS when they started; a ``snapshot_restored`` after it (same instance) says
    # what they did load, which is newer when the state came from memory while its EFS write was
    # still under way (a join that lost no step read as 5 lost without it)
    loaded: dict[tuple[int, int], dict[Any, int]] = {}
    last_start: dict[Any, tuple[int, int]] = {}
    for e in events:
        if e["kind"] == "snapshot_restored":
            key = last_start.get(e.get("instance_id"))
            step = integer(e.get("step"))
            if key is not None and step is not None:
                loaded.setdefault(key, {})[e.get("instance_id")] = step
            continue
        if e["kind"] not in ("rendezvous_done", "workers_started", "quorum"):
            continue
        r = integer(e.get("round"))
        if r is None:
            continue
        if max_round >= 0 and r < max_round and (r == 0 or max_round - r >= 2):
            epoch, max_round = epoch + 1, -1
        max_round = max(max_round, r)
        rec = rounds.setdefault(
            (epoch, r),
            {
                "round": r,
                "epoch": epoch,
                "instances": set(),
                "first": None,
                "ready": None,
                "world_size": None,
                "nodes": None,
                "rdzv_started": None,
                "step_after": None,
                "left": {},  # instance -> when it published the round it left as it closed
            },
        )
        if e["kind"] in ("workers_started", "quorum"):
            # a live job's quorum (node/live.py): its members publish it, keyed by the step at which
            # it first committed (the same on each), with no worker start
            rec["instances"].add(e.get("instance_id"))
            rec["first"] = e["t"] if rec["first"] is None else min(rec["first"], e["t"])
            rec["ready"] = e["t"] if rec["ready"] is None else max(rec["ready"], e["t"])
            rec["world_size"] = integer(e.get("world_size")) or rec["world_size"]
            last_start[e.get("instance_id")] = (epoch, r)
            step = integer(e.get("step"))
            if step is not None:
                loaded.setdefault((epoch, r), {})[e.get("instance_id")] = step
        else:
            if e.get("leaving"):
                # a leave came as this round closed with the node: its peers counted it (``nodes``)
                # and it left before starting workers; it is in the round, and gone from the next
                rec["instances"].add(e.get("instance_id"))
                rec["left"][e.get("instance_id")] = e["t"]
            nodes = integer(e.get("nodes"))
            if nodes is not None:
                rec["nodes"] = max(rec["nodes"] or 0, nodes)
            started = number(e.get("started"))
            if started is not None:
                rec["rdzv_started"] = (
                    started if rec["rdzv_started"] is None else min(rec["rdzv_started"], started)
                )
            rec["world_size"] = rec["world_size"] or integer(e.get("world_size"))
    for key, steps in loaded.items():
        if key in rounds and steps:
            rounds[key]["step_after"] = min(steps.values())
    done = [r for r in rounds.values() if r["ready"] is not None]
    done.sort(key=lambda r: r["ready"])
    for r in done:
        r["nodes"] = r["nodes"] or len(r["instances"])
    return done


def read_progress(st: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(t, step) samples from the documents and events, oldest first."""
    samples: list[dict[str, Any]] = []
    for a in st.get("agents") or []:
        iid = a.get("instance_id")
        for p in a.get("progress") or []:
            if isinstance(p, dict):
                t, s = number(p.get("t")), integer(p.get("step"))
            elif isinstance(p, list | tuple) and len(p) >= 2:
                t, s = number(p[0]), integer(p[1])
            else:
                continue
            if t is not None and s is not None:
                samples.append({"t": t, "step": s, "instance_id": iid, "source": "progress"})
        step = integer(a.get("last_step"))
        t = number(a.get("last_step_at")) or number(a.get("updated_at"))
        if step is not None and t is not None:
            samples.append({"t": t, "step": step, "instance_id": iid, "source": "status document"})
    for e in events:
        step = integer(e.get("step", e.get("last_step")))
        if step is not None:
            samples.append(
                {"t": e["t"], "step": step, "instance_id": e.get("instance_id"), "source": e["kind"]}
            )
    samples.sort(key=lambda s: (s["t"], s["step"]))
    out: list[dict[str, Any]] = []
    for s in samples:
        if out and s["step"] == out[-1]["step"] and s["t"] - out[-1]["t"] < 1.0:
            continue
        out.append(s)
    return out


def overlap(a0: float, a1: float, intervals: list[tuple[float, float]]) -> float:
    """Seconds of [a0, a1] that fall inside the (disjoint) intervals."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in intervals)


def throughput(samples: list[dict[str, Any]], training: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Steps/s between successive progress samples, over the training time between them."""
    segs = []
    prev = None
    for s in samples:
        if prev is not None and s["t"] - prev["t"] >= 1.0 and s["step"] > prev["step"]:
            train = overlap(prev["t"], s["t"], training) if training else s["t"] - prev["t"]
            if train > 0.5:
                segs.append(
                    {
                        "t0": prev["t"],
                        "t1": s["t"],
                        "steps": s["step"] - prev["step"],
                        "train_s": round(train, 3),
                        "steps_per_s": round((s["step"] - prev["step"]) / train, 3),
                    }
                )
        if prev is None or s["t"] - prev["t"] >= 1.0 or s["step"] < prev["step"]:
            prev = s
    return segs
