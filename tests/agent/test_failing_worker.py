"""A worker whose process is slow to exit after its collective raised (a process that
holds GiBs of state takes seconds to exit on a busy box, and torch reports the failure only
then). The worker notes its failure at once (``worker.forkserver.note_failure``), and the agent
starts the hard-loss lease reads and joins the next round while the process exits.

- the note: written by ``run_script`` when the script raises, long before the process exits
  (real forkserver worker, as the agent starts them);
- end to end (real etcd, agents, torch workers on gloo): a node SIGKILLed; the survivor's worker
  takes 6 s to exit; the survivor is in the next round within ~2-3 s of the kill (the lease
  read), not after the exit, with its restart budget (0) untouched;
- end to end: a node frozen (SIGSTOP: its workers' peers see no error, its lease expires); the
  survivor's worker, SIGTERMed for the membership change, takes 6 s to exit; the survivor joins
  the next round first and reaps its worker after.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from pathlib import Path

import pytest
from harness import wait_for

from petctl_agent.worker.forkserver import PRELOAD, run_script

SLOW = Path(__file__).with_name("slow_exit_script.py")
EXIT_S = 6.0
#: ``--on-sigterm`` reports progress without ``ckpt.step``, so it never honours a join's drain file:
#: the running node's coordinated stop waits its whole sync timeout (30 s here) before its join.
#: What these tests look at comes after world 2: a short sync timeout gets them there sooner.
#: (Before the leader waited for a previous round's node that long, two nodes in a CI run took turns
#: training alone for 180 s: test_a_running_node_whose_stop_outlasts_the_straggler_window_is_waited_for.)
NO_DRAIN_WAIT = {"PETCTL_AGENT_SYNC_TIMEOUT": "2"}


def test_a_failing_worker_notes_its_failure_before_its_slow_exit(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    script = tmp_path / "raises.py"
    script.write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(4.0,), daemon=False).start()\n"
        "raise RuntimeError('Connection reset by peer')\n"
    )
    note = tmp_path / "failed.json"
    multiprocessing.set_forkserver_preload(PRELOAD)
    t0 = time.time()
    pc = start_processes(
        name="failing",
        entrypoint=run_script,
        args={0: (str(script),)},
        envs={0: {"RANK": "0", "LOCAL_RANK": "0", "PETCTL_FAILURE_FILE": str(note)}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL),
        start_method="forkserver",
    )
    try:
        pid = pc.pids()[0]
        wait_for(note.exists, 60, "the failure note")
        noted = time.time()
        assert pc.wait(0) is None, (
            "the worker had already exited: the note came no earlier than torch's report"
        )
        body = json.loads(note.read_text())
        assert body["pid"] == pid and body["rank"] == "0", body
        assert body["error"] == "RuntimeError: Connection reset by peer", body
        assert t0 - 1 < body["t"] <= noted
        r = wait_for(lambda: pc.wait(0), 60, "the worker's exit")
        assert r.is_failed() and time.time() - noted > 2.0, "the exit was not slow: the test shows nothing"
        assert not list(tmp_path.glob("failed.json.*.tmp"))
    finally:
        pc.close()


@pytest.mark.e2e
def test_a_hard_loss_is_rejoined_while_the_failing_worker_exits(make_cluster) -> None:
    c = make_cluster(job="slowexit", min_nodes=1, max_nodes=2, script=SLOW,
                     script_args=["--exit-s", str(EXIT_S)], spec_extra={"max_restarts": 0})  # fmt: skip
    a = c.add_node()
    b = c.add_node()
    c.wait(lambda: c.all_at_world([a, b], 2, 0, min_steps=10), 180, "world 2", alive=[a, b])
    t = c.now()
    c.kill_hard(b)
    c.wait(lambda: c.all_at_world([a], 1, t, min_steps=3), 60, "a alone after the loss", alive=[a])
    evs = (c.status(a.instance_id) or {}).get("events", [])
    rdzv = [e for e in evs if e["kind"] == "rendezvous_start" and e["t"] > t]
    failed = [e for e in evs if e["kind"] == "workers_failed" and e["t"] > t]
    assert rdzv, evs[-8:]
    # the lease read opens the round ~1-3 s after the kill; the worker's exit takes EXIT_S (and
    # without the note the round came from the dead node's lease expiring: 6 s TTL)
    assert rdzv[0]["t"] - t < EXIT_S - 1.5, (rdzv[0]["t"] - t, rdzv[0], failed)
    assert failed, evs[-8:]
    assert "gone" in rdzv[0]["reason"] and failed[0].get("exiting") is True, (rdzv[0], failed[0])
    st = c.status(a.instance_id)
    assert st["state"] == "RUNNING", st  # max_restarts=0: a charged restart would have failed a
    assert os.path.exists(c.tmp)


def _freeze_a_peer(c, timeout: float) -> tuple:
    """Two nodes at world 2; then b's whole tree is SIGSTOPped (an instance that stops answering:
    no reset, the round names it gone) and a trains on alone. Returns a and a's rendezvous_done
    and workers_started events after the freeze (b is killed at the end)."""
    from petctl.local.procs import descendants

    a = c.add_node()
    b = c.add_node()
    c.wait(lambda: c.all_at_world([a, b], 2, 0, min_steps=10), 180, "world 2", alive=[a, b])
    t = c.now()
    for pid in [b.proc.pid, *descendants(b.proc.pid)]:
        os.kill(pid, signal.SIGSTOP)
    try:
        c.wait(lambda: c.all_at_world([a], 1, t, min_steps=3), timeout, "a alone after b froze", alive=[a])
    finally:
        c.kill_hard(b)
    evs = (c.status(a.instance_id) or {}).get("events", [])
    rdzv = [e for e in evs if e["kind"] == "rendezvous_done" and e["t"] > t]
    started = [e for e in evs if e["kind"] == "workers_started" and e["t"] > t]
    assert rdzv and started, evs[-8:]
    return a, rdzv, started


@pytest.mark.e2e
def test_a_restart_for_a_membership_change_joins_the_round_while_the_workers_exit(make_cluster) -> None:
    c = make_cluster(job="slowterm", min_nodes=1, max_nodes=2, script=SLOW, extra_env=NO_DRAIN_WAIT,
                     script_args=["--exit-s", str(EXIT_S), "--on-sigterm"], spec_extra={"max_restarts": 0})  # fmt: skip
    a, rdzv, started = _freeze_a_peer(c, 90)
    # joined the round first, then waited for the SIGTERMed worker's slow exit, then started
    assert started[0]["t"] - rdzv[0]["t"] > EXIT_S - 2.0, (rdzv[0], started[0])
    assert c.status(a.instance_id)["state"] == "RUNNING"


@pytest.mark.e2e
def test_a_worker_that_will_not_exit_is_killed_after_the_grace(make_cluster) -> None:
    """A peer frozen (SIGSTOP, no reset: the round names it gone); the survivor's worker, SIGTERMed
    for the membership change, does not exit for 60 s (its handler is stuck, as a Python SIGTERM
    handler is behind a collective that never returns). The agent SIGKILLs it LOSS_STOP_GRACE
    (10 s) after its SIGTERM, not after torch's 30 s close timeout counted from the next SIGTERM."""
    from petctl_agent.elastic.processes import LOSS_STOP_GRACE

    c = make_cluster(job="stuckterm", min_nodes=1, max_nodes=2, script=SLOW, extra_env=NO_DRAIN_WAIT,
                     script_args=["--exit-s", "60", "--on-sigterm"], spec_extra={"max_restarts": 0})  # fmt: skip
    a, rdzv, started = _freeze_a_peer(c, 120)
    waited = started[0]["t"] - rdzv[0]["t"]
    assert waited < LOSS_STOP_GRACE + 8, f"the stuck worker held the restart {waited:.1f}s (torch: 30 s)"
    err = (a.agent_dir / "agent.err").read_text(errors="replace")
    assert "after SIGTERM (hung in a collective?): SIGKILL" in err, err[-2000:]
    assert c.status(a.instance_id)["state"] == "RUNNING"


