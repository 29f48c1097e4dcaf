"""Bytes per round O(N): the record carries O(1), each participant's rank is its own key
``ranks/<r>/<nonce>/<id>`` written in batches that fit etcd's ``--max-txn-ops`` (128 by default)
before the guarded record txn, and a leader that loses the record race leaves no rank that a
node would read. Against a real etcd started with etcd's defaults (no ``--max-txn-ops`` flag).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable

import pytest
from harness import Etcd
from test_rendezvous import Group

from petctl_agent.rendezvous import etcd_ops
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.config import DEFAULT_PREFIX
from petctl_agent.rendezvous.layout import HEAD, Keys
from petctl_agent.rendezvous.record import MAX_TXN_OPS, publish_round, read_rank

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


@pytest.fixture
def client(etcd3: Etcd) -> v3.Client:
    return v3.Client(etcd3.endpoint)


def test_the_test_etcd_refuses_a_txn_over_128_ops(client: v3.Client) -> None:
    """The premise of the batching: this etcd keeps the default limit, as the rendezvous
    instance's etcd on AWS does (its boot script sets no ``--max-txn-ops``)."""
    base = f"/t/ops-{uuid.uuid4().hex[:6]}/"
    client.txn([], [etcd_ops.put_op(f"{base}{i}", "x") for i in range(MAX_TXN_OPS)])
    with pytest.raises(v3.RequestFailed, match="too many operations"):
        client.txn([], [etcd_ops.put_op(f"{base}b{i}", "x") for i in range(MAX_TXN_OPS + 1)])


def test_a_round_over_128_closes_with_a_distinct_rank_for_every_node(
    group: Callable[..., Group], client: v3.Client
) -> None:
    """150 participants: 2 real handlers (one leads: it registered first) and 148 light ones (a
    member key on one shared lease and a join, written here). The round closes with every node
    holding a distinct rank in 0..149, read from its own rank key; the record stays O(1)."""
    n, light = 150, 148
    g = group(n, n)
    a, b = g.new(), g.new()
    a._start()  # registers first: the leader
    keys = Keys(DEFAULT_PREFIX, g.run_id)
    lid, ttl = client.grant(30)
    lease = v3.Lease(client, lid, ttl).start()
    try:
        ids = [f"light-{i:03d}" for i in range(light)]
        for i in range(0, light, 50):
            chunk = ids[i : i + 50]
            client.txn([], [
                etcd_ops.put_op(keys.node(x), json.dumps({"addr": "127.0.0.2", "pid": 1, "lease": lid, "ttl": ttl}), lease=lid)
                for x in chunk
            ])  # fmt: skip
        regs = {
            kv.key.rsplit("/", 1)[-1]: kv.create_revision for kv in client.range(keys.nodes, prefix=True).kvs
        }
        for i in range(0, light, 50):
            client.txn([], [
                etcd_ops.put_op(keys.join(1, x), json.dumps({"addr": "127.0.0.2", "port": 1, "reg": regs[x]}), lease=lid)
                for x in ids[i : i + 50]
            ])  # fmt: skip
        res = g.rendezvous(a, b, timeout=30)
        assert {r.world_size for r in res.values()} == {n}
        assert res[a].rank == 0  # the first registered of a first round
        kv = client.get(keys.round(1))
        assert kv is not None
        rec = json.loads(kv.text)
        assert rec["n"] == n and len(rec["head"]) == HEAD and "participants" not in rec
        assert len(kv.text) < 600, kv.text  # O(1): no id list
        ranks = {x: read_rank(client, keys, 1, rec, x) for x in ids}
        ranks[a.node_id], ranks[b.node_id] = res[a].rank, res[b].rank
        assert sorted(r for r in ranks.values() if r is not None) == list(range(n)), ranks
        # the full order, for a leader that takes over: one key, in rank order
        order = json.loads(client.get(keys.members(1)).text)
        assert [order.index(x) for x in ids] == [ranks[x] for x in ids]
        assert rec["head"] == order[:HEAD]
    finally:
        lease.revoke()


