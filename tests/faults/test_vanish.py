"""A node that vanishes without a reset: on real AWS a lost instance
(spot reclaim, kernel panic, partition, power) sends no RST, so its peers' collectives hang
instead of failing. Emulated by SIGSTOP of the node's whole process tree (agent, forkserver,
workers): its sockets stay open, its lease is no longer kept alive.

The survivors' agents see no new step (elastic/stall.py), read the running round's leases
(rendezvous/fastloss.py, ``workers_stalled``) and open the next round naming it gone -- checked on
the mechanism (the stall event, the lease-read log line, no worker failure), not on wall time.
"""

from __future__ import annotations

import time

import pytest
from benchlib import poll

from .conftest import EVERY, assert_room, finish, load_every_checkpoint, wait_world

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_vanished_node_is_found_by_the_lease_reads_of_a_stall(make_run):
    """3 nodes; one whole process tree SIGSTOPped -> the 2 survivors' workers hang, their agents
    see the stall, the lease read names the node gone, they resume from a checkpoint and finish."""
    run = make_run(total_steps=500)
    nodes = [run.add_node() for _ in range(3)]
    wait_world(run, nodes, 3, 0)
    # past a checkpoint or two: the survivors resume from one (a loss at start-up is
    # workers_starting's case, test_rdzv_v3_fastloss.py)
    assert poll(lambda: run.max_step() >= 2 * EVERY + 5, 60, 0.05), f"at step {run.max_step()}"
    assert_room(run, 150)
    victim, survivors = nodes[2], nodes[:2]
    wall = time.time()  # the status events' clock
    t = run.vanish_node(victim)
    wait_world(run, survivors, 2, t)
    lost = run.steps_lost(survivors, 2, t)
    assert lost is not None and lost <= EVERY + 1, f"vanish lost {lost} steps (checkpoint every {EVERY})"

    for n in survivors:
        evs = [e for e in (run.status(n) or {}).get("events", []) if e["t"] > wall]
        kinds = [e["kind"] for e in evs]
        assert "workers_stalled" in kinds and "rendezvous_done" in kinds, (n.name, kinds)
        done = next(e for e in evs if e["kind"] == "rendezvous_done")
        # the stall came first, nothing failed: the hung workers were stopped for the membership change
        assert kinds.index("workers_stalled") < kinds.index("rendezvous_done"), (n.name, kinds)
        assert "workers_failed" not in kinds[: kinds.index("rendezvous_done")], (n.name, kinds)
        assert "gone" in str(done.get("reason")), (n.name, done)
    # the lease read found the loss (not the lease's expiry, which logs nothing of the kind)
    logs = "".join((n.dir / "stderr.log").read_text(errors="replace") for n in survivors)
    assert "not kept alive (our workers stalled)" in logs, (
        f"no stall lease read in the logs under {run.root}/nodes"
    )

    run.kill_node(victim)  # a stopped tree still ends on SIGKILL (the local cloud's terminate)
    assert not victim.alive()
    finish(run, survivors)
    load_every_checkpoint(run)
