"""What the timeline tests share: agent status documents built event by event, and a reader of the page.

Importable as ``timeline_fixtures`` because pytest puts tests/ (the folder of the root
conftest.py) on sys.path.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from typing import Any

SVG = "{http://www.w3.org/2000/svg}"


class Agent:
    """One agent's status document, as the agent writes it; times are seconds after ``t0``."""

    def __init__(self, t0: float, instance_id: str, private_ip: str) -> None:
        self.t0, self.instance_id, self.private_ip = t0, instance_id, private_ip
        self.events: list[dict[str, Any]] = []

    def ev(self, t: float, kind: str, **data: Any) -> Agent:
        self.events.append({"t": self.t0 + t, "kind": kind, **data})
        return self

    def rendezvous(
        self,
        t: float,
        done_at: float,
        workers_at: float,
        rnd: int,
        world: int,
        reason: str = "initial",
        left: int | None = None,
        **done_data: Any,
    ) -> Agent:
        """Leave round ``left`` at ``t`` for ``reason``; round ``rnd`` of ``world`` nodes is done at
        ``done_at`` and this agent's workers start at ``workers_at``."""
        self.ev(t, "rendezvous_start", reason=reason, round=left)
        self.ev(done_at, "rendezvous_done", round=rnd, world_size=world, nodes=world, **done_data)
        return self.ev(workers_at, "workers_started", round=rnd, world_size=world)

    def doc(
        self, state: str, updated: float, step: int, reason: str | None = None, current_round: int = 0
    ) -> dict[str, Any]:
        return {
            "version": 1,
            "job_name": "demo",
            "instance_id": self.instance_id,
            "private_ip": self.private_ip,
            "state": state,
            "world_size": 2,
            "round": current_round,
            "restarts": 0,
            "last_step": step,
            "last_checkpoint_step": step,
            "reason": reason,
            "updated_at": self.t0 + updated,
            "events": self.events,
        }


class Page(HTMLParser):
    """The tables of a timeline page by id, and whatever it would load from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.external: list[str] = []
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href"):
            if a.get(key):
                self.external.append(a[key])
        if tag in ("script", "link", "img", "iframe"):
            self.external.append(tag)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, d):
        if self._cell is not None:
            self._cell.append(d)


def parse_page(page: str) -> tuple[Page, ET.Element]:
    p = Page()
    p.feed(page)
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    return p, ET.fromstring(svg)


def check_page(page: str, stalls: list[float], causes: list[str]) -> tuple[Page, ET.Element]:
    """The page is self-contained and has the chart, one shaded stall per round that had one, and the rounds."""
    p, svg = parse_page(page)
    assert p.external == []
    assert svg.tag == f"{SVG}svg" and svg.get("id") == "timeline-chart"
    assert svg.find(f".//{SVG}polyline[@class='world']") is not None
    rows = p.tables["rounds"]
    assert rows[0][:6] == ["round", "ready at (s)", "world size", "nodes", "cause", "stall (s)"]
    assert [float(r[5]) for r in rows[1:]] == stalls
    assert [r[4] for r in rows[1:]] == causes
    drawn = sorted(float(r.get("data-seconds")) for r in svg.iter(f"{SVG}rect") if r.get("class") == "stall")
    assert drawn == sorted(s for s in stalls if s > 0)
    return p, svg


def event_kinds(svg: ET.Element) -> list[str]:
    return [g.get("data-kind") for g in svg.iter(f"{SVG}g") if g.get("class") == "event"]
