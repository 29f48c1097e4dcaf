"""A node that is alive but cannot train is excluded (issue #30; ``elastic/culprit.py``).

- the records in a real etcd (``elastic/failurebook.py``): the first node to settle a round's
  culprit stores it, with its count from the round before; every other node reads that one;
- end to end (real etcd, agents and torch/gloo workers, ``PETCTL_AGENT_EXCLUDE_AFTER=2``): one of
  two nodes raises at its third step in every round; its peer's collective fails after it. After
  two failed rounds that began on it, its agent publishes ``excluded``, leaves the rendezvous as a
  drain does and exits 0 (``LEFT``); the other node trains on alone at world 1. Before, the
  deterministic-failure rule ended the whole job at the second failure.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from petctl_agent.elastic.culprit import Failure
from petctl_agent.elastic.failurebook import FailureBook
from petctl_agent.rendezvous.client import RequestCounter, make_client
from petctl_agent.rendezvous.layout import Keys

BAD = Path(__file__).with_name("bad_node_script.py")


def test_the_first_node_settles_a_rounds_culprit_and_the_others_read_it(etcd3) -> None:
    etcd = make_client(etcd3.endpoint, RequestCounter(), 5.0, {})
    book = FailureBook(etcd, Keys("/petctl-test-book", f"run-{time.time_ns()}"))
    for r in (3, 5):
        book.write(r, Failure("i-a", r + 0.3, True, ckpt=None, error="peer"))
        book.write(r, Failure("i-b", r + 0.1, True, ckpt=None, error="bad"))
        got = book.read(r)
        assert sorted(f.node for f in got) == ["i-a", "i-b"]
        first = min(got, key=lambda f: f.t)
        rec = book.settle(r, first)
        assert rec["node"] == "i-b" and rec["round"] == r
    assert book.culprit(3)["count"] == 1 and book.culprit(5)["count"] == 2
    # a node settling later (another view of the round) gets the stored record, not its own
    late = book.settle(5, Failure("i-a", 5.3, True))
    assert late["node"] == "i-b" and late["count"] == 2
    assert book.previous(5)["round"] == 3 and book.previous(3) is None


class _Pub:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **data: object) -> None:
        self.events.append((kind, data))

    def update(self, **fields: object) -> None:
        pass


def _agent(iid: str, book: FailureBook, k: int):
    """A PetctlElasticAgent with only what ``_on_workers_stopped`` reads (no torch workers)."""
    from types import SimpleNamespace

    from petctl_agent.elastic.agent import PetctlElasticAgent
    from petctl_agent.elastic.failures import RepeatWatch

    a = object.__new__(PetctlElasticAgent)
    a.instance_id, a.exclude_after, a.pub = iid, k, _Pub()
    a.leave_requested = threading.Event()
    a.repeats, a._round_failures, a._exit_seen_at = RepeatWatch(), [], None  # noqa: SLF001
    a._remaining_restarts = 10  # noqa: SLF001
    a.step_info = lambda: {"last_step": 2}
    a.stops = SimpleNamespace(failure_noted_at=lambda: None)  # killed, say: the exit seen is the time
    # the failure grace: no membership change comes within it
    a.watch = SimpleNamespace(round=None, failure_explained=lambda leave, until=None: time.sleep(0.5))
    a._worker_group = SimpleNamespace(  # noqa: SLF001
        spec=SimpleNamespace(rdzv_handler=None, max_restarts=10), workers=[], group_world_size=2
    )
    a.restarted, a.stopped, a.left, a.outcome = [], [], [], None
    a._restart_workers = lambda wg: a.restarted.append(a.watch.round)  # noqa: SLF001
    a._stop_workers = lambda wg, *x, **y: a.stopped.append(1)  # noqa: SLF001
    a.leave_rendezvous = lambda: a.left.append(a.watch.round)
    return a


def test_the_culprits_agent_excludes_itself_at_k_and_its_peer_trains_on(etcd3, monkeypatch) -> None:
    """Two agents over one etcd, K=2: b's workers fail first in rounds 5 and 6 (its own error), a's
    collective after it. Round 5: both restart, charged. Round 6: b leaves the rendezvous and ends
    EXCLUDED; a restarts -- its own failure, the same at the same point twice, is not taken for a
    deterministic error of the script, since it began on b (before, the job failed here)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from petctl_agent.elastic.outcome import Outcome

    etcd = make_client(etcd3.endpoint, RequestCounter(), 5.0, {})
    book = FailureBook(etcd, Keys("/petctl-test-agents", f"run-{time.time_ns()}"))
    monkeypatch.setattr(FailureBook, "of", classmethod(lambda cls, handler: book))
    a, b = _agent("i-a", book, 2), _agent("i-b", book, 2)
    lines = {"i-a": "RuntimeError: [gloo] Connection closed by peer", "i-b": "RuntimeError: NCCL error"}
    for n in (a, b):
        n._describe_failures = lambda r, n=n: (  # noqa: SLF001
            f"rank 0 on {n.instance_id} exit 1: {lines[n.instance_id]}",
            (lines[n.instance_id], 'File "train.py", line 9, in main', 2, 2),
        )
    failed = RunResult(state=WorkerState.FAILED, failures={0: SimpleNamespace(exitcode=1)})
    for r, t in ((5, 1000.0), (6, 1010.0)):
        for n in (a, b):
            n.watch.round = r
        b._exit_seen_at, a._exit_seen_at = t, t + 0.15  # noqa: SLF001
        outs: dict = {}

        def fail(n, outs=outs) -> None:
            outs[n.instance_id] = n._on_workers_stopped(n._worker_group, failed)  # noqa: SLF001

        # both at once, as on two nodes: b's failure is seen first, a's a moment later
        ts = [threading.Thread(target=fail, args=(n,)) for n in (b, a)]
        for th in ts:
            th.start()
            time.sleep(0.05)
        for th in ts:
            th.join(30)
        if r == 5:
            assert outs == {"i-a": None, "i-b": None} and a.restarted == [5] and b.restarted == [5]
            assert book.culprit(5)["node"] == "i-b" and book.culprit(5)["count"] == 1
    assert book.culprit(6)["count"] == 2
    assert outs["i-a"] is None and a.restarted == [5, 6] and a.outcome is None, a.pub.events
    assert outs["i-b"] is not None and b.outcome is Outcome.EXCLUDED and b.left == [6] and b.restarted == [5]
    ex = [d for k, d in b.pub.events if k == "excluded"]
    assert len(ex) == 1 and ex[0]["failures"] == 2 and "NCCL error" in ex[0]["reason"], ex
    assert b.fail_reason.startswith("excluded: 2 failed rounds in a row began on this node (i-b)")
    began = [d["began_at"] for k, d in a.pub.events if k == "workers_failed"]
    assert began == [1000.15, 1010.15]
    assert a._remaining_restarts == 8 and b._remaining_restarts == 9  # noqa: SLF001 - charged as before