def _a_alone_with_a_slow_stop(make_cluster, job: str):
    """A cluster (1-2 nodes) whose script reports progress but never honours the drain file, so a
    coordinated stop takes the whole sync timeout (14 s), and its node a training alone."""
    c = make_cluster(job=job, min_nodes=1, max_nodes=2, script=SLOW,
                     extra_env={"PETCTL_AGENT_SYNC_TIMEOUT": "14"},
                     script_args=["--exit-s", "0.5", "--on-sigterm"], spec_extra={"max_restarts": 0})  # fmt: skip
    a = c.add_node()
    c.wait(lambda: c.all_at_world([a], 1, 0, min_steps=10), 120, "a training alone", alive=[a])
    return c, a


@pytest.mark.e2e
def test_a_running_node_whose_stop_outlasts_the_straggler_window_is_waited_for(make_cluster) -> None:
    """a trains alone; b arrives. a's coordinated stop takes its whole sync timeout (14 s: the
    script reports progress but never honours the drain file, as a first snapshot of GiBs can
    take 11 s), longer than the leader's 10 s straggler window. The leader waits for a node of
    the previous round as long as its stop may take: the next round has both, and b never
    trains alone (before: b alone at world 1, then a alone, round after round, in a CI run)."""
    c, a = _a_alone_with_a_slow_stop(make_cluster, "slowstop")
    t = c.now()
    b = c.add_node()
    c.wait(lambda: c.all_at_world([a, b], 2, t, min_steps=5), 120, "a and b at world 2", alive=[a, b])
    err = (a.agent_dir / "agent.err").read_text(errors="replace")
    assert "did not stop at a checkpoint within 14s" in err, err[-2000:]  # the slow stop happened
    assert not [s for s in b.steps if s[2] != 2], b.steps[:5]  # b's first round had a in it


@pytest.mark.e2e
def test_a_node_told_to_leave_during_its_stop_leaves_the_round_at_once(make_cluster) -> None:
    """As above, a's stop takes its whole sync timeout; during it a is told to leave (a spot
    notice, a scale-in). a will not join the round b opened: it leaves the rendezvous at once, and
    b trains alone long before the leader's wait for a stopping node (stop_wait, 20 s here) or
    a's drain (its script never honours the drain file: up to the drain timeout) would end."""
    c, a = _a_alone_with_a_slow_stop(make_cluster, "leavestop")
    b = c.add_node()
    err = a.agent_dir / "agent.err"
    c.wait(
        lambda: "re-rendezvous:" in err.read_text(errors="replace"),
        90,
        "a stopping for b's round",
        alive=[a, b],
    )
    time.sleep(1.0)  # inside its 14 s stop
    t = c.now()
    c.terminate(a)
    c.wait(lambda: c.all_at_world([b], 1, t, min_steps=3), 60, "b training alone", alive=[b])
    first = min(ts for ts, _, w in b.steps if ts > t and w == 1)
    # leaving at once: the round closes as soon as a's key is gone (b's restart: a few seconds);
    # without it, not before stop_wait (20 s) after the round opened, i.e. > 12 s after the SIGTERM
    assert first - t < 12.0, (first - t, err.read_text(errors="replace")[-2000:])
    c.wait(lambda: not a.alive(), 120, "a's agent done")
    assert (c.status(a.instance_id) or {}).get("state") in ("DRAINED", "LEFT"), c.status(a.instance_id)
