"""An agent that keeps failing on one instance stops being restarted, however far apart its
failures: systemd's window (5 starts in 600 s) misses an agent that dies every few minutes, which
then rejoined and broke the job forever. Real agent processes on a real etcd, SIGKILLed as the
OOM killer would; the limit is 2 here (PETCTL_AGENT_FAILURE_LIMIT) to keep the test short.
"""

from __future__ import annotations

import json
import time

from harness import wait_for

from petctl_agent import EXIT_TERMINAL
from petctl_agent.node.crashes import FILE, Runs


def _began(node) -> float | None:
    """When the node's running agent recorded its start (None: no run recorded as running)."""
    try:
        state = json.loads((node.agent_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
    return state.get("began") if state.get("running") else None


def test_an_agent_killed_again_and_again_stops_at_its_limit(make_cluster) -> None:
    c = make_cluster(min_nodes=2, max_nodes=2, extra_env={"PETCTL_AGENT_FAILURE_LIMIT": "2"})
    node = c.add_node()
    seen = None
    for _ in range(2):  # killed twice while it waits for a second node (minutes apart, on AWS)
        seen = wait_for(
            lambda n=node, s=seen: (b := _began(n)) not in (None, s) and b, 60, "its run recorded"
        )
        c.kill_hard(node)
        node = c.restart_node(node)
    assert node.proc.wait(60) == EXIT_TERMINAL  # systemd does not restart a terminal exit
    st = c.status(node.instance_id)
    assert st["state"] == "FAILED", st
    assert "ended unclean 2 times on this instance" in st["reason"] and "never ended" in st["reason"], st
    # counted like a failed boot: its record in the job's boot/ (the sibling of status/)
    record = (c.status_dir.parent / "boot" / f"{node.instance_id}.log").read_text()
    assert "ended unclean 2 times" in record, record


def test_clean_ends_do_not_count_and_a_restarted_failure_does(tmp_path) -> None:
    runs = Runs(tmp_path / FILE)
    runs.end(False)  # no start recorded by this process: nothing written
    assert not (tmp_path / FILE).exists()
    assert runs.begin() == (0, "")
    runs.end(True)  # drained, succeeded, stopped in the warm pool
    assert runs.begin() == (0, "")
    runs.end(False, "exit 1: RuntimeError: boom")  # systemd restarts it
    failures, last = runs.begin()
    assert (failures, last) == (1, "exit 1: RuntimeError: boom")
    # this run is killed (no end recorded): the next start counts it
    failures, last = Runs(tmp_path / FILE).begin()
    assert failures == 2 and "never ended" in last
    assert time.time()  # (no clock in the count: failures hours apart count the same)
