"""The timeline's derivation, text chart and HTML page, from synthetic agent status documents."""

from __future__ import annotations

import json
import re

import pytest
from timeline_fixtures import SVG, Agent, check_page, event_kinds, parse_page

from petctl import timeline

T = 1_700_000_000.0


def ev(t: float, kind: str, **data) -> dict:
    return {"t": T + t, "kind": kind, **data}


COORDINATED = "coordinated checkpoint (peer drain/scale)"
MOVED = "rendezvous round moved on (3 -> 0)"
SCALED_IN = "autoscaling target-lifecycle-state=Terminated"
FAILED = "workers failed (exit codes [1]) after a membership change: participant(s) left: b"


def scenario() -> dict:
    """What `jobs.status()` returns after: start at 2 nodes, a join, a drain, a hard loss (and its
    replacement joining), an etcd restart that lost the rendezvous state, success.

    Per-agent documents as agents write them; ``status()`` merges their events in time order.
    """
    a = (
        Agent(T, "i-a", "10.0.0.1")
        .ev(0, "agent_started")
        .rendezvous(1, 6, 7.4, rnd=0, world=2, started=T + 1)
        .rendezvous(80, 88, 90, rnd=1, world=3, reason="1 node(s) waiting to join", left=0)
        .ev(140, "drain_requested", reason=SCALED_IN, round=1)
        .ev(146, "drained", clean=True, round=1)
    )
    b = (
        Agent(T, "i-b", "10.0.0.2")
        .ev(0.5, "agent_started")
        .rendezvous(1.5, 6, 8, rnd=0, world=2)
        .rendezvous(81, 88, 91, rnd=1, world=3, reason=COORDINATED, left=0)
        .rendezvous(145, 150, 151, rnd=2, world=2, reason=COORDINATED, left=1)
    )
    c = (
        Agent(T, "i-c", "10.0.0.3")
        .ev(60, "agent_started")
        .rendezvous(70, 88, 92, rnd=1, world=3)
        .rendezvous(145.5, 150, 152, rnd=2, world=2, reason=COORDINATED, left=1)
        .ev(203, "workers_failed", round=2, exit_codes=[1])
        .rendezvous(210, 228, 229, rnd=3, world=2, reason=FAILED, left=2)
        .rendezvous(262, 268, 269, rnd=0, world=2, reason=MOVED, left=3)
        .ev(330, "succeeded", last_step=900)
    )
    d = (
        Agent(T, "i-d", "10.0.0.4")
        .ev(215, "agent_started")
        .rendezvous(225, 228, 230, rnd=3, world=2)
        .rendezvous(263, 268, 270, rnd=0, world=2, reason=MOVED, left=3)
        .ev(330.5, "succeeded", last_step=900)
    )
    agents = [
        a.doc("LEFT", 147, 384, reason=SCALED_IN),
        b.doc("RUNNING", 198, 450),  # hard-killed: its last report stays behind
        c.doc("SUCCEEDED", 331, 900),
        d.doc("SUCCEEDED", 331.5, 900),
    ]
    events = sorted(
        ({**e, "instance_id": x["instance_id"]} for x in agents for e in x["events"]), key=lambda e: e["t"]
    )
    return {
        "job": "demo",
        "state": "SUCCEEDED",
        "last_step": 900,
        "hosts": [],
        "agents": agents,
        "events": events,
    }


@pytest.fixture
def data() -> dict:
    return timeline.build(scenario(), now=T + 400)


def test_rounds_stalls_and_causes(data):
    rounds = data["rounds"]
    assert [(r["epoch"], r["round"]) for r in rounds] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert [r["causes"] for r in rounds] == [
        ["start"],
        ["join"],
        ["drain"],
        ["loss", "join"],
        ["etcd_restart"],
    ]
    assert [r["world_size"] for r in rounds] == [2, 3, 2, 2, 2]
    # start: first rendezvous_start (1) -> last workers_started (8)
    # join: first training agent leaves (80) -> last workers_started (92)
    # drain: drain_requested (140) -> 152
    # loss: the lost node's last report (198, before the survivor's workers_failed at 203) -> 230
    # etcd restart: 262 -> 270
    assert [r["stall_s"] for r in rounds] == [7.0, 12.0, 12.0, 32.0, 8.0]
    assert rounds[3]["stall_source"] == "lost node's last report"
    assert data["stall_s"] == 12 + 12 + 32 + 8
    assert rounds[1]["reason"] == "1 node(s) waiting to join"
    assert rounds[2]["instances"] == ["i-b", "i-c"]


