"""The timeline as data: rounds, what stopped training before each and for how long, world size over time.

A round's stall ("seconds of training the change cost") runs from the first sign that
training stopped (the first ``rendezvous_start`` of a training agent, ``drain_requested``
or ``workers_failed``; for a hard loss, the lost node's last report, an upper bound) to
the last ``workers_started`` of the new round. The time from there to the first step
(worker start-up, checkpoint load) is not reported by the agents and is not included.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

from petctl.timeline.parse import number, overlap, read_events, read_progress, read_rounds, throughput

STOP_KINDS = ("drain_requested", "workers_failed")
_ROUND_MOVED = re.compile(r"round moved on \((\d+|None) -> (\d+|None)\)")
#: Event kinds an agent publishes around a rendezvous-server outage it rides out (agent/petctl_agent/elastic/agent.py).
_RDZV_OUTAGE_KINDS = ("rdzv_unreachable", "rdzv_recovered", "etcd_unreachable", "etcd_restart")

#: ``marker(kind, t, instance_id, detail, round)`` records a membership event.
Marker = Callable[..., None]


def _first_round(rnd: dict[str, Any], events: list[dict], window: list[dict], marker: Marker) -> None:
    starts = [e["t"] for e in events if e["kind"] == "rendezvous_start" and e["t"] <= rnd["ready"]]
    rnd["stall_from"] = min(starts) if starts else (rnd["rdzv_started"] or rnd["first"])
    rnd["stall_source"] = "first rendezvous_start" if starts else "rendezvous_done.started"
    initial = any(e["kind"] == "agent_started" for e in window) or rnd["reason"] in ("", "initial")
    rnd["causes"].append("start" if initial else "unknown")
    if initial:
        ag = [e["t"] for e in window if e["kind"] == "agent_started"]
        marker("start", min(ag) if ag else rnd["stall_from"], None, "first rendezvous", rnd)
    rnd["step_before"] = None


def _left(
    prev: dict,
    rnd: dict,
    events: list[dict],
    docs: dict,
    stall_from: float,
    source: str | None,
    marker: Marker,
) -> tuple[float, str | None]:
    """Mark each node of ``prev`` missing from ``rnd`` as drained or lost; a loss can move the stall back."""
    hi = rnd["ready"]
    for iid in sorted(prev["instances"] - rnd["instances"], key=str):
        doc = docs.get(iid) or {}
        # a node that left as ``prev`` closed drained before ``prev``'s workers were all started
        lo = prev["left"].get(iid, prev["ready"])
        drain = next(
            (
                e
                for e in events
                if e["kind"] in ("drain_requested", "drained") and e.get("instance_id") == iid and e["t"] > lo
            ),
            None,
        )
        excluded = next(
            (
                e
                for e in events
                if e["kind"] == "excluded" and e.get("instance_id") == iid and lo < e["t"] <= hi
            ),
            None,
        )
        if excluded is not None:  # failed rounds in a row began on it: it left for good (agent/culprit.py)
            rnd["causes"].append("exclude")
            n = excluded.get("failures")
            marker("exclude", excluded["t"], iid, f"excluded after {n} failures that began on it", rnd)
            continue
        if drain is not None and drain["t"] <= hi:
            why = str(drain.get("reason") or doc.get("reason") or "")
            kind = "spot" if why.startswith("spot") else "drain"
            rnd["causes"].append(kind)
            marker(kind, drain["t"], iid, why, rnd)
            continue
        last = number(doc.get("updated_at"))
        rnd["causes"].append("loss")
        if last is not None and lo < last < stall_from:
            stall_from, source = last, "lost node's last report"
        marker("loss", last if last is not None and lo < last <= hi else stall_from, iid, "no drain", rnd)
    return stall_from, source


def _changed_round(
    prev: dict,
    rnd: dict,
    events: list[dict],
    window: list[dict],
    reasons: list[str],
    docs: dict,
    samples: list[dict],
    marker: Marker,
) -> None:
    """Why training stopped between ``prev`` and ``rnd``, since when, and who left or joined."""
    hi = rnd["ready"]
    stops = [
        e
        for e in window
        if e.get("instance_id") in prev["instances"]
        and (e["kind"] in STOP_KINDS or (e["kind"] == "rendezvous_start" and e.get("round") is not None))
    ]
    stall_from = min((e["t"] for e in stops), default=None)
    source = stops[0]["kind"] if stops else None
    # the reason of whatever stopped training first (a drain's own reason beats its peers'
    # "coordinated checkpoint"), else the first reason given for the round
    rnd["reason"] = next((str(e["reason"]) for e in stops if e.get("reason")), rnd["reason"])
    if stall_from is None:
        stall_from = rnd["rdzv_started"] or rnd["first"]
        source = "rendezvous_done.started" if rnd["rdzv_started"] else "first workers_started"
    stall_from, source = _left(prev, rnd, events, docs, stall_from, source, marker)
    for iid in sorted(rnd["instances"] - prev["instances"], key=str):
        arrived = [
            e["t"]
            for e in events
            if e.get("instance_id") == iid
            and e["kind"] in ("rendezvous_start", "agent_started")
            and e["t"] <= hi
        ]
        rnd["causes"].append("join")
        marker("join", max(arrived) if arrived else stall_from, iid, "joined the rendezvous", rnd)
    moved = [m for m in (_ROUND_MOVED.search(r) for r in reasons) if m]
    wiped = any(a != "None" and b != "None" and int(b) < int(a) for a, b in (m.groups() for m in moved))
    outage = [e for e in window if e["kind"] in _RDZV_OUTAGE_KINDS]
    if rnd["epoch"] != prev["epoch"] or wiped or outage:
        rnd["causes"].append("etcd_restart")
        marker("etcd_restart", outage[0]["t"] if outage else stall_from, None, "rendezvous state lost", rnd)
    if not rnd["causes"]:
        why = rnd["reason"]
        if "waiting to join" in why:
            rnd["causes"].append("join")
        elif "workers failed" in why or any(e["kind"] == "workers_failed" for e in stops):
            rnd["causes"].append("restart")
            marker("restart", stall_from, stops[0].get("instance_id") if stops else None, why, rnd)
        else:
            rnd["causes"].append("other")
    rnd["stall_from"], rnd["stall_source"] = stall_from, source
    before = [s for s in samples if prev["ready"] <= s["t"] <= hi]
    rnd["step_before"] = max((s["step"] for s in before), default=None)


def _unattached(events: list[dict], markers: list[dict], marker: Marker) -> None:
    """Drains and failures that belong to no round (a node left while booting, the job failed)."""
    seen = {(m["kind"], m["instance_id"]) for m in markers}
    for e in events:
        if e["kind"] == "drain_requested":
            kind = "spot" if str(e.get("reason") or "").startswith("spot") else "drain"
            if (kind, e.get("instance_id")) not in seen:
                marker(kind, e["t"], e.get("instance_id"), str(e.get("reason") or ""), None)
                seen.add((kind, e.get("instance_id")))
        elif e["kind"] == "failed":
            marker("failure", e["t"], e.get("instance_id"), str(e.get("reason") or ""), None)


def _span(
    st: dict, events: list[dict], rounds: list[dict], now: float, marker: Marker
) -> tuple[bool, float | None, float]:
    """Whether the job still runs, and when it started and ended (``now`` while it runs)."""
    state = st.get("state")
    succeeded = [e["t"] for e in events if e["kind"] == "succeeded"]
    failed = [e["t"] for e in events if e["kind"] == "failed"]
    updates = [u for u in (number(a.get("updated_at")) for a in st.get("agents") or []) if u is not None]
    running = state in ("RUNNING", "RENDEZVOUS", "STARTING", None)
    if state == "SUCCEEDED" and succeeded:
        end = min(succeeded)
        marker("finish", end, None, "succeeded", None)
    elif state == "FAILED" and failed:
        end = max(failed)
    elif running:
        end = now
    else:
        end = max(updates + [e["t"] for e in events], default=now)
    start = min([e["t"] for e in events] + updates, default=None)
    if rounds and rounds[0].get("stall_from") is not None:
        start = min(start, rounds[0]["stall_from"]) if start is not None else rounds[0]["stall_from"]
    return running, start, end


def _world(
    rounds: list[dict], start: float | None, end: float, running: bool
) -> tuple[list[tuple[float, float]], list[dict[str, Any]]]:
    """The training intervals, and the world size as steps over time (0 while not training)."""
    training: list[tuple[float, float]] = []
    world: list[dict[str, Any]] = []
    if start is not None:
        world.append({"t": start, "world_size": 0})
    for i, rnd in enumerate(rounds):
        stop = rounds[i + 1]["stall_from"] if i + 1 < len(rounds) else end
        stop = max(stop, rnd["ready"])
        rnd["training_until"] = stop
        training.append((rnd["ready"], stop))
        world.append({"t": rnd["ready"], "world_size": rnd["world_size"] or 0})
        if stop > rnd["ready"] and (i + 1 < len(rounds) or not running):
            world.append({"t": stop, "world_size": 0})
    if running and start is not None:
        world.append({"t": end, "world_size": world[-1]["world_size"] if world else 0})
    return training, world


def _missing(st: dict, events: list[dict], samples: list[dict], rounds: list[dict]) -> list[str]:
    """What the documents could not tell."""
    agents = st.get("agents") or []
    missing = []
    event_steps = any(e.get("step") is not None for e in events if e["kind"] != "succeeded")
    has_history = any(a.get("progress") for a in agents)
    if not samples:
        missing.append(
            "no progress: the script reports no steps (petctl_agent.checkpoint.report_progress), "
            "so there is no steps/s"
        )
    elif not has_history and not event_steps:
        missing.append(
            f"steps/s comes from {len(samples)} sample(s): a status document keeps only its latest "
            "last_step (no step history, and events carry no step)"
        )
    if rounds and not event_steps:
        missing.append(
            "stalls run to the last workers_started of the new round; the time to the first step "
            "after it (worker start-up, checkpoint load) and the steps lost are not reported"
        )
    if len(st.get("events") or []) and any(len(a.get("events") or []) >= 200 for a in agents):
        missing.append("an agent's events are capped at the newest 200: the start of the run may be cut")
    return missing


def build(st: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The timeline of ``st`` (``jobs.observe(...).to_dict()``, the ``status --output json`` document), all times epoch seconds."""
    now = time.time() if now is None else now
    events = read_events(st)
    agents = st.get("agents") or []
    ips = {a.get("instance_id"): a.get("private_ip") for a in agents}
    docs = {a.get("instance_id"): a for a in agents}
    for h in st.get("hosts") or []:
        ips.setdefault(h.get("instance_id"), h.get("private_ip"))
    rounds = read_rounds(events)
    samples = read_progress(st, events)
    state = st.get("state")
    markers: list[dict[str, Any]] = []

    def marker(kind: str, t: float, iid: Any = None, detail: str = "", rnd: dict | None = None) -> None:
        markers.append(
            {
                "kind": kind,
                "t": t,
                "instance_id": iid,
                "private_ip": ips.get(iid),
                "detail": detail,
                "_round": rnd,
            }
        )

    for i, rnd in enumerate(rounds):
        lo = rounds[i - 1]["ready"] if i else -math.inf
        window = [e for e in events if lo < e["t"] <= rnd["ready"]]
        reasons = [str(e.get("reason") or "") for e in window if e["kind"] == "rendezvous_start"]
        rnd["reason"] = next((r for r in reasons if r and r != "initial"), reasons[0] if reasons else "")
        rnd["causes"] = []
        if i == 0:
            _first_round(rnd, events, window, marker)
        else:
            _changed_round(rounds[i - 1], rnd, events, window, reasons, docs, samples, marker)
    _unattached(events, markers, marker)

    running, start, end = _span(st, events, rounds, now, marker)
    training, world = _world(rounds, start, end, running)
    segs = throughput(samples, training)
    for rnd in rounds:
        w = [
            (s["steps_per_s"], overlap(s["t0"], s["t1"], [(rnd["ready"], rnd["training_until"])]))
            for s in segs
        ]
        total = sum(x for _, x in w)
        rnd["steps_per_s"] = round(sum(r * x for r, x in w) / total, 3) if total > 0 else None
        rnd["stall_s"] = round(max(0.0, rnd["ready"] - rnd["stall_from"]), 3)
        rnd["steps_lost"] = (
            rnd["step_before"] - rnd["step_after"]
            if rnd.get("step_before") is not None and rnd.get("step_after") is not None
            else None
        )
    for m in markers:
        rnd = m.pop("_round")
        m["round"] = rnd["round"] if rnd is not None else None
        m["cost_s"] = rnd["stall_s"] if rnd is not None else (0.0 if m["kind"] in ("drain", "spot") else None)
        m["shared"] = rnd is not None and len(rnd["causes"]) > 1
    markers.sort(key=lambda m: m["t"])

    return {
        "job": st.get("job"),
        "state": state,
        "running": running,
        "start": start,
        "end": end,
        "duration_s": round(end - start, 3) if start is not None else 0.0,
        "world": world,
        "progress": samples,
        "throughput": segs,
        "events": markers,
        "rounds": [
            {
                "round": r["round"],
                "epoch": r["epoch"],
                "stall_from": r["stall_from"],
                "stall_source": r["stall_source"],
                "ready": r["ready"],
                "training_until": r["training_until"],
                "stall_s": r["stall_s"],
                "world_size": r["world_size"],
                "nodes": r["nodes"],
                "instances": sorted(str(i) for i in r["instances"]),
                "causes": r["causes"],
                "reason": r["reason"],
                "steps_per_s": r["steps_per_s"],
                "step_before": r.get("step_before"),
                "step_after": r["step_after"],
                "steps_lost": r["steps_lost"],
            }
            for r in rounds
        ],
        "stall_s": round(sum(r["stall_s"] for r in rounds[1:]), 3),
        "last_step": st.get("last_step"),
        "missing": _missing(st, events, samples, rounds),
    }
