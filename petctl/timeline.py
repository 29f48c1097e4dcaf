"""A picture of an elastic run: world size, throughput, membership events and what each cost.

Everything here is derived from ``jobs.status()`` (the agents' status documents and their
events, docs/contracts.md), so it works the same for a running or a finished job, on AWS
and on the local cloud. Plain Python only: ``build`` turns a status into data, ``render_text``
draws it for a terminal, ``render_html`` writes a self-contained page (inline SVG, no
scripts, no external resources), ``to_json`` is what ``--output json`` prints.

What the agents publish, and so what can be known:

* rendezvous rounds: ``rendezvous_start`` (with the reason and the round being left),
  ``rendezvous_done`` and ``workers_started`` (the new round, its world size);
* leaving: ``drain_requested`` (scale-in or spot notice, with the reason), ``drained``;
  failures: ``workers_failed``, ``failed``; the end: ``succeeded`` (with ``last_step``);
* progress: agents publish a bounded ``progress`` list of ``[t, step]``, ``last_step_at`` and
  a ``step`` on rendezvous/drain/failure/start events; steps/s over time comes from those.
  Documents of older agents carry only their latest ``last_step`` (one sample each).
* an etcd outage that the workers ride out shows as ``rdzv_unreachable``/``rdzv_recovered``
  events; one that wipes the rendezvous state also shows as rounds starting over or as a
  "rendezvous round moved on (a -> b)" reason with b < a.

A round's stall ("seconds of training the change cost") runs from the first sign that
training stopped (the first ``rendezvous_start`` of a training agent, ``drain_requested``
or ``workers_failed``; for a hard loss, the lost node's last report, an upper bound) to
the last ``workers_started`` of the new round. The time from there to the first step
(worker start-up, checkpoint load) is not reported by the agents and is not included.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import re
import time
from typing import Any

#: One letter per membership event on the terminal chart.
KIND_LETTERS = {
    "start": "S",
    "join": "J",
    "drain": "D",
    "spot": "P",
    "loss": "L",
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
    "etcd_restart": "rendezvous server (etcd) restart",
    "restart": "worker failure, restarted",
    "failure": "agent failed",
    "finish": "job finished",
}
STOP_KINDS = ("drain_requested", "workers_failed")
_ROUND_MOVED = re.compile(r"round moved on \((\d+|None) -> (\d+|None)\)")
#: Event kinds an agent publishes around a rendezvous-server outage it rides out (agent/elastic.py).
_RDZV_OUTAGE_KINDS = ("rdzv_unreachable", "rdzv_recovered", "etcd_unreachable", "etcd_restart")


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    f = _num(v)
    return None if f is None else int(f)


# -- derivation ----------------------------------------------------------------------


def _events(st: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for e in st.get("events") or []:
        t = _num(e.get("t"))
        if t is None or not e.get("kind"):
            continue
        out.append({**e, "t": t})
    out.sort(key=lambda e: e["t"])
    return out


def _rounds(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rendezvous rounds that started workers, in time order.

    Rounds are keyed by (epoch, round): an etcd that lost its state numbers rounds from 0
    again, which starts a new epoch.
    """
    rounds: dict[tuple[int, int], dict[str, Any]] = {}
    epoch, max_round = 0, -1
    for e in events:
        if e["kind"] not in ("rendezvous_done", "workers_started"):
            continue
        r = _int(e.get("round"))
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
            },
        )
        if e["kind"] == "workers_started":
            rec["instances"].add(e.get("instance_id"))
            rec["first"] = e["t"] if rec["first"] is None else min(rec["first"], e["t"])
            rec["ready"] = e["t"] if rec["ready"] is None else max(rec["ready"], e["t"])
            rec["world_size"] = _int(e.get("world_size")) or rec["world_size"]
            step = _int(e.get("step"))
            if step is not None:
                rec["step_after"] = step if rec["step_after"] is None else min(rec["step_after"], step)
        else:
            nodes = _int(e.get("nodes"))
            if nodes is not None:
                rec["nodes"] = max(rec["nodes"] or 0, nodes)
            started = _num(e.get("started"))
            if started is not None:
                rec["rdzv_started"] = (
                    started if rec["rdzv_started"] is None else min(rec["rdzv_started"], started)
                )
            rec["world_size"] = rec["world_size"] or _int(e.get("world_size"))
    done = [r for r in rounds.values() if r["ready"] is not None]
    done.sort(key=lambda r: r["ready"])
    for r in done:
        r["nodes"] = r["nodes"] or len(r["instances"])
    return done