def test_membership_events_and_their_cost(data):
    got = [(m["kind"], m["instance_id"], round(m["t"] - T, 1), m["cost_s"]) for m in data["events"]]
    assert got == [
        ("start", None, 0.0, 7.0),
        ("join", "i-c", 70.0, 12.0),
        ("drain", "i-a", 140.0, 12.0),
        ("loss", "i-b", 198.0, 32.0),
        ("join", "i-d", 225.0, 32.0),
        ("etcd_restart", None, 262.0, 8.0),
        ("finish", None, 330.0, None),
    ]
    loss = next(m for m in data["events"] if m["kind"] == "loss")
    assert loss["shared"] and loss["private_ip"] == "10.0.0.2"


def test_world_size_over_time(data):
    w = [(round(p["t"] - T, 1), p["world_size"]) for p in data["world"]]
    assert w == [
        (0.0, 0),
        (8.0, 2),
        (80.0, 0),
        (92.0, 3),
        (140.0, 0),
        (152.0, 2),
        (198.0, 0),
        (230.0, 2),
        (262.0, 0),
        (270.0, 2),
        (330.0, 0),
    ]
    assert data["start"] == T and data["end"] == T + 330 and not data["running"]


def test_throughput_uses_training_time_only(data):
    segs = [(round(s["t0"] - T), round(s["t1"] - T), s["steps"], s["train_s"]) for s in data["throughput"]]
    # samples: a's last report (147, 384), b's (198, 450), c's succeeded event (330, 900)
    assert segs == [(147, 198, 66, 46.0), (198, 330, 450, 92.0)]
    assert data["throughput"][0]["steps_per_s"] == pytest.approx(66 / 46, abs=1e-3)
    by_round = [r["steps_per_s"] for r in data["rounds"]]
    assert by_round[:2] == [None, None]  # no progress sample before the drain
    assert by_round[2] == pytest.approx(66 / 46, abs=1e-3)
    assert by_round[4] == pytest.approx(450 / 92, abs=1e-3)
    assert any("sample" in m for m in data["missing"])


def test_running_job_extends_to_now():
    st = scenario()
    cut = T + 200
    for a in st["agents"]:
        a["events"] = [e for e in a["events"] if e["t"] <= cut]
    st["events"] = [e for e in st["events"] if e["t"] <= cut]
    st["agents"] = [a for a in st["agents"] if a["instance_id"] != "i-d"]
    st["agents"][2].update(state="RUNNING", updated_at=cut, last_step=470)
    st["agents"][1].update(updated_at=cut - 1)
    st["state"] = "RUNNING"
    d = timeline.build(st, now=cut + 5)
    assert d["running"] and d["end"] == cut + 5
    assert [r["causes"] for r in d["rounds"]] == [["start"], ["join"], ["drain"]]
    assert d["world"][-1] == {"t": cut + 5, "world_size": 2}
    assert "now" in timeline.render_text(d)


def test_etcd_restart_without_round_reset_by_reason_only():
    """Rounds numbered on (etcd kept its data dir) but an agent saw them move back: still an etcd restart."""
    evs = [
        ev(0, "rendezvous_start", reason="initial", round=None, instance_id="x"),
        ev(5, "workers_started", round=4, world_size=1, instance_id="x"),
        ev(50, "rendezvous_start", reason="rendezvous round moved on (4 -> 1)", round=4, instance_id="x"),
        ev(55, "workers_started", round=5, world_size=1, instance_id="x"),
    ]
    st = {"job": "j", "state": "RUNNING", "agents": [], "events": evs}
    d = timeline.build(st, now=T + 60)
    assert [r["causes"] for r in d["rounds"]] == [["start"], ["etcd_restart"]]
    assert d["rounds"][1]["stall_s"] == 5.0