def test_a_leader_that_loses_the_record_race_leaves_no_rank_a_node_reads(client: v3.Client) -> None:
    """Two leaders close round 1 from the same open marker: the second txn fails; its rank keys
    sit under a nonce no record names, so every node reads the winner's rank, and they go when
    round 3 closes (with the winner's round-1 ranks)."""
    keys = Keys(DEFAULT_PREFIX, f"race-{uuid.uuid4().hex[:6]}")
    parts = [f"n{i}" for i in range(5)]
    client.put(keys.round(1), json.dumps({"state": "open"}))
    marker = client.get(keys.round(1))
    assert marker is not None
    cmp = [etcd_ops.compare(keys.round(1), "mod", "==", marker.mod_revision)]
    won, rec = publish_round(client, keys, 1, parts, {"leader": "A"}, cmp, [])
    lost, rec_b = publish_round(client, keys, 1, parts[::-1], {"leader": "B"}, cmp, [])
    assert won.succeeded and not lost.succeeded
    named = json.loads(client.get(keys.round(1)).text)
    assert named["nonce"] == rec["nonce"] != rec_b["nonce"] and named["leader"] == "A"
    assert [read_rank(client, keys, 1, named, x) for x in parts] == [0, 1, 2, 3, 4]
    assert read_rank(client, keys, 1, named, "not-in-it") is None
    # the loser's keys exist, under its own nonce only
    loser = client.range(keys.ranks(1) + rec_b["nonce"] + "/", prefix=True).kvs
    assert len(loser) == len(parts)
    assert json.loads(client.get(keys.members(1)).text) == parts
    for r in (2, 3):
        cur = client.get(keys.round(r))
        c = [etcd_ops.compare(keys.round(r), "create", "==", 0)] if cur is None else []
        ok, _ = publish_round(client, keys, r, parts, {"leader": "A"}, c, [])
        assert ok.succeeded
    assert client.range(keys.ranks(1), prefix=True).kvs == []
    assert client.get(keys.members(1)) is None
    assert len(client.range(keys.ranks(3), prefix=True).kvs) == len(parts)


def test_the_store_reads_and_writes_129_keys(client: v3.Client) -> None:
    """torch's rank assignment without ``TORCH_ELASTIC_WORKER_IDENTICAL``: rank 0's agent
    ``multi_get``s every agent's key and ``multi_set``s every assignment (one key per node). At
    129 nodes one txn of each went over etcd's 128 operations, torch called ``shutdown()`` and
    the rendezvous closed for every node. Both go in batches now; a read's
    batches are read at one revision, and a missing key in a later batch is seen."""
    from datetime import timedelta

    from petctl_agent.rendezvous.store import V3Store

    store = V3Store(client, f"/t/store-{uuid.uuid4().hex[:6]}", timedelta(seconds=3))
    keys = [f"torchelastic/assigned/{i}" for i in range(MAX_TXN_OPS + 1)]
    values = [f"rank-{i}".encode() for i in range(len(keys))]
    store.multi_set(keys, values)
    assert store.multi_get(keys) == values
    assert store.check(keys) and store.num_keys() == len(keys)
    assert not store.check([*keys, "torchelastic/assigned/missing"])
    got, rev = store._read(keys)
    assert got == values and rev > 0
    # the later batches read at the first's revision: a change after it is not seen by them
    late = keys[-1]
    client.put(store._k(late), b"changed")
    first = etcd_ops.range_op(store._k(keys[0]))
    later = etcd_ops.range_op(store._k(late), revision=rev)
    r = client.txn([], [first, later])
    assert r.responses[1].kvs[0].value == values[-1], "a txn read at a revision got a newer value"
    assert store.multi_get([late]) == [b"changed"]
