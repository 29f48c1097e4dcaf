"""torch's exit barrier on ``V3Store`` costs etcd O(N) requests, on a real etcd.

Every agent of a job that ends enters ``torch.distributed.elastic.utils.store.barrier``: one
``add(counter, 1)`` each, a ``set`` by the one that counted N, a ``wait`` by all. With the
counter in one key, ``add`` was a compare-and-swap retried on each conflict and every waiter
read again on each change under the store's prefix: 270-400 txns and 510-770 requests for 32
nodes, 1,000 txns and 2,000 requests for 64 (bench/bench_exit_barrier.py). Each add now writes
its own key and reads the count in the same txn, and a wait watches only its keys
(agent/petctl_agent/rendezvous/store.py).
"""

from __future__ import annotations

import shutil
import threading
import uuid
from datetime import timedelta

import pytest
from bench_exit_barrier import measure
from harness import Etcd

from petctl_agent.rendezvous import etcd_transport
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.store import V3Store

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


@pytest.mark.parametrize("n", [8, 32])
def test_the_exit_barrier_costs_at_most_3_requests_per_node(etcd3: Etcd, n: int) -> None:
    """N nodes at once (threads, each its own client): per node one add (a txn), one read and at
    most one watch; one set. The old store made 285 txns for 32 nodes (> 3 x 32 requests)."""
    row = measure(etcd3.endpoint, n, timeout=60)
    print(row)
    assert row["txn"] <= 2 * n + 1, row
    assert row["total"] <= 3 * n, row


def _store(etcd3: Etcd, timeout: float = 5.0) -> V3Store:
    return V3Store(v3.Client(etcd3.endpoint), f"/t/store-{uuid.uuid4().hex[:6]}", timedelta(seconds=timeout))


def test_concurrent_adds_each_see_their_own_count(etcd3: Etcd) -> None:
    """24 threads add 1 at once: each gets a different value, 1..24, and the key reads 24."""
    clients = [v3.Client(etcd3.endpoint) for _ in range(24)]
    prefix = f"/t/store-{uuid.uuid4().hex[:6]}"
    stores = [V3Store(c, prefix, timedelta(seconds=5)) for c in clients]
    got: list[int] = []
    go = threading.Barrier(len(stores))

    def run(s: V3Store) -> None:
        go.wait()
        got.append(s.add("count", 1))

    ts = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sorted(got) == list(range(1, 25))
    assert stores[0].get("count") == b"24" and stores[0].add("count", 0) == 24


def test_a_counter_is_a_key_like_the_others(etcd3: Etcd) -> None:
    """What a c10d store promises of ``add`` next to ``set``/``get``/``check``/``wait``/
    ``num_keys``/``delete_key``: the adds of other amounts, a set that resets the count, a key
    whose name starts with the counter's."""
    s = _store(etcd3)
    assert s.add("n", 5) == 5 and s.add("n", 1) == 6 and s.add("n", -2) == 4 and s.add("n", 0) == 4
    assert s.get("n") == b"4" and s.check(["n"]) and not s.check(["n", "nx"])
    s.set("nx", "other")  # shares the counter's name as a prefix: counts nothing, is counted apart
    assert s.add("n", 1) == 5 and s.get("nx") == b"other"
    assert s.multi_get(["n", "nx"]) == [b"5", b"other"]
    s.set("n", "10")  # a set replaces the count; later adds start from it
    assert s.get("n") == b"10" and s.add("n", 2) == 12
    assert s.num_keys() == 2
    assert s.delete_key("n") and not s.check(["n"]) and s.num_keys() == 1
    assert s.add("n", 1) == 1
    assert s.compare_set("cs", "", "a") == b"a" and s.compare_set("cs", "x", "b") == b"a"
    assert s.compare_set("cs", "a", "b") == b"b" and s.get("cs") == b"b"


def test_a_wait_is_not_woken_by_other_keys(etcd3: Etcd) -> None:
    """A waiter reads once and watches its key only: 40 adds and sets of other keys under the
    same prefix cost it no read; the set of its key ends the wait (from the event: no read); a
    wait for a counter ends at its first add."""
    writer = _store(etcd3)
    stats = etcd_transport.Stats()
    waiter = V3Store(v3.Client(etcd3.endpoint, stats=stats), writer.prefix, timedelta(seconds=10))
    done: list[bytes] = []
    t = threading.Thread(target=lambda: done.append(waiter.get("torchelastic/exit/last_member")))
    t.start()
    for i in range(20):
        writer.add("torchelastic/exit/num_members", 1)
        writer.set(f"torchelastic/other/{i}", "x")
    writer.set("torchelastic/exit/last_member", "<val_ignored>")
    t.join(10)
    assert done == [b"<val_ignored>"]
    reqs = stats.snapshot()["requests"]
    assert reqs.get("txn", 0) == 1 and reqs.get("watch", 0) <= 1, reqs
    counted: list[None] = []
    t = threading.Thread(target=lambda: counted.append(waiter.wait(["late"])))
    t.start()
    writer.add("late", 1)
    t.join(10)
    assert counted == [None] and waiter.get("late") == b"1"