def test_spot_and_worker_failure_and_event_steps():
    """A spot notice is a drain of kind spot; steps on events (if agents publish them) give steps lost."""
    evs = [
        ev(0, "rendezvous_start", reason="initial", round=None, instance_id="x"),
        ev(1, "rendezvous_start", reason="initial", round=None, instance_id="y"),
        ev(5, "workers_started", round=0, world_size=2, instance_id="x", step=0),
        ev(5, "workers_started", round=0, world_size=2, instance_id="y", step=0),
        ev(20, "workers_failed", round=0, exit_codes=[1], instance_id="x", step=100),
        ev(20, "workers_failed", round=0, exit_codes=[1], instance_id="y", step=100),
        ev(21, "rendezvous_start", reason="workers failed (exit codes [1])", round=0, instance_id="x"),
        ev(21, "rendezvous_start", reason="workers failed (exit codes [1])", round=0, instance_id="y"),
        ev(30, "workers_started", round=1, world_size=2, instance_id="x", step=80),
        ev(31, "workers_started", round=1, world_size=2, instance_id="y", step=80),
        ev(
            60,
            "drain_requested",
            reason='spot instance-action {"action": "terminate"}',
            round=1,
            instance_id="y",
        ),
        ev(
            62,
            "rendezvous_start",
            reason="coordinated checkpoint (peer drain/scale)",
            round=1,
            instance_id="x",
        ),
        ev(70, "workers_started", round=2, world_size=1, instance_id="x", step=300),
    ]
    st = {"job": "j", "state": "RUNNING", "agents": [], "events": evs}
    d = timeline.build(st, now=T + 80)
    assert [r["causes"] for r in d["rounds"]] == [["start"], ["restart"], ["spot"]]
    assert [r["stall_s"] for r in d["rounds"]] == [5.0, 11.0, 10.0]
    assert d["rounds"][1]["steps_lost"] == 20
    # 0 -> 100 in round 0 (5 s .. 20 s); the restart resumed at 80, and 80 -> 300 by 70 s spans
    # round 1's training (31 s .. 60 s) only
    assert d["rounds"][0]["steps_per_s"] == pytest.approx(100 / 15, abs=1e-3)
    assert d["rounds"][1]["steps_per_s"] == pytest.approx(220 / 29, abs=1e-3)
    assert not any("events carry no step" in m for m in d["missing"])


def test_a_restore_from_memory_sets_the_step_a_round_resumed_at():
    """With memory snapshots, ``workers_started`` carries the newest step on EFS, which can lag the
    step the workers load from memory (its EFS write still under way); the node's later
    ``snapshot_restored`` says what they loaded. A join that lost no step must not read as 5 lost
    (CI: 160 on EFS, 165 loaded from memory). A node with no report keeps its EFS step."""
    evs = [
        ev(0, "workers_started", round=0, world_size=2, instance_id="x", step=0),
        ev(0, "workers_started", round=0, world_size=2, instance_id="y", step=0),
        ev(20, "workers_failed", round=0, exit_codes=[1], instance_id="x", step=165),
        ev(21, "rendezvous_start", reason=COORDINATED, round=0, instance_id="x"),
        ev(22, "workers_started", round=1, world_size=3, instance_id="x", step=160),
        ev(22, "workers_started", round=1, world_size=3, instance_id="y", step=165),
        ev(22, "workers_started", round=1, world_size=3, instance_id="z", step=160),
        ev(23, "snapshot_restored", source="self", step=165, instance_id="x"),
        ev(23, "snapshot_restored", source="peer", step=165, instance_id="z"),
    ]
    st = {"job": "j", "state": "RUNNING", "agents": [], "events": evs}
    rounds = timeline.build(st, now=T + 30)["rounds"]
    assert rounds[1]["step_after"] == 165 and rounds[1]["steps_lost"] == 0
    # without z's report, z's EFS step is what the round is known to have resumed at
    st["events"] = evs[:-1]
    assert timeline.build(st, now=T + 30)["rounds"][1]["step_after"] == 160