def _progress(st: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(t, step) samples from the documents and events, oldest first."""
    samples: list[dict[str, Any]] = []
    for a in st.get("agents") or []:
        iid = a.get("instance_id")
        for p in a.get("progress") or []:
            if isinstance(p, dict):
                t, s = _num(p.get("t")), _int(p.get("step"))
            elif isinstance(p, list | tuple) and len(p) >= 2:
                t, s = _num(p[0]), _int(p[1])
            else:
                continue
            if t is not None and s is not None:
                samples.append({"t": t, "step": s, "instance_id": iid, "source": "progress"})
        step = _int(a.get("last_step"))
        t = _num(a.get("last_step_at")) or _num(a.get("updated_at"))
        if step is not None and t is not None:
            samples.append({"t": t, "step": step, "instance_id": iid, "source": "status document"})
    for e in events:
        step = _int(e.get("step", e.get("last_step")))
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


def _overlap(a0: float, a1: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in intervals)


def _throughput(samples: list[dict[str, Any]], training: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Steps/s between successive progress samples, over the training time between them."""
    segs = []
    prev = None
    for s in samples:
        if prev is not None and s["t"] - prev["t"] >= 1.0 and s["step"] > prev["step"]:
            train = _overlap(prev["t"], s["t"], training) if training else s["t"] - prev["t"]
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


def build(st: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The timeline of ``st`` (the dict ``jobs.status()`` returns), all times epoch seconds."""
    now = time.time() if now is None else now
    events = _events(st)
    agents = st.get("agents") or []
    ips = {a.get("instance_id"): a.get("private_ip") for a in agents}
    docs = {a.get("instance_id"): a for a in agents}
    for h in st.get("hosts") or []:
        ips.setdefault(h.get("instance_id"), h.get("private_ip"))
    rounds = _rounds(events)
    samples = _progress(st, events)
    state = st.get("state")
    missing: list[str] = []
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

    # stalls and causes
    for i, rnd in enumerate(rounds):
        lo = rounds[i - 1]["ready"] if i else -math.inf
        hi = rnd["ready"]
        window = [e for e in events if lo < e["t"] <= hi]
        reasons = [str(e.get("reason") or "") for e in window if e["kind"] == "rendezvous_start"]
        rnd["reason"] = next((r for r in reasons if r and r != "initial"), reasons[0] if reasons else "")
        rnd["causes"] = []
        if i == 0:
            starts = [e["t"] for e in events if e["kind"] == "rendezvous_start" and e["t"] <= hi]
            rnd["stall_from"] = min(starts) if starts else (rnd["rdzv_started"] or rnd["first"])
            rnd["stall_source"] = "first rendezvous_start" if starts else "rendezvous_done.started"
            initial = any(e["kind"] == "agent_started" for e in window) or rnd["reason"] in ("", "initial")
            rnd["causes"].append("start" if initial else "unknown")
            if initial:
                ag = [e["t"] for e in window if e["kind"] == "agent_started"]
                marker("start", min(ag) if ag else rnd["stall_from"], None, "first rendezvous", rnd)
            rnd["step_before"] = None
            continue
        prev = rounds[i - 1]
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
        # who left, who joined
        for iid in sorted(prev["instances"] - rnd["instances"], key=str):
            doc = docs.get(iid) or {}
            drain = next(
                (
                    e
                    for e in events
                    if e["kind"] in ("drain_requested", "drained")
                    and e.get("instance_id") == iid
                    and e["t"] > lo
                ),
                None,
            )
            if drain is not None and drain["t"] <= hi:
                why = str(drain.get("reason") or doc.get("reason") or "")
                kind = "spot" if why.startswith("spot") else "drain"
                rnd["causes"].append(kind)
                marker(kind, drain["t"], iid, why, rnd)
                continue
            last = _num(doc.get("updated_at"))
            rnd["causes"].append("loss")
            if last is not None and lo < last < stall_from:
                stall_from, source = last, "lost node's last report"
            marker("loss", last if last is not None and lo < last <= hi else stall_from, iid, "no drain", rnd)
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
            marker(
                "etcd_restart", outage[0]["t"] if outage else stall_from, None, "rendezvous state lost", rnd
            )
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

    # drains and failures that belong to no round (a node left while booting, the job failed)
    seen = {(m["kind"], m["instance_id"]) for m in markers}
    for e in events:
        if e["kind"] == "drain_requested":
            kind = "spot" if str(e.get("reason") or "").startswith("spot") else "drain"
            if (kind, e.get("instance_id")) not in seen:
                marker(kind, e["t"], e.get("instance_id"), str(e.get("reason") or ""), None)
                seen.add((kind, e.get("instance_id")))
        elif e["kind"] == "failed":
            marker("failure", e["t"], e.get("instance_id"), str(e.get("reason") or ""), None)

    # the end of the run
    succeeded = [e["t"] for e in events if e["kind"] == "succeeded"]
    failed = [e["t"] for e in events if e["kind"] == "failed"]
    updates = [u for u in (_num(a.get("updated_at")) for a in agents) if u is not None]
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

    # training intervals and the world size over time
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

    segs = _throughput(samples, training)
    for rnd in rounds:
        w = [
            (s["steps_per_s"], _overlap(s["t0"], s["t1"], [(rnd["ready"], rnd["training_until"])]))
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

    # what the documents could not tell
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

    total = round(sum(r["stall_s"] for r in rounds[1:]), 3)
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
        "stall_s": total,
        "last_step": st.get("last_step"),
        "missing": missing,
    }


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


# -- terminal ------------------------------------------------------------------------

_EIGHTHS = " ▁▂▃▄▅▆▇█"


def _world_at(world: list[dict[str, Any]], t: float) -> int:
    w = 0
    for p in world:
        if p["t"] <= t:
            w = p["world_size"]
        else:
            break
    return w


def _columns(data: dict[str, Any], width: int) -> tuple[list[float], float]:
    t0, t1 = data["start"], data["end"]
    span = max(t1 - t0, 1e-6)
    return [t0 + span * (c + 0.5) / width for c in range(width)], span / width


def _bars(values: list[float | None], height: int, vmax: float, ascii_only: bool) -> list[str]:
    rows = []
    for level in range(height, 0, -1):
        line = []
        for v in values:
            if v is None or vmax <= 0:
                line.append(" ")
                continue
            fill = v / vmax * height - (level - 1)
            if fill >= 1:
                line.append("#" if ascii_only else _EIGHTHS[8])
            elif fill <= 0:
                line.append(" ")
            elif ascii_only:
                line.append("#" if fill >= 0.5 else " ")
            else:
                line.append(_EIGHTHS[max(1, round(fill * 8))])
        rows.append("".join(line))
    return rows


def _tick_step(span: float, width: int) -> float:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400):
        if step / span * width >= 10:
            return step
    return 86400 * max(1, math.ceil(span / 86400 / 6))


def _fmt_tick(s: float, step: float) -> str:
    """An axis label: seconds, minutes or hours, whichever the tick step is counted in."""
    if s == 0:
        return "0"
    if step < 60:
        return f"{s:.0f}s"
    if step < 3600:
        return f"{s / 60:g}m"
    return f"{s / 3600:g}h"


def _fmt_dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m < 120 else f"{m // 60}h{m % 60:02d}m"


def _fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}"


def render_text(data: dict[str, Any], width: int = 72, ascii_only: bool = False) -> str:
    """The timeline as terminal text: two charts on one time axis, the events lane, the rounds."""
    job, state = data["job"], data["state"]
    if data["start"] is None or not data["rounds"]:
        lines = [f"job {job}: {state}; no rendezvous round has started workers yet (nothing to draw)"]
        lines += [f"note: {m}" for m in data["missing"][:1]]
        return "\n".join(lines)
    width = max(20, width)
    mids, per_col = _columns(data, width)
    t0 = data["start"]
    rounds = data["rounds"]
    stalls = [(r["stall_from"], r["ready"]) for r in rounds]
    col_lo = [t0 + per_col * c for c in range(width)]
    in_stall = [_overlap(a, a + per_col, stalls) > 0 for a in col_lo]
    world_vals = [None if in_stall[c] else _world_at(data["world"], mids[c]) or None for c in range(width)]
    wmax = max((r["world_size"] or 0) for r in rounds) or 1
    height = min(wmax, 8)
    label_w = 7
    out = []
    pct = 100 * data["stall_s"] / data["duration_s"] if data["duration_s"] else 0
    head = (
        f"job {job}: {state}, {_fmt_dur(data['duration_s'])} from the first agent to "
        f"{'now' if data['running'] else 'the end'}, {len(rounds)} round(s), "
        f"{data['stall_s']:.1f}s not training after the first round ({pct:.0f}%)"
    )
    out.append(head)
    out.append("")
    bar = "|" if ascii_only else "│"
    axis_corner = "+" if ascii_only else "└"
    hline = "-" if ascii_only else "─"
    out.append("world size (ranks training; gaps: re-rendezvous)")
    for i, row in enumerate(_bars([float(v) if v else None for v in world_vals], height, wmax, ascii_only)):
        level = wmax * (height - i) / height
        label = f"{level:.0f}" if (height - i) in (height, 1) or height <= 4 else ""
        out.append(f"{label:>{label_w - 1}}{bar}{row}".rstrip())
    # throughput
    segs = data["throughput"]
    rates: list[float | None] = []
    for c in range(width):
        v = None
        if not in_stall[c]:
            for s in segs:
                if s["t0"] <= mids[c] <= s["t1"]:
                    v = s["steps_per_s"]
                    break
        rates.append(v)
    rmax = max((r for r in rates if r is not None), default=0)
    out.append(f"steps/s ({len(data['progress'])} progress sample(s))")
    if rmax > 0:
        for i, row in enumerate(_bars(rates, 3, rmax, ascii_only)):
            label = _fmt_rate(rmax) if i == 0 else ""
            out.append(f"{label:>{label_w - 1}}{bar}{row}".rstrip())
    else:
        out.append(f"{'':>{label_w - 1}}{bar}(not enough progress samples)")
    # events lane
    lane = [" "] * width
    for m in data["events"]:
        c = min(width - 1, max(0, int((m["t"] - t0) / per_col)))
        for cc in (c, c + 1, c - 1, c + 2, c - 2):
            if 0 <= cc < width and lane[cc] == " ":
                lane[cc] = KIND_LETTERS.get(m["kind"], "?")
                break
    out.append(f"{'events':>{label_w - 1}}{bar}{''.join(lane)}".rstrip())
    # axis
    step = _tick_step(data["duration_s"], width)
    axis = [hline] * width
    labels = [" "] * (width + 8)
    k = 0
    while k * step <= data["duration_s"] + 1e-9:
        c = min(width - 1, int(k * step / per_col))
        axis[c] = "+" if ascii_only else "┬"
        text = _fmt_tick(k * step, step)
        if all(x == " " for x in labels[c : c + len(text) + 1]):
            labels[c : c + len(text)] = list(text)
        k += 1
    out.append(f"{'':>{label_w - 1}}{axis_corner}{''.join(axis)}")
    out.append(f"{'':>{label_w}}{''.join(labels).rstrip()}")
    used = sorted({m["kind"] for m in data["events"]}, key=list(KIND_LETTERS).index)
    legend, line = [], ""
    for k in used:
        item = f"{KIND_LETTERS[k]} {KIND_LABELS[k]}"
        if line and len(line) + 2 + len(item) > width + label_w:
            legend.append(line)
            line = ""
        line = f"{line}  {item}" if line else f"{'':>{label_w}}{item}"
    out += legend + ([line] if line else [])
    out.append("")
    out.append(rounds_table(data))
    evs = [m for m in data["events"] if m["kind"] not in ("start", "finish")]
    if evs:
        out.append("")
        out.append("membership events (cost: the stall of the round they caused)")
        for m in evs:
            who = m["private_ip"] or m["instance_id"] or ""
            cost = (
                "-" if m["cost_s"] is None else f"{m['cost_s']:.1f}s" + (" (shared)" if m["shared"] else "")
            )
            rnd = "" if m["round"] is None else f" -> round {m['round']}"
            at = f"+{m['t'] - t0:.1f}s"
            out.append(f"  {at:>9}  {KIND_LABELS[m['kind']]:<32} {who:<20} cost {cost}{rnd}")
    if data["missing"]:
        out.append("")
        out += [f"note: {m}" for m in data["missing"]]
    return "\n".join(out)


def _round_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = data["start"]
    rows = []
    for r in data["rounds"]:
        rows.append(
            {
                "round": r["round"] if not r["epoch"] else f"{r['round']} (etcd #{r['epoch']})",
                "at": f"+{r['ready'] - t0:.1f}s",
                "world": r["world_size"],
                "nodes": r["nodes"],
                "cause": ", ".join(r["causes"]),
                "stall_s": f"{r['stall_s']:.1f}",
                "steps/s": _fmt_rate(r["steps_per_s"]),
                "reason": (r["reason"] or "")[:48] or None,
            }
        )
    return rows


def rounds_table(data: dict[str, Any]) -> str:
    from petctl.ui import table

    return table(
        _round_rows(data), ["round", "at", "world", "nodes", "cause", "stall_s", "steps/s", "reason"]
    )


# -- HTML ----------------------------------------------------------------------------

_COLORS = {
    "start": "#555",
    "join": "#1a7f37",
    "drain": "#0969da",
    "spot": "#8250df",
    "loss": "#cf222e",
    "etcd_restart": "#bf8700",
    "restart": "#d1242f",
    "failure": "#82071e",
    "finish": "#555",
}


def render_svg(data: dict[str, Any], width: int = 900) -> str:
    """The chart as one standalone ``<svg>`` element (well-formed XML)."""
    e = html.escape
    left, right, top = 60, 20, 20
    h_world, h_rate, h_lane, gap = 150, 110, 34, 28
    plot_w = width - left - right
    y_world = top
    y_rate = y_world + h_world + gap
    y_lane = y_rate + h_rate + gap
    y_axis = y_lane + h_lane
    height = y_axis + 40
    t0, t1 = data["start"], data["end"]
    span = max((t1 - t0) if t0 is not None else 1.0, 1e-6)

    def x(t: float) -> float:
        return round(left + (t - t0) / span * plot_w, 2)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline-chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11" role="img" '
        f'aria-label="world size, steps per second and membership events of job {e(str(data["job"]))}">'
    ]
    if t0 is None or not data["rounds"]:
        parts.append(
            f'<text x="{left}" y="{top + 20}">no rendezvous round has started workers yet</text></svg>'
        )
        return "".join(parts)
    for r in data["rounds"]:
        if r["ready"] > r["stall_from"]:
            parts.append(
                f'<rect class="stall" data-round="{r["round"]}" data-seconds="{r["stall_s"]}" '
                f'x="{x(r["stall_from"])}" y="{y_world}" width="{round(x(r["ready"]) - x(r["stall_from"]), 2)}" '
                f'height="{y_axis - y_world}" fill="#f6c6c6" opacity="0.6">'
                f"<title>round {r['round']}: {r['stall_s']:.1f} s not training ({e(', '.join(r['causes']))})</title></rect>"
            )
    # world size: a step line, filled
    wmax = max((r["world_size"] or 0) for r in data["rounds"]) or 1

    def yw(v: float) -> float:
        return round(y_world + h_world - v / wmax * (h_world - 10), 2)

    pts: list[str] = []
    last = 0
    for p in data["world"]:
        pts.append(f"{x(p['t'])},{yw(last)}")
        pts.append(f"{x(p['t'])},{yw(p['world_size'])}")
        last = p["world_size"]
    pts.append(f"{x(t1)},{yw(last)}")
    area = [f"{x(t0)},{yw(0)}"] + pts + [f"{x(t1)},{yw(0)}"]
    parts.append(f'<polygon class="world-area" points="{" ".join(area)}" fill="#b6d4fe" stroke="none"/>')
    parts.append(
        f'<polyline class="world" points="{" ".join(pts)}" fill="none" stroke="#0550ae" stroke-width="2"/>'
    )
    for v in range(0, wmax + 1, max(1, math.ceil(wmax / 4))):
        parts.append(f'<text x="{left - 6}" y="{yw(v) + 4}" text-anchor="end">{v}</text>')
    parts.append(f'<text x="{left}" y="{y_world - 6}" font-weight="bold">world size</text>')
    # throughput: one bar per segment
    rmax = max((s["steps_per_s"] for s in data["throughput"]), default=0)
    parts.append(f'<text x="{left}" y="{y_rate - 6}" font-weight="bold">steps/s</text>')
    if rmax > 0:
        training = [(r["ready"], r["training_until"]) for r in data["rounds"]]
        for s in data["throughput"]:
            hgt = round(s["steps_per_s"] / rmax * (h_rate - 10), 2)
            tip = f"{s['steps_per_s']:.3g} steps/s ({s['steps']} steps in {s['train_s']:.1f} s of training)"
            # one bar per stretch of training inside the segment: stalls stay empty
            pieces = [
                (max(a, s["t0"]), min(b, s["t1"])) for a, b in training if min(b, s["t1"]) > max(a, s["t0"])
            ]
            parts.append(f'<g class="rate" data-steps-per-s="{s["steps_per_s"]}"><title>{tip}</title>')
            for a, b in pieces or [(s["t0"], s["t1"])]:
                parts.append(
                    f'<rect x="{x(a)}" y="{round(y_rate + h_rate - hgt, 2)}" width="{round(x(b) - x(a), 2)}" '
                    f'height="{hgt}" fill="#8cd9a0" stroke="#1a7f37"/>'
                )
            parts.append("</g>")
        parts.append(f'<text x="{left - 6}" y="{y_rate + 14}" text-anchor="end">{_fmt_rate(rmax)}</text>')
    else:
        parts.append(
            f'<text x="{left + 6}" y="{y_rate + h_rate / 2}" fill="#666">not enough progress samples</text>'
        )
    parts.append(f'<text x="{left - 6}" y="{y_rate + h_rate}" text-anchor="end">0</text>')
    for y0, hh in ((y_world, h_world), (y_rate, h_rate)):
        parts.append(
            f'<line x1="{left}" y1="{y0 + hh}" x2="{left + plot_w}" y2="{y0 + hh}" stroke="#999"/>'
            f'<line x1="{left}" y1="{y0}" x2="{left}" y2="{y0 + hh}" stroke="#999"/>'
        )
    # events
    parts.append(f'<text x="{left - 6}" y="{y_lane + 20}" text-anchor="end">events</text>')
    for m in data["events"]:
        col = _COLORS.get(m["kind"], "#333")
        cost = "" if m["cost_s"] is None else f", cost {m['cost_s']:.1f} s"
        who = m["private_ip"] or m["instance_id"] or ""
        parts.append(
            f'<g class="event" data-kind="{m["kind"]}" data-cost="{"" if m["cost_s"] is None else m["cost_s"]}">'
            f"<title>+{m['t'] - t0:.1f} s {e(KIND_LABELS[m['kind']])} {e(str(who))}{cost}</title>"
            f'<line x1="{x(m["t"])}" y1="{y_world}" x2="{x(m["t"])}" y2="{y_lane + 8}" stroke="{col}" '
            f'stroke-dasharray="3,3"/>'
            f'<text x="{x(m["t"])}" y="{y_lane + 22}" text-anchor="middle" fill="{col}" font-weight="bold">'
            f"{KIND_LETTERS[m['kind']]}</text></g>"
        )
    # time axis
    step = _tick_step(span, plot_w // 8)
    parts.append(f'<line x1="{left}" y1="{y_axis}" x2="{left + plot_w}" y2="{y_axis}" stroke="#999"/>')
    k = 0
    while k * step <= span + 1e-9:
        xx = x(t0 + k * step)
        parts.append(
            f'<line x1="{xx}" y1="{y_axis}" x2="{xx}" y2="{y_axis + 4}" stroke="#999"/>'
            f'<text x="{xx}" y="{y_axis + 16}" text-anchor="middle">{_fmt_tick(k * step, step)}</text>'
        )
        k += 1
    parts.append(
        f'<text x="{left + plot_w}" y="{y_axis + 32}" text-anchor="end" fill="#666">'
        f"seconds since {e(iso(t0) or '')}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def render_html(data: dict[str, Any]) -> str:
    """A self-contained page: the chart (inline SVG), the rounds and the events."""
    e = html.escape
    t0 = data["start"] or 0.0
    rows = []
    for r in data["rounds"]:
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{e(str(v))}</td>"
                for v in (
                    r["round"],
                    f"{r['ready'] - t0:.1f}",
                    r["world_size"] if r["world_size"] is not None else "-",
                    r["nodes"] if r["nodes"] is not None else "-",
                    ", ".join(r["causes"]),
                    f"{r['stall_s']:.1f}",
                    _fmt_rate(r["steps_per_s"]),
                    r["reason"] or "",
                )
            )
            + "</tr>"
        )
    ev_rows = []
    for m in data["events"]:
        ev_rows.append(
            "<tr>"
            + "".join(
                f"<td>{e(str(v))}</td>"
                for v in (
                    f"{m['t'] - t0:.1f}",
                    KIND_LABELS[m["kind"]],
                    m["private_ip"] or m["instance_id"] or "",
                    "-" if m["round"] is None else m["round"],
                    "-"
                    if m["cost_s"] is None
                    else f"{m['cost_s']:.1f}" + (" (shared)" if m["shared"] else ""),
                    m["detail"] or "",
                )
            )
            + "</tr>"
        )
    notes = "".join(f"<li>{e(m)}</li>" for m in data["missing"])
    title = f"petctl timeline: {data['job']}"
    summary = (
        f"{data['state']}; {len(data['rounds'])} round(s); {data['stall_s']:.1f} s not training after the "
        f"first round; {_fmt_dur(data['duration_s'])} from {iso(data['start']) or '-'} to "
        f"{'now' if data['running'] else iso(data['end'])}"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em;color:#1f2328}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #d0d7de;padding:4px 8px;"
        "text-align:left}th{background:#f6f8fa}caption{text-align:left;font-weight:bold;margin-bottom:4px}"
        ".notes{color:#57606a}</style></head><body>\n"
        f'<h1>{e(title)}</h1>\n<p id="summary">{e(summary)}</p>\n'
        f"<figure>{render_svg(data)}<figcaption>World size (ranks training), steps/s between progress "
        "samples, and membership events; shaded: not training (re-rendezvous).</figcaption></figure>\n"
        '<table id="rounds"><caption>Rendezvous rounds</caption><thead><tr><th>round</th>'
        "<th>ready at (s)</th><th>world size</th><th>nodes</th><th>cause</th><th>stall (s)</th>"
        "<th>steps/s</th><th>reason</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>\n"
        '<table id="events"><caption>Membership events</caption><thead><tr><th>at (s)</th><th>event</th>'
        "<th>node</th><th>round</th><th>cost (s)</th><th>detail</th></tr></thead><tbody>"
        + "".join(ev_rows)
        + "</tbody></table>\n"
        + (f'<ul class="notes">{notes}</ul>\n' if notes else "")
        + "</body></html>\n"
    )
