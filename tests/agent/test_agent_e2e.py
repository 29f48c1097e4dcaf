"""End-to-end: real etcd, real agents (one per 127.0.0.x address), real torch workers (gloo).

Every wait is bounded and polls outcomes (progress lines, status files); the
timings printed here are what bench/agent_timings.py reports.

The first two tests run on torch's ``etcd-v2`` handler, the fallback backend (spec
``rdzv_backend: etcd-v2``), so it keeps working: join, drain, hard loss and an etcd
restart. The default backend (petctl-etcd) goes through the same faults, and more, in
tests/faults.
"""

from __future__ import annotations

import json

import pytest
from harness import recovery, wait_for

from petctl_agent import EXIT_JOIN_TIMEOUT
from petctl_agent import checkpoint as ckpt

pytestmark = pytest.mark.e2e

EVERY = 20
ARGS = ["--step-time", "0.05", "--checkpoint-every", str(EVERY)]
ENV = {"PETCTL_COLLECTIVE_TIMEOUT": "30"}
FALLBACK = {"rdzv_backend": "etcd-v2"}


def _events(cluster, node, kind):
    st = cluster.status(node.instance_id) or {}
    return [e for e in st.get("events", []) if e["kind"] == kind]


def test_fallback_etcd_v2_scale_up_drain_and_hard_kill(make_cluster):
    """etcd-v2 fallback. MIN=2 start; join (world 3); SIGTERM drain (0 steps lost); join; SIGKILL a node tree.

    With ``max_restarts=1``: none of these four membership changes spends the restart budget."""
    c = make_cluster(job="lifecycle", min_nodes=2, max_nodes=4, script_args=["--total-steps", "100000", *ARGS],
                     extra_env=ENV, spec_extra={"max_restarts": 1, **FALLBACK})  # fmt: skip
    a, b = c.add_node(), c.add_node()
    c.wait(
        lambda: c.all_at_world([a, b], 2, 0, min_steps=3),
        120,
        "2 nodes stepping at world size 2",
        alive=[a, b],
    )

    # scale-up: a third node joins, everyone re-forms at world size 3 from a coordinated checkpoint
    t = c.now()
    n3 = c.add_node()
    c.wait(
        lambda: c.all_at_world([a, b, n3], 3, t, min_steps=3),
        120,
        "world size 3 after a join",
        alive=[a, b, n3],
    )
    r = recovery(c, t, [a, b, n3])
    print("join:", r)
    assert r["steps_lost"] == 0

    # graceful leave: SIGTERM -> all ranks checkpoint the same step -> leave -> others re-form at once
    t = c.now()
    c.terminate(b)
    assert wait_for(lambda: b.proc.poll() is not None, 60, "drained agent to exit") is not None
    assert b.proc.returncode == 0
    c.wait(
        lambda: c.all_at_world([a, n3], 2, t, min_steps=3), 120, "world size 2 after a drain", alive=[a, n3]
    )
    r = recovery(c, t, [a, n3])
    print("drain:", r)
    assert r["steps_lost"] == 0, r
    st = c.status(b.instance_id)
    assert st["state"] == "LEFT"
    assert [e for e in st["events"] if e["kind"] == "drained"][-1]["clean"] is True

    # hard node loss: whole process tree SIGKILLed; survivors resume from the checkpoint
    t = c.now()
    n4 = c.add_node()
    c.wait(
        lambda: c.all_at_world([a, n3, n4], 3, t, min_steps=3), 120, "world size 3 again", alive=[a, n3, n4]
    )
    t = c.now()
    c.kill_hard(n4)
    c.wait(
        lambda: c.all_at_world([a, n3], 2, t, min_steps=3),
        120,
        "survivors stepping after a hard kill",
        alive=[a, n3],
    )
    r = recovery(c, t, [a, n3])
    print("hard kill:", r)
    assert r["steps_lost"] <= EVERY + 5, r
    assert r["seconds"] < 60, r
    assert a.alive() and n3.alive()
    for n in (a, n3):
        assert (c.status(n.instance_id) or {}).get("state") in ("RUNNING", "RENDEZVOUS")
        assert _events(c, n, "rendezvous_done")[-1]["world_size"] == 2
    assert (c.status(a.instance_id) or {}).get("rdzv_backend") == "etcd-v2"


def test_fallback_etcd_v2_etcd_restart_then_run_to_completion(make_cluster):
    """etcd-v2 fallback: etcd is killed and restarted mid-training; the job carries on and completes."""
    total = 150
    c = make_cluster(job="etcdrestart", min_nodes=2, max_nodes=2, script_args=["--total-steps", str(total), *ARGS],
                     extra_env=ENV, spec_extra=FALLBACK)  # fmt: skip
    a, b = c.add_node(), c.add_node()
    c.wait(lambda: c.all_at_world([a, b], 2, 0, min_steps=5), 120, "2 nodes stepping", alive=[a, b])
    t = c.now()
    c.etcd.stop()
    c.etcd.start()
    t_up = c.now()
    wait_for(lambda: all(n.last_step() > 0 and n.steps[-1][0] > t_up + 3 for n in (a, b)), 90,
             "steps after etcd came back")  # fmt: skip
    r = recovery(c, t, [a, b])
    print("etcd restart:", r)

    wait_for(lambda: not a.alive() and not b.alive(), 180, "job to finish")
    assert a.proc.returncode == 0 and b.proc.returncode == 0
    assert c.max_step() == total
    for n in (a, b):
        st = c.status(n.instance_id)
        assert st["state"] == "SUCCEEDED", st
        assert st["last_step"] == total
    # checkpoint consistency: latest points at the final step, its checksum verifies, it loads
    pointer = json.loads((c.ckpt_dir / "latest").read_text())
    assert pointer["step"] == total
    state, step = ckpt.load_latest(c.ckpt_dir)
    assert step == total and "model" in state and "optim" in state
    # every rank printed every step exactly once per attempt, ending at total
    for n in (a, b):
        assert n.steps[-1][1] == total


def test_leave_while_waiting_and_bounded_wait_below_min(make_cluster):
    """Below MIN: a scale-in notice while waiting leaves cleanly (rc 0, LEFT); otherwise the join
    timeout fails the node clearly (rc 1, FAILED with the reason) instead of waiting forever."""
    c = make_cluster(job="belowmin", min_nodes=2, max_nodes=2, script_args=["--total-steps", "10", *ARGS],
                     extra_env={**ENV, "PETCTL_AGENT_JOIN_TIMEOUT": "8"})  # fmt: skip
    a = c.add_node()
    wait_for(
        lambda: (c.status(a.instance_id) or {}).get("state") == "RENDEZVOUS", 120, "a waiting in rendezvous"
    )
    # the ASG scale-in path: IMDS target-lifecycle-state flips to Terminated
    c.imds.set(a.instance_id, "autoscaling/target-lifecycle-state", "Terminated")
    wait_for(lambda: a.proc.poll() is not None, 30, "a to leave")
    st = c.status(a.instance_id)
    assert a.proc.returncode == 0 and st["state"] == "LEFT" and "Terminated" in st["reason"]

    b = c.add_node()
    wait_for(lambda: b.proc.poll() is not None, 120, "b to give up")
    st = c.status(b.instance_id)
    assert b.proc.returncode == EXIT_JOIN_TIMEOUT and st["state"] == "FAILED"
    assert "fewer than min_nodes=2" in st["reason"], st["reason"]