@pytest.mark.e2e
def test_a_node_whose_failures_begin_every_round_is_excluded_and_the_other_trains_on(make_cluster) -> None:
    c = make_cluster(
        job="badnode",
        min_nodes=1,
        max_nodes=2,
        script=BAD,
        # i-0002 is 127.0.0.12 (harness.Cluster.add_node); a short grace: the failures are not a loss
        extra_env={"BAD_NODE_ADDR": "127.0.0.12", "PETCTL_AGENT_EXCLUDE_AFTER": "2",
                   "PETCTL_AGENT_FAILURE_GRACE": "2.5"},
    )  # fmt: skip
    a = c.add_node()
    b = c.add_node()
    c.wait(lambda: b.proc.poll() is not None, 150, "b excluded and gone", alive=[a])
    assert b.proc.returncode == 0, (b.agent_dir / "agent.err").read_text(errors="replace")[-3000:]
    st = c.status(b.instance_id) or {}
    assert st.get("state") == "LEFT" and "excluded: 2 failed rounds in a row began on this node" in (
        st.get("reason") or ""
    ), st.get("reason")
    ex = [e for e in st.get("events", []) if e["kind"] == "excluded"]
    assert len(ex) == 1 and ex[0]["failures"] == 2 and ex[0]["node"] == "i-0002", ex
    assert "NCCL error" in ex[0]["reason"], ex[0]
    t = ex[0]["t"]
    c.wait(lambda: c.all_at_world([a], 1, t, min_steps=5), 60, "a training alone", alive=[a])
    sa = c.status(a.instance_id) or {}
    assert sa.get("state") == "RUNNING", sa
    failed = [e for e in sa.get("events", []) if e["kind"] == "workers_failed"]
    assert sum("began_at" in e for e in failed) >= 2, failed
    assert not [e for e in sa.get("events", []) if e["kind"] == "excluded"]
