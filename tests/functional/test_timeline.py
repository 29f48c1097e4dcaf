"""`petctl timeline` through the CLI against a moto server, from agent status documents in S3."""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import browser
import pytest
from timeline_fixtures import Agent, check_page, event_kinds


@pytest.fixture
def job(run, ready) -> list[str]:
    """Base stack plus a job `demo` (min 2, max 4); returns its two worker instance ids."""
    r = run("run_job", "--name", "demo", "--min", "2", "--max", "4", str(ready))
    assert r.exit_code == 0, r.output
    group = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-demo-workers"]
    )
    return sorted(i["InstanceId"] for i in group["AutoScalingGroups"][0]["Instances"])


COORDINATED = "coordinated checkpoint (peer drain/scale)"


def put_reports(ids: list[str], t0: float, finished: bool = False) -> None:
    """As agents would write them: node `gone` and ids[0] start (world 2), ids[1] joins (world 3),
    `gone` is scaled in and drains (world 2); optionally the job then succeeds."""
    a, b = ids
    gone = (
        Agent(t0, "i-0gone", "10.0.0.9")
        .ev(0, "agent_started")
        .rendezvous(1, 6, 7, rnd=0, world=2)
        .rendezvous(101, 106, 108, rnd=1, world=3, reason=COORDINATED, left=0)
        .ev(200, "drain_requested", reason="autoscaling target-lifecycle-state=Terminated", round=1)
        .ev(204, "drained", clean=True, round=1)
    )
    first = (
        Agent(t0, a, "10.0.0.1")
        .ev(0.5, "agent_started")
        .rendezvous(2, 6, 8, rnd=0, world=2)
        .rendezvous(100, 106, 109, rnd=1, world=3, reason="1 node(s) waiting to join", left=0)
        .rendezvous(203, 207, 208, rnd=2, world=2, reason=COORDINATED, left=1)
    )
    joiner = (
        Agent(t0, b, "10.0.0.2")
        .ev(80, "agent_started")
        .rendezvous(95, 106, 110, rnd=1, world=3)
        .rendezvous(203, 207, 209, rnd=2, world=2, reason=COORDINATED, left=1)
    )
    end = 260.0
    if finished:
        first.ev(end, "succeeded", last_step=700)
        joiner.ev(end + 0.5, "succeeded", last_step=700)
    state = "SUCCEEDED" if finished else "RUNNING"
    docs = [
        gone.doc("LEFT", 205, 300, current_round=2),
        first.doc(state, end + 1, 700, current_round=2),
        joiner.doc(state, end + 1, 700, current_round=2),
    ]
    s3 = boto3.client("s3")
    bucket = [x["Name"] for x in s3.list_buckets()["Buckets"]][0]
    for report in docs:
        key = f"petctl/jobs/demo/status/{report['instance_id']}.json"
        s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(report).encode())


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
    # self-contained, one shaded stall per round, the rounds table
    p, svg = check_page(page.read_text(encoding="utf-8"), [7.0, 10.0, 9.0], ["start", "join", "drain"])
    assert [(row[0], row[2], row[4], row[5]) for row in p.tables["rounds"][1:]] == [
        ("0", "2", "start", "7.0"),
        ("1", "3", "join", "10.0"),
        ("2", "2", "drain", "9.0"),
    ]
    assert event_kinds(svg) == ["start", "join", "drain"]

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


# Run in the page after load (a probed copy; the page itself has no scripts): what the browser laid out.
PROBE = """
const svg = document.getElementById('timeline-chart');
const box = (el) => { const b = el.getBBox(); return [b.width, b.height]; };
const all = (sel) => [...document.querySelectorAll('#timeline-chart ' + sel)];
const world = all('polyline.world')[0];
const out = {
  svg: svg && [svg.getBoundingClientRect().width, svg.getBoundingClientRect().height],
  world: world && box(world),
  world_levels: world && [...new Set([...world.points].map((p) => p.y))].length,
  events: all('g.event').map((g) => [g.dataset.kind, ...box(g)]),
  stalls: all('rect.stall').map(box),
  rate: all('g.rate rect').map(box),
};
const pre = document.createElement('pre');
pre.id = 'probe';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
"""


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = browser.find()
    if binary is None:
        pytest.skip(browser.MISSING)
    return binary


def test_timeline_page_in_a_real_browser(run, job, tmp_path, chromium):
    """`petctl timeline --html` as a browser shows it: the chart lays out (the world-size steps, the
    stalls, the rate bars, every event mark), the console stays empty, and the screenshot has the
    chart's colours in it. The screenshot is kept in the test's tmp_path to look at."""
    put_reports(job, time.time() - 600, finished=True)
    page = tmp_path / "timeline.html"
    r = run("timeline", "demo", "--html", str(page))
    assert r.exit_code == 0, r.output

    shown = browser.load(chromium, page, tmp_path, probe=PROBE)
    assert shown.console == []
    probe = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', shown.dom, re.S).group(1)))
    width, height = probe["svg"]
    assert width >= 800 and height >= 300
    # the world-size step line spans the plot and takes the levels 0, 2 and 3
    assert probe["world"][0] >= 0.9 * (width - 80) and probe["world_levels"] == 3
    assert [k for k, w, h in probe["events"]] == ["start", "join", "drain", "finish"]
    assert all(w > 0 and h > 0 for _, w, h in probe["events"])
    assert len(probe["stalls"]) == 3 and all(w > 0 and h > 100 for w, h in probe["stalls"])
    assert probe["rate"] and all(w > 0 and h > 0 for w, h in probe["rate"])

    w, h, pixels = browser.png_pixels(shown.screenshot)
    assert (w, h) == (1200, 1400)
    white = pixels[(255, 255, 255)]
    assert len(pixels) > 50 and white < 0.95 * w * h, "the screenshot is (nearly) blank"
    # the chart drew: the world-size area, the rate bars, the stall shading (#f6c6c6 at 0.6 on white)
    for colour, least in (("#b6d4fe", 20000), ("#8cd9a0", 2000), ("#fadddd", 5000)):
        assert pixels[browser.rgb(colour)] >= least, f"{colour}: {pixels[browser.rgb(colour)]} px"


def test_the_browser_check_sees_console_errors_and_blank_pages(tmp_path, chromium):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>undefinedThing();</script></body></html>")
    shown = browser.load(chromium, page, tmp_path)
    # both loads (the probed copy and the page itself) log it
    assert shown.console and all("undefinedThing is not defined" in m for m in shown.console)
    w, h, pixels = browser.png_pixels(shown.screenshot)
    assert pixels[(255, 255, 255)] == w * h
