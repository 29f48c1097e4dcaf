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
        f"seconds since {e(iso(t0) or '')}</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def _row(*cells: Any) -> str:
    return "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in cells) + "</tr>"


def render_html(data: dict[str, Any]) -> str:
    """A self-contained page: the chart (inline SVG), the rounds and the events."""
    e = html.escape
    t0 = data["start"] or 0.0
    rows = [
        _row(
            r["round"],
            f"{r['ready'] - t0:.1f}",
            r["world_size"] if r["world_size"] is not None else "-",
            r["nodes"] if r["nodes"] is not None else "-",
            ", ".join(r["causes"]),
            f"{r['stall_s']:.1f}",
            fmt_rate(r["steps_per_s"]),
            r["reason"] or "",
        )
        for r in data["rounds"]
    ]
    ev_rows = [
        _row(
            f"{m['t'] - t0:.1f}",
            KIND_LABELS[m["kind"]],
            m["private_ip"] or m["instance_id"] or "",
            "-" if m["round"] is None else m["round"],
            "-" if m["cost_s"] is None else f"{m['cost_s']:.1f}" + (" (shared)" if m["shared"] else ""),
            m["detail"] or "",
        )
        for m in data["events"]
    ]
    notes = "".join(f"<li>{e(m)}</li>" for m in data["missing"])
    title = f"petctl timeline: {data['job']}"
    summary = (
        f"{data['state']}; {len(data['rounds'])} round(s); {data['stall_s']:.1f} s not training after the "
        f"first round; {fmt_dur(data['duration_s'])} from {iso(data['start']) or '-'} to "
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
