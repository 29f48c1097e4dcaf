"""`petctl timeline` through the CLI against a moto server, from agent status documents in S3."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import boto3
import pytest

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def job(run, ready) -> list[str]:
    """Base stack plus a job `demo` (min 2, max 4); returns its two worker instance ids."""
    r = run("run_job", "--name", "demo", "--min", "2", "--max", "4", str(ready))
    assert r.exit_code == 0, r.output
    group = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-demo-workers"]
    )
    return sorted(i["InstanceId"] for i in group["AutoScalingGroups"][0]["Instances"])


def put_reports(ids: list[str], t0: float, finished: bool = False) -> None:
    """As agents would write them: node `gone` and ids[0] start (world 2), ids[1] joins (world 3),
    `gone` is scaled in and drains (world 2); optionally the job then succeeds."""
    a, b = ids

    def ev(t, kind, **d):
        return {"t": t0 + t, "kind": kind, **d}

    gone = [
        ev(0, "agent_started"),
        ev(1, "rendezvous_start", reason="initial", round=None),
        ev(6, "rendezvous_done", round=0, world_size=2, nodes=2),
        ev(7, "workers_started", round=0, world_size=2),
        ev(101, "rendezvous_start", reason="coordinated checkpoint (peer drain/scale)", round=0),
        ev(106, "rendezvous_done", round=1, world_size=3, nodes=3),
        ev(108, "workers_started", round=1, world_size=3),
        ev(200, "drain_requested", reason="autoscaling target-lifecycle-state=Terminated", round=1),
        ev(204, "drained", clean=True, round=1),
    ]
    first = [
        ev(0.5, "agent_started"),
        ev(2, "rendezvous_start", reason="initial", round=None),
        ev(6, "rendezvous_done", round=0, world_size=2, nodes=2),
        ev(8, "workers_started", round=0, world_size=2),
        ev(100, "rendezvous_start", reason="1 node(s) waiting to join", round=0),
        ev(106, "rendezvous_done", round=1, world_size=3, nodes=3),
        ev(109, "workers_started", round=1, world_size=3),
        ev(203, "rendezvous_start", reason="coordinated checkpoint (peer drain/scale)", round=1),
        ev(207, "rendezvous_done", round=2, world_size=2, nodes=2),
        ev(208, "workers_started", round=2, world_size=2),
    ]
    joiner = [
        ev(80, "agent_started"),
        ev(95, "rendezvous_start", reason="initial", round=None),
        ev(106, "rendezvous_done", round=1, world_size=3, nodes=3),
        ev(110, "workers_started", round=1, world_size=3),
        ev(203, "rendezvous_start", reason="coordinated checkpoint (peer drain/scale)", round=1),
        ev(207, "rendezvous_done", round=2, world_size=2, nodes=2),
        ev(209, "workers_started", round=2, world_size=2),
    ]
    end = 260.0
    if finished:
        first.append(ev(end, "succeeded", last_step=700))
        joiner.append(ev(end + 0.5, "succeeded", last_step=700))
    state = "SUCCEEDED" if finished else "RUNNING"
    docs = [
        ("i-0gone", "10.0.0.9", "LEFT", 205, 300, gone),
        (a, "10.0.0.1", state, end + 1, 700, first),
        (b, "10.0.0.2", state, end + 1, 700, joiner),
    ]
    s3 = boto3.client("s3")
    bucket = [x["Name"] for x in s3.list_buckets()["Buckets"]][0]
    for iid, ip, st, updated, step, events in docs:
        report = {
            "version": 1,
            "job_name": "demo",
            "instance_id": iid,
            "private_ip": ip,
            "state": st,
            "world_size": 2,
            "round": 2,
            "restarts": 0,
            "last_step": step,
            "last_checkpoint_step": step,
            "reason": None,
            "updated_at": t0 + updated,
            "events": events,
        }
        s3.put_object(
            Bucket=bucket, Key=f"petctl/jobs/demo/status/{iid}.json", Body=json.dumps(report).encode()
        )


class Tables(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.external: list[str] = []
        self._t: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.external += [a[k] for k in ("src", "href") if a.get(k)]
        if tag in ("script", "link", "img", "iframe"):
            self.external.append(tag)
        if tag == "table":
            self._t = a.get("id")
            self.tables[self._t] = []
        elif tag == "tr" and self._t:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[self._t].append(self._row)
            self._row = None

    def handle_data(self, d):
        if self._cell is not None:
            self._cell.append(d)


def test_timeline_of_a_running_job_text_json_html(run, job, tmp_path):
    t0 = time.time() - 300
    put_reports(job, t0)

    r = run("timeline", "demo")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("job demo: RUNNING,") and "from the first agent to now, 3 round(s)" in lines[0]
    assert "world size" in r.stdout and "steps/s" in r.stdout
    lane = next(ln for ln in lines if ln.lstrip().startswith("events"))
    assert [c for c in lane[7:] if c != " "] == ["S", "J", "D"]
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("ROUND"))) :][:4]
    assert [ln.split()[4:6] for ln in table[1:]] == [["start", "7.0"], ["join", "10.0"], ["drain", "9.0"]]
    assert "10.0.0.9" in r.stdout  # the drained node, by its address

    r = run("--output", "json", "timeline", "demo")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["job"] == "demo" and data["state"] == "RUNNING" and data["running"] is True
    assert [(x["round"], x["causes"], x["stall_s"], x["world_size"]) for x in data["rounds"]] == [
        (0, ["start"], 7.0, 2),
        (1, ["join"], 10.0, 3),
        (2, ["drain"], 9.0, 2),
    ]
    assert data["stall_s"] == 19.0
    start = dt.datetime.fromisoformat(data["start"])
    assert abs(start.timestamp() - t0) < 1e-3 and start.utcoffset() == dt.timedelta(0)
    drain = next(e for e in data["events"] if e["kind"] == "drain")
    assert drain["instance_id"] == "i-0gone" and drain["cost_s"] == 9.0 and drain["at_s"] == 200.0
    assert dt.datetime.fromisoformat(drain["t"]).timestamp() == pytest.approx(t0 + 200, abs=1e-3)
    # the running world goes on until now
    assert data["world"][-1]["world_size"] == 2 and data["world"][-1]["at_s"] >= 299
    # steps/s from the samples: 300 at the drained node's last report (205), 700 at 261
    (seg,) = data["throughput"]
    assert seg["steps"] == 400 and seg["steps_per_s"] == pytest.approx(400 / (261 - 209), abs=1e-3)

    page = tmp_path / "out" / "tl.html"
    page.parent.mkdir()
    r = run("--output", "json", "timeline", "demo", "--html", str(page))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["html"] == str(page)
    doc = page.read_text(encoding="utf-8")
    p = Tables()
    p.feed(doc)
    assert p.external == []
    rounds = p.tables["rounds"]
    assert [(row[0], row[2], row[4], row[5]) for row in rounds[1:]] == [
        ("0", "2", "start", "7.0"),
        ("1", "3", "join", "10.0"),
        ("2", "2", "drain", "9.0"),
    ]
    svg = ET.fromstring(doc[doc.index("<svg") : doc.index("</svg>") + 6])
    assert svg.get("id") == "timeline-chart"
    stalls = sorted(float(x.get("data-seconds")) for x in svg.iter(f"{SVG}rect") if x.get("class") == "stall")
    assert stalls == [7.0, 9.0, 10.0]
    kinds = [g.get("data-kind") for g in svg.iter(f"{SVG}g") if g.get("class") == "event"]
    assert kinds == ["start", "join", "drain"]

    r = run("timeline", "demo", "--html", str(page))
    assert r.exit_code == 0 and r.stdout.rstrip().endswith(f"page: {page}")


def test_timeline_of_a_finished_job(run, job):
    t0 = time.time() - 600
    put_reports(job, t0, finished=True)
    data = json.loads(run("--output", "json", "timeline", "demo").stdout)
    assert data["state"] == "SUCCEEDED" and data["running"] is False
    assert data["duration_s"] == 260.0 and data["events"][-1]["kind"] == "finish"
    assert data["world"][-1] == {"t": data["end"], "at_s": 260.0, "world_size": 0}
    r = run("timeline", "demo")
    assert r.exit_code == 0 and r.stdout.startswith(
        "job demo: SUCCEEDED, 4m20s from the first agent to the end"
    )


def test_timeline_before_any_report_and_of_an_unknown_job(run, job):
    r = run("timeline", "demo")
    assert r.exit_code == 0 and "nothing to draw" in r.stdout
    assert json.loads(run("-o", "json", "timeline", "demo").stdout)["rounds"] == []
    r = run("timeline", "ghost")
    assert r.exit_code == 3 and "job 'ghost' not found" in r.stderr


def test_help_stays_light():
    code = (
        "import sys; from click.testing import CliRunner; from petctl.cli import cli; "
        "r = CliRunner().invoke(cli, ['--help']); assert 'timeline' in r.output, r.output; "
        "assert 'petctl.timeline' not in sys.modules and 'boto3' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