def test_nothing_to_draw_yet():
    d = timeline.build({"job": "j", "state": "STARTING", "agents": [], "events": []}, now=T)
    assert d["rounds"] == [] and "nothing to draw" in timeline.render_text(d)
    assert "no rendezvous round" in timeline.render_html(d)
    json.dumps(timeline.to_json(d))


def test_text_chart(data):
    text = timeline.render_text(data, width=66)
    lines = text.splitlines()
    assert lines[0].startswith(
        "job demo: SUCCEEDED, 5m30s from the first agent to the end, 5 round(s), 64.0s not"
    )
    world_rows = [ln for ln in lines if "│" in ln][:3]  # world size 3 → three rows
    assert world_rows[0].lstrip().startswith("3│") and world_rows[2].lstrip().startswith("1│")
    lane = next(ln for ln in lines if ln.lstrip().startswith("events│"))
    assert [c for c in lane.split("│", 1)[1] if c != " "] == ["S", "J", "D", "L", "J", "E", "*"]
    assert "round" in text and "12.0" in text and "32.0" in text
    ascii_text = timeline.render_text(data, width=66, ascii_only=True)
    ascii_text.encode("ascii")


def test_html_page(data):
    page = timeline.render_html(data)
    causes = ["start", "join", "drain", "loss, join", "etcd_restart"]
    p, svg = check_page(page, [7.0, 12.0, 12.0, 32.0, 8.0], causes)
    assert [r[2] for r in p.tables["rounds"][1:]] == ["2", "3", "2", "2", "2"]
    assert event_kinds(svg) == ["start", "join", "drain", "loss", "join", "etcd_restart", "finish"]
    rates = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "rate"]
    assert [float(g.get("data-steps-per-s")) for g in rates] == [
        pytest.approx(66 / 46, abs=1e-3),
        pytest.approx(450 / 92, abs=1e-3),
    ]
    # bars cover training only: 152..198 for the first; 230..262 and 270..330 for the second
    assert [len(g.findall(f"{SVG}rect")) for g in rates] == [1, 2]
    events = p.tables["events"]
    assert (
        events[4][1] == "node lost (hard)" and events[4][2] == "10.0.0.2" and events[4][4] == "32.0 (shared)"
    )


def test_html_escapes_what_agents_wrote():
    st = scenario()
    st["agents"][0]["events"][-2]["reason"] = "<script>alert(1)</script>"
    for e in st["events"]:
        if e["kind"] == "drain_requested":
            e["reason"] = "<script>alert(1)</script>"
    page = timeline.render_html(timeline.build(st, now=T + 400))
    assert "<script>" not in page
    parse_page(page)


def test_json_has_iso_times(data):
    j = timeline.to_json(data)
    json.dumps(j)
    assert j["start"] == "2023-11-14T22:13:20.000+00:00"
    assert j["rounds"][1]["ready"] == "2023-11-14T22:14:52.000+00:00" and j["rounds"][1]["at_s"] == 92.0
    assert j["rounds"][1]["stall_from_s"] == 80.0
    assert j["events"][3]["kind"] == "loss" and j["events"][3]["at_s"] == 198.0
    assert j["world"][1] == {"t": "2023-11-14T22:13:28.000+00:00", "at_s": 8.0, "world_size": 2}
    assert j["throughput"][0]["t0"].endswith("+00:00") and j["throughput"][0]["t1_s"] == 198.0


def test_html_page_header_figures_and_legend(data):
    page = timeline.render_html(data)
    figures = re.findall(r"<li><b>([^<]*)</b><span>([^<]*)</span></li>", page)
    assert figures == [
        ("5m30s", "from the first agent to the end"),
        ("5", "rendezvous rounds"),
        ("64.0 s", "not training after the first round (19% of the run)"),
        ("2–3", "world size"),
        ("5", "membership changes"),
    ]
    assert "2023-11-14 22:13:20 UTC to 2023-11-14 22:18:50 UTC" in page
    legend = page[page.index('<ul class="legend">') : page.index("</ul>", page.index('<ul class="legend">'))]
    # a letter for each kind of event this run had, and none for the others (no spot, no failure)
    assert re.findall(r"<b style=[^>]*>([^<]*)</b>([^<]*)</li>", legend) == [
        ("S", "job start"),
        ("J", "node joined"),
        ("D", "node drained (scale-in)"),
        ("L", "node lost (hard)"),
        ("E", "rendezvous server (etcd) restart"),
        ("*", "job finished"),
    ]


