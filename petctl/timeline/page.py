"""The timeline as a self-contained HTML page: an inline SVG chart, no scripts, no external resources."""

from __future__ import annotations

import html
import math
from typing import Any

from petctl.timeline.fmt import KIND_LABELS, KIND_LETTERS, fmt_dur, fmt_rate, fmt_tick, iso, tick_step

_COLORS = {
    "start": "#555",
    "join": "#1a7f37",
    "drain": "#0969da",
    "spot": "#8250df",
    "loss": "#cf222e",
    "exclude": "#953800",
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
        parts.append(f'<text x="{left - 6}" y="{y_rate + 14}" text-anchor="end">{fmt_rate(rmax)}</text>')
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
    # letters closer than 10 px to the one before take turns on two rows, so none hides another
    row_of, last_x, row = [], None, 0
    for m in data["events"]:
        row = (1 - row) if last_x is not None and x(m["t"]) - last_x < 10 else 0
        row_of.append(row)
        last_x = x(m["t"])
    for m, row in zip(data["events"], row_of, strict=True):
        col = _COLORS.get(m["kind"], "#333")
        cost = "" if m["cost_s"] is None else f", cost {m['cost_s']:.1f} s"
        who = m["private_ip"] or m["instance_id"] or ""
        parts.append(
            f'<g class="event" data-kind="{m["kind"]}" data-cost="{"" if m["cost_s"] is None else m["cost_s"]}">'
            f"<title>+{m['t'] - t0:.1f} s {e(KIND_LABELS[m['kind']])} {e(str(who))}{cost}</title>"
            f'<line x1="{x(m["t"])}" y1="{y_world}" x2="{x(m["t"])}" y2="{y_lane + 8}" stroke="{col}" '
            f'stroke-dasharray="3,3"/>'
            f'<text x="{x(m["t"])}" y="{y_lane + 19 + 12 * row}" text-anchor="middle" fill="{col}" font-weight="bold">'
            f"{KIND_LETTERS[m['kind']]}</text></g>"
        )
    # time axis
    step = tick_step(span, plot_w // 8)
    parts.append(f'<line x1="{left}" y1="{y_axis}" x2="{left + plot_w}" y2="{y_axis}" stroke="#999"/>')
    k = 0
    while k * step <= span + 1e-9:
        xx = x(t0 + k * step)
        parts.append(
            f'<line x1="{xx}" y1="{y_axis}" x2="{xx}" y2="{y_axis + 4}" stroke="#999"/>'
            f'<text x="{xx}" y="{y_axis + 16}" text-anchor="middle">{fmt_tick(k * step, step)}</text>'
        )
        k += 1
    parts.append(
        f'<text x="{left + plot_w}" y="{y_axis + 32}" text-anchor="end" fill="#666">'
        f"seconds since {e(_when(t0))}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


_STATE_COLORS = {"SUCCEEDED": "#1a7f37", "FAILED": "#cf222e", "RUNNING": "#0969da"}

_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;"
    "color:#1f2328;background:#f6f8fa}"
    "main{max-width:980px;margin:0 auto;padding:24px 28px 40px;background:#fff;min-height:100vh;"
    "box-sizing:border-box}"
    "header h1{font-size:24px;margin:0 0 4px}.state{display:inline-block;padding:2px 10px;border-radius:12px;"
    "color:#fff;font-size:13px;font-weight:600;vertical-align:middle;margin-left:8px}"
    "header p{margin:0;color:#57606a}"
    ".figures{display:flex;flex-wrap:wrap;gap:12px;margin:18px 0;padding:0;list-style:none}"
    ".figures li{flex:1 1 140px;border:1px solid #d0d7de;border-radius:8px;padding:10px 14px}"
    ".figures b{display:block;font-size:22px}.figures span{color:#57606a;font-size:13px}"
    "figure{margin:0;border:1px solid #d0d7de;border-radius:8px;padding:12px}"
    "figure svg{max-width:100%;height:auto;display:block}"
    "figcaption{color:#57606a;font-size:13px;margin-top:6px}"
    ".legend{display:flex;flex-wrap:wrap;gap:6px 18px;margin:8px 0 0;padding:0;list-style:none;font-size:13px}"
    ".legend i{display:inline-block;width:14px;height:10px;margin-right:5px;vertical-align:middle}"
    ".legend b{display:inline-block;min-width:12px;margin-right:4px;text-align:center}"
    "table{border-collapse:collapse;margin:1.4em 0 0;width:100%;font-size:14px}"
    "td,th{border-bottom:1px solid #d0d7de;padding:5px 8px;text-align:left}"
    "th{background:#f6f8fa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "tbody tr:hover{background:#f6f8fa}caption{text-align:left;font-weight:600;font-size:16px;margin-bottom:6px}"
    ".notes{color:#57606a;font-size:13px;margin-top:1.4em}"
)


def _when(t: float | None) -> str:
    """A time as people read it, in UTC: ``2023-11-14 22:13:20 UTC``."""
    return "-" if t is None else (iso(t) or "")[:19].replace("T", " ") + " UTC"


def _legend(data: dict[str, Any]) -> str:
    """What the chart's colours and event letters mean (only the kinds this run has)."""
    e = html.escape
    items = [
        '<li><i style="background:#b6d4fe;border-top:2px solid #0550ae"></i>world size</li>',
        '<li><i style="background:#8cd9a0;border:1px solid #1a7f37"></i>steps/s</li>',
        '<li><i style="background:#f6c6c6"></i>not training (re-rendezvous)</li>',
    ]
    kinds = [k for k in KIND_LETTERS if any(m["kind"] == k for m in data["events"])]
    items += [
        f'<li><b style="color:{_COLORS.get(k, "#333")}">{e(KIND_LETTERS[k])}</b>{e(KIND_LABELS[k])}</li>'
        for k in kinds
    ]
    return '<ul class="legend">' + "".join(items) + "</ul>"


def _figures(data: dict[str, Any]) -> str:
    """The run in a few numbers: its length, rounds, time not training, world sizes, events."""
    sizes = [r["world_size"] for r in data["rounds"] if r["world_size"] is not None]
    share = f" ({data['stall_s'] / data['duration_s']:.0%} of the run)" if data["duration_s"] else ""
    figures = [
        (fmt_dur(data["duration_s"]), "from the first agent to " + ("now" if data["running"] else "the end")),
        (str(len(data["rounds"])), "rendezvous rounds"),
        (f"{data['stall_s']:.1f} s", "not training after the first round" + share),
        (f"{min(sizes)}–{max(sizes)}" if sizes and min(sizes) != max(sizes) else str(sizes[0] if sizes else "-"),
         "world size"),
        (str(len([m for m in data["events"] if m["kind"] not in ("start", "finish")])), "membership changes"),
    ]  # fmt: skip
    return (
        '<ul class="figures">'
        + "".join(f"<li><b>{html.escape(v)}</b><span>{html.escape(k)}</span></li>" for v, k in figures)
        + "</ul>"
    )


def _table(ident: str, caption: str, heads: list[str], rows: list[list[Any]], numeric: set[int]) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="n"' if i in numeric else ""
        return f"<{tag}{cls}>{html.escape(str(v))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(heads))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return (
        f'<table id="{ident}"><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>\n"
    )


def render_html(data: dict[str, Any]) -> str:
    """A self-contained page: a header with the run's key figures, the chart (inline SVG) with its
    legend, the rounds and the events. No scripts, no external resources."""
    e = html.escape
    t0 = data["start"] or 0.0
    rounds = [
        [
            r["round"],
            f"{r['ready'] - t0:.1f}",
            r["world_size"] if r["world_size"] is not None else "-",
            r["nodes"] if r["nodes"] is not None else "-",
            ", ".join(r["causes"]),
            f"{r['stall_s']:.1f}",
            fmt_rate(r["steps_per_s"]),
            r["reason"] or "",
        ]
        for r in data["rounds"]
    ]
    events = [
        [
            f"{m['t'] - t0:.1f}",
            KIND_LABELS[m["kind"]],
            m["private_ip"] or m["instance_id"] or "",
            "-" if m["round"] is None else m["round"],
            "-" if m["cost_s"] is None else f"{m['cost_s']:.1f}" + (" (shared)" if m["shared"] else ""),
            m["detail"] or "",
        ]
        for m in data["events"]
    ]
    notes = "".join(f"<li>{e(m)}</li>" for m in data["missing"])
    title = f"petctl timeline: {data['job']}"
    summary = (
        f"{data['state']}; {len(data['rounds'])} round(s); {data['stall_s']:.1f} s not training after the "
        f"first round; {fmt_dur(data['duration_s'])} from {_when(data['start'])} to "
        f"{'now' if data['running'] else _when(data['end'])}"
    )
    state_color = _STATE_COLORS.get(data["state"], "#57606a")
    chart = ""
    if data["rounds"]:
        chart = _figures(data)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body><main>\n"
        f'<header><h1>Job {e(str(data["job"]))}<span class="state" style="background:{state_color}">'
        f"{e(str(data['state']))}</span></h1>"
        f'<p id="summary">{e(summary)}</p></header>\n'
        + chart
        + f"<figure>{render_svg(data)}{_legend(data)}<figcaption>World size: ranks training. steps/s: "
        "between progress samples, over training time only. Letters: membership events (hover for "
        "node and cost). Shaded: not training, from the rendezvous to the new round's workers.</figcaption>"
        "</figure>\n"
        + _table(
            "rounds",
            "Rendezvous rounds",
            ["round", "ready at (s)", "world size", "nodes", "cause", "stall (s)", "steps/s", "reason"],
            rounds,
            {0, 1, 2, 3, 5, 6},
        )
        + _table(
            "events",
            "Membership events",
            ["at (s)", "event", "node", "round", "cost (s)", "detail"],
            events,
            {0, 3},
        )
        + (f'<ul class="notes">{notes}</ul>\n' if notes else "")
        + f'<p class="notes">Made by petctl timeline {e(str(data["job"]))} --html.</p>\n'
        + "</main></body></html>\n"
    )
