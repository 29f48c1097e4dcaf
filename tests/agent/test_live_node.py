"""The live node's own rules (node/live.py), with real worker processes standing in for a torchft
loop: a failed worker starts again alone under a new replica id, within the restart budget; a drain
is the drain file, then SIGTERM past the drain timeout; the node succeeds once every worker has."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from petctl_agent.elastic.outcome import Outcome
from petctl_agent.node.live import LiveNode, lighthouse_url

# A worker: records its replica id and local rank, then acts as its MODE file says.
WORKER = """
import os, sys, time, signal
d = sys.argv[1]
rid, rank = os.environ["PETCTL_LIVE_REPLICA_ID"], os.environ["LOCAL_RANK"]
open(os.path.join(d, "starts"), "a").write(f"{rid} {rank} {os.environ['PETCTL_LIVE_LIGHTHOUSE']}\\n")
mode = open(os.path.join(d, "mode")).read().strip()
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
drain = os.environ["PETCTL_DRAIN_FILE"]
for _ in range(600):
    if mode == "fail-once" and rank == "1" and not rid.endswith(".r1"):
        print("boom: CUDA error", file=sys.stderr)
        sys.exit(3)
    if mode == "fail" and rank == "0":
        print("boom again", file=sys.stderr)
        sys.exit(4)
    if mode == "finish":
        sys.exit(0)
    if os.path.exists(drain) and mode != "ignore-term":
        sys.exit(0)  # left at a step boundary
    time.sleep(0.05)
sys.exit(0)
"""


class Pub:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.state: dict = {}

    def event(self, kind: str, **kw) -> None:
        self.events.append((kind, kw))

    def update(self, **kw) -> None:
        self.state.update(kw)

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


def node(
    tmp_path: Path, mode: str, nproc: int = 2, max_restarts: int = 3, drain_timeout: float = 30
) -> LiveNode:
    (tmp_path / "mode").write_text(mode)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "work").mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "PETCTL_DRAIN_FILE": str(tmp_path / "drain"), "RANK": "7"}
    return LiveNode(
        python=sys.executable,
        script=script,
        args=(str(tmp_path),),
        nproc=nproc,
        env=env,
        lighthouse="http://10.0.0.5:29510",
        replica_id="i-0abc",
        logs_dir=tmp_path / "logs",
        work_dir=tmp_path / "work",
        drain_file=tmp_path / "drain",
        drain_timeout=drain_timeout,
        max_restarts=max_restarts,
        pub=Pub(),
    )


def starts(tmp_path: Path) -> list[str]:
    return (tmp_path / "starts").read_text().split("\n")[:-1]


def test_the_lighthouse_is_on_the_rendezvous_host() -> None:
    assert lighthouse_url("10.0.0.5:2379", 29510) == "http://10.0.0.5:29510"
    assert lighthouse_url("10.0.0.5", 29510) == "http://10.0.0.5:29510"


def test_a_failed_worker_starts_again_alone_under_a_new_replica_id(tmp_path) -> None:
    n = node(tmp_path, "fail-once")
    out: list[Outcome] = []
    t = threading.Thread(target=lambda: out.append(n.run()))
    t.start()
    deadline = time.monotonic() + 30
    while len(starts(tmp_path) if (tmp_path / "starts").exists() else []) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    n.request_leave("scale-in")
    t.join(30)
    assert out == [Outcome.DRAINED]
    # ranks 0 and 1 once each, then rank 1 alone, as a new member; rank 0 never restarted
    assert sorted(starts(tmp_path)[:2]) == [
        "i-0abc 0 http://10.0.0.5:29510",
        "i-0abc 1 http://10.0.0.5:29510",
    ]
    assert starts(tmp_path)[2:] == ["i-0abc.r1 1 http://10.0.0.5:29510"]
    pub = n.pub
    failed = [kw for k, kw in pub.events if k == "workers_failed"]
    assert len(failed) == 1 and "local rank 1: exit 3: boom: CUDA error" == failed[0]["failures"]
    started = [kw for k, kw in pub.events if k == "workers_started"]
    assert [s["local_ranks"] for s in started] == [[0, 1], [1]] and started[1]["restart"] is True
    assert pub.state["restarts"] == 1
    drained = [kw for k, kw in pub.events if k == "drained"]
    assert drained[0]["clean"] is True and drained[0]["exit_codes"] == [0]
    assert (tmp_path / "logs" / "live" / "attempt_1" / "1" / "stderr.log").exists()


def test_past_the_restart_budget_the_node_fails_with_the_worker_s_line(tmp_path) -> None:
    n = node(tmp_path, "fail", max_restarts=2)
    assert n.run() is Outcome.FAILED
    assert n.fail_reason == "local rank 0: exit 4: boom again (after 2 restarts: the restart budget is spent)"
    assert [s.split()[0] for s in starts(tmp_path) if s.split()[1] == "0"] == [
        "i-0abc",
        "i-0abc.r1",
        "i-0abc.r2",
    ]
    assert all(w.proc.poll() is not None for w in n.workers)  # rank 1 was stopped


def test_every_worker_done_is_success(tmp_path) -> None:
    n = node(tmp_path, "finish", nproc=3)
    assert n.run() is Outcome.SUCCEEDED
    assert n.pub.kinds() == ["workers_started"]


def test_a_worker_that_does_not_leave_is_stopped_past_the_drain_timeout(tmp_path) -> None:
    n = node(tmp_path, "ignore-term", nproc=1, drain_timeout=1)
    n.request_leave("spot")
    t0 = time.monotonic()
    assert n.run() is Outcome.DRAINED
    took = time.monotonic() - t0
    drained = [kw for k, kw in n.pub.events if k == "drained"]
    assert drained[0]["sigterm"] is True and drained[0]["clean"] is False
    assert n.workers[0].proc.returncode == -9  # it ignored SIGTERM too: SIGKILL
    assert took < 30, took


def test_a_drain_file_of_an_earlier_agent_is_not_a_leave(tmp_path) -> None:
    (tmp_path / "drain").write_text("leave")
    n = node(tmp_path, "finish", nproc=1)
    assert n.run() is Outcome.SUCCEEDED and "drained" not in n.pub.kinds()
    assert not (tmp_path / "drain").exists()  # else every worker would leave at its first step