def test_event_letters_close_in_time_do_not_overlap(data):
    import copy

    d = copy.deepcopy(data)
    d["events"][2]["t"] = d["events"][1]["t"] + 0.5  # the drain right after the join (as in a real demo)
    _, svg = parse_page(timeline.render_html(d))
    marks = [
        (float(g.find(f"{SVG}text").get("x")), float(g.find(f"{SVG}text").get("y")))
        for g in svg.iter(f"{SVG}g")
        if g.get("class") == "event"
    ]
    (x1, y1), (x2, y2) = marks[1], marks[2]
    assert abs(x2 - x1) < 10 and abs(y2 - y1) >= 11
    # letters far apart stay on the first row
    assert {y for i, (_, y) in enumerate(marks) if i != 2} == {marks[0][1]}


def test_a_node_that_left_as_its_round_closed_is_in_that_round() -> None:
    """a and b train; n3 joins and is SIGTERMed as round 1 closes with it: a and b count 3 and start
    at world 3, n3 publishes round 1 (``rendezvous_done`` with ``leaving``) and its ``drained``
    before any worker of round 1 starts, and a and b go on at 2 in round 2. The timeline has n3 in
    round 1 (its peers counted it: nodes 3, three instances), joining, and leaving as a drain before
    round 2 (was: round 1 of 2 instances counting 3 nodes, n3 nowhere, round 2 "other")."""
    gone = "new round opened (round 2; gone: n3)"
    a = (
        Agent(T, "i-a", "10.0.0.1")
        .ev(0, "agent_started")
        .rendezvous(1, 6, 7, rnd=0, world=2, started=T + 1)
        .rendezvous(52, 55, 56, rnd=1, world=3, reason="1 node(s) waiting to join", left=0)
        .rendezvous(60, 62, 63, rnd=2, world=2, reason=gone, left=1)
    )
    b = (
        Agent(T, "i-b", "10.0.0.2")
        .ev(0.5, "agent_started")
        .rendezvous(1.5, 6, 7.5, rnd=0, world=2)
        .rendezvous(52.5, 55, 56.5, rnd=1, world=3, reason=COORDINATED, left=0)
        .rendezvous(60.5, 62, 63.5, rnd=2, world=2, reason=gone, left=1)
    )
    n3 = (
        Agent(T, "i-n3", "10.0.0.3")
        .ev(50, "agent_started")
        .ev(51, "rendezvous_start", reason="initial", round=None)
        .ev(55, "rendezvous_done", round=1, world_size=3, nodes=3, group_rank=2, started=T + 51, leaving=True)
        .ev(55.1, "drained", clean=True, phase="rendezvous", round=1)
    )
    agents = [a.doc("RUNNING", 70, 100), b.doc("RUNNING", 70, 100), n3.doc("LEFT", 56, 0, reason="SIGTERM")]
    events = sorted(
        ({**e, "instance_id": x["instance_id"]} for x in agents for e in x["events"]), key=lambda e: e["t"]
    )
    st = {
        "job": "demo",
        "state": "RUNNING",
        "last_step": 100,
        "hosts": [],
        "agents": agents,
        "events": events,
    }
    data = timeline.build(st, now=T + 80)
    rounds = {r["round"]: r for r in data["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    assert (rounds[1]["nodes"], rounds[1]["instances"]) == (3, ["i-a", "i-b", "i-n3"]), rounds[1]
    assert rounds[1]["ready"] == T + 56.5  # n3 started no worker: the round is ready with a and b's
    assert (rounds[2]["instances"], rounds[2]["causes"]) == (["i-a", "i-b"], ["drain"]), rounds[2]
    marks = [(m["kind"], m["instance_id"], m["round"]) for m in data["events"] if m["instance_id"] == "i-n3"]
    assert marks == [("join", "i-n3", 1), ("drain", "i-n3", 2)], marks


def test_a_live_job_s_quorums_are_its_rounds():
    """A live job (node/live.py) starts its workers once and publishes ``quorum`` events, keyed by
    the step each quorum size first committed (the same on every member): each is a round."""
    a = (
        Agent(T, "i-a", "10.0.0.1")
        .ev(0, "agent_started")
        .ev(2, "workers_started", live=True)
        .ev(5, "quorum", world_size=2, step=3, round=1, live=True)
        .ev(41, "quorum", world_size=3, step=300, round=298, live=True)
        .ev(60, "quorum", world_size=2, step=490, round=489, live=True)
    )
    b = (
        Agent(T, "i-b", "10.0.0.2")
        .ev(0.5, "agent_started")
        .ev(2.2, "workers_started", live=True)
        .ev(5.3, "quorum", world_size=2, step=2, round=1, live=True)
        .ev(40.5, "quorum", world_size=3, step=299, round=298, live=True)
        .ev(58, "drain_requested", reason=SCALED_IN, live=True)
        .ev(59, "drained", clean=True, live=True)
    )
    c = (
        Agent(T, "i-c", "10.0.0.3")
        .ev(30, "agent_started")
        .ev(32, "workers_started", live=True)
        .ev(40.8, "quorum", world_size=3, step=298, round=298, live=True)
        .ev(60.4, "quorum", world_size=2, step=490, round=489, live=True)
    )
    agents = [a.doc("RUNNING", 61, 500), b.doc("LEFT", 59, 480, reason=SCALED_IN), c.doc("RUNNING", 61, 500)]
    events = sorted(
        ({**e, "instance_id": x["instance_id"]} for x in agents for e in x["events"]), key=lambda e: e["t"]
    )
    st = {
        "job": "live",
        "state": "RUNNING",
        "last_step": 500,
        "hosts": [],
        "agents": agents,
        "events": events,
    }
    rounds = timeline.build(st, now=T + 70)["rounds"]
    assert [(r["round"], r["world_size"], r["instances"]) for r in rounds] == [
        (1, 2, ["i-a", "i-b"]),
        (298, 3, ["i-a", "i-b", "i-c"]),
        (489, 2, ["i-a", "i-c"]),
    ]
    assert [r["causes"] for r in rounds] == [["start"], ["join"], ["drain"]]


def test_a_node_excluded_for_failures_that_began_on_it_is_no_loss():
    """Two failed rounds began on y; its agent published ``excluded`` and left (issue #30): the
    round without it names it excluded, not lost, with the failures it counted."""
    evs = [
        ev(0, "rendezvous_start", reason="initial", round=None, instance_id="x"),
        ev(1, "rendezvous_start", reason="initial", round=None, instance_id="y"),
        ev(5, "workers_started", round=0, world_size=2, instance_id="x", step=0),
        ev(5, "workers_started", round=0, world_size=2, instance_id="y", step=0),
        ev(20, "workers_failed", round=0, exit_codes=[1], instance_id="y", step=2),
        ev(20.2, "workers_failed", round=0, exit_codes=[1], instance_id="x", step=2),
        ev(23, "excluded", round=0, failures=2, node="y", reason="excluded: ...", instance_id="y"),
        ev(24, "rendezvous_start", reason="workers failed (exit codes [1])", round=0, instance_id="x"),
        ev(26, "workers_started", round=1, world_size=1, instance_id="x", step=0),
    ]
    st = {"job": "j", "state": "RUNNING", "agents": [], "events": evs}
    d = timeline.build(st, now=T + 40)
    assert [r["causes"] for r in d["rounds"]] == [["start"], ["exclude"]]
    m = next(m for m in d["events"] if m["kind"] == "exclude")
    assert m["instance_id"] == "y" and "excluded after 2 failures that began on it" in m["detail"], m
    assert "exclude" in timeline.KIND_LETTERS and "exclude" in timeline.KIND_LABELS
    page = timeline.render_html(d)
    assert "node excluded (failed rounds in a row began on it)" in page
