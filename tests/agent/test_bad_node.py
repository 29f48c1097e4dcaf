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
    assert len(failed) >= 2 and all("began_at" in e for e in failed), failed
    assert not [e for e in sa.get("events", []) if e["kind"] == "excluded"]
