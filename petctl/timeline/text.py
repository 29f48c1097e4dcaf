"""The timeline for a terminal: world size and steps/s on one time axis, the events lane, the rounds."""

from __future__ import annotations

from typing import Any

from petctl.timeline.fmt import KIND_LABELS, KIND_LETTERS, fmt_dur, fmt_rate, fmt_tick, tick_step
from petctl.timeline.parse import overlap

_EIGHTHS = " ▁▂▃▄▅▆▇█"
#: Columns before the charts: a right-aligned label and the bar that starts the chart.
_LABEL_W = 7


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


def _rates(data: dict[str, Any], mids: list[float], in_stall: list[bool]) -> list[float | None]:
    """Steps/s of the throughput segment under each column; none where training stood still."""
    rates: list[float | None] = []
    for c, mid in enumerate(mids):
        v = None
        if not in_stall[c]:
            for s in data["throughput"]:
                if s["t0"] <= mid <= s["t1"]:
                    v = s["steps_per_s"]
                    break
        rates.append(v)
    return rates


def _lane(data: dict[str, Any], per_col: float, width: int) -> str:
    """One letter per event at its column, or the nearest free one (events close in time crowd)."""
    lane = [" "] * width
    for m in data["events"]:
        c = min(width - 1, max(0, int((m["t"] - data["start"]) / per_col)))
        for cc in (c, c + 1, c - 1, c + 2, c - 2):
            if 0 <= cc < width and lane[cc] == " ":
                lane[cc] = KIND_LETTERS.get(m["kind"], "?")
                break
    return "".join(lane)


def _axis(duration: float, per_col: float, width: int, ascii_only: bool) -> tuple[str, str]:
    """The time axis with its ticks, and the tick labels that fit without touching."""
    step = tick_step(duration, width)
    axis = ["-" if ascii_only else "─"] * width
    labels = [" "] * (width + 8)
    k = 0
    while k * step <= duration + 1e-9:
        c = min(width - 1, int(k * step / per_col))
        axis[c] = "+" if ascii_only else "┬"
        text = fmt_tick(k * step, step)
        if all(x == " " for x in labels[c : c + len(text) + 1]):
            labels[c : c + len(text)] = list(text)
        k += 1
    return "".join(axis), "".join(labels).rstrip()


def _legend(data: dict[str, Any], width: int) -> list[str]:
    """The letters used on the lane, with their meaning, wrapped to the chart's width."""
    used = sorted({m["kind"] for m in data["events"]}, key=list(KIND_LETTERS).index)
    legend, line = [], ""
    for k in used:
        item = f"{KIND_LETTERS[k]} {KIND_LABELS[k]}"
        if line and len(line) + 2 + len(item) > width + _LABEL_W:
            legend.append(line)
            line = ""
        line = f"{line}  {item}" if line else f"{'':>{_LABEL_W}}{item}"
    return legend + ([line] if line else [])


def _event_lines(data: dict[str, Any]) -> list[str]:
    evs = [m for m in data["events"] if m["kind"] not in ("start", "finish")]
    if not evs:
        return []
    out = ["", "membership events (cost: the stall of the round they caused)"]
    for m in evs:
        who = m["private_ip"] or m["instance_id"] or ""
        cost = "-" if m["cost_s"] is None else f"{m['cost_s']:.1f}s" + (" (shared)" if m["shared"] else "")
        rnd = "" if m["round"] is None else f" -> round {m['round']}"
        at = f"+{m['t'] - data['start']:.1f}s"
        out.append(f"  {at:>9}  {KIND_LABELS[m['kind']]:<32} {who:<20} cost {cost}{rnd}")
    return out


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
    in_stall = [overlap(a, a + per_col, stalls) > 0 for a in col_lo]
    world_vals = [None if in_stall[c] else _world_at(data["world"], mids[c]) or None for c in range(width)]
    wmax = max((r["world_size"] or 0) for r in rounds) or 1
    height = min(wmax, 8)
    bar = "|" if ascii_only else "│"

    def row(label: str, chart: str) -> str:
        return f"{label:>{_LABEL_W - 1}}{bar}{chart}".rstrip()

    pct = 100 * data["stall_s"] / data["duration_s"] if data["duration_s"] else 0
    out = [
        f"job {job}: {state}, {fmt_dur(data['duration_s'])} from the first agent to "
        f"{'now' if data['running'] else 'the end'}, {len(rounds)} round(s), "
        f"{data['stall_s']:.1f}s not training after the first round ({pct:.0f}%)",
        "",
        "world size (ranks training; gaps: re-rendezvous)",
    ]
    for i, bars in enumerate(_bars([float(v) if v else None for v in world_vals], height, wmax, ascii_only)):
        level = wmax * (height - i) / height
        out.append(row(f"{level:.0f}" if (height - i) in (height, 1) or height <= 4 else "", bars))
    rates = _rates(data, mids, in_stall)
    rmax = max((r for r in rates if r is not None), default=0)
    out.append(f"steps/s ({len(data['progress'])} progress sample(s))")
    if rmax > 0:
        for i, bars in enumerate(_bars(rates, 3, rmax, ascii_only)):
            out.append(row(fmt_rate(rmax) if i == 0 else "", bars))
    else:
        out.append(row("", "(not enough progress samples)"))
    out.append(row("events", _lane(data, per_col, width)))
    axis, labels = _axis(data["duration_s"], per_col, width, ascii_only)
    out.append(f"{'':>{_LABEL_W - 1}}{'+' if ascii_only else '└'}{axis}")
    out.append(f"{'':>{_LABEL_W}}{labels}")
    out += _legend(data, width)
    out += ["", rounds_table(data)]
    out += _event_lines(data)
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
                "steps/s": fmt_rate(r["steps_per_s"]),
                "reason": (r["reason"] or "")[:48] or None,
            }
        )
    return rows


def rounds_table(data: dict[str, Any]) -> str:
    from petctl.ui import table

    return table(
        _round_rows(data), ["round", "at", "world", "nodes", "cause", "stall_s", "steps/s", "reason"]
    )
