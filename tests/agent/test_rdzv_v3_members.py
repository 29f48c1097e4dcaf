"""A non-leader's read of ``nodes/`` is O(1) in the membership: the oldest few keys
by create revision and the last record's head, never every id (``membership.read_membership``),
and it finds the same leader and successor as a read of every id would.

The random comparisons run twice: against a model of etcd's sorted, limited range (many
memberships, no server), and against the real etcd (fewer, with ties from keys put in one
txn, as etcd really orders them)."""

from __future__ import annotations

import json
import random
import shutil
import uuid
from typing import Any

import pytest
from harness import Etcd

from petctl_agent.rendezvous import etcd_ops, etcd_transport, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.config import DEFAULT_PREFIX
from petctl_agent.rendezvous.layout import HEAD, Keys, key_name
from petctl_agent.rendezvous.leader import presumed_leader, successor
from petctl_agent.rendezvous.membership import OLDEST, MemberView, read_membership


def _full(live: dict[str, int]) -> MemberView:
    """What the read of every id (the protocol before) knew."""
    return MemberView(dict(live), 1 << 40, frozenset(), None, len(live))


class _Model:
    """etcd's range as read_membership uses it, over ``live`` (id -> create revision): sort by
    create revision (ties in any order: etcd's sort is not stable), then limit; ``more`` and
    ``count`` over the whole range; ``min_create``/``max_create`` filters."""

    def __init__(self, keys: Keys, live: dict[str, int], rng: random.Random) -> None:
        self.keys, self.live, self.rng = keys, live, rng
        self.requests: list[dict[str, Any]] = []

    def _kv(self, n: str) -> etcd_types.KeyValue:
        c = self.live[n]
        return etcd_types.KeyValue(self.keys.node(n), b"", c, c, 1, 7)

    def _range(self, body: dict[str, Any]) -> etcd_types.RangeResult:
        self.requests.append(body)
        key = etcd_types._unb64(body["key"]).decode()
        if "range_end" not in body:
            n = key_name(key)
            kvs = [self._kv(n)] if key == self.keys.node(n) and n in self.live else []
            return etcd_types.RangeResult(100, kvs, len(kvs), False)
        lo, hi = int(body.get("min_create_revision", 0)), int(body.get("max_create_revision", 0))
        ids = [n for n in self.live if self.live[n] >= lo and (not hi or self.live[n] <= hi)]
        self.rng.shuffle(ids)
        if body.get("sort_target") == "CREATE":
            assert body["sort_order"] == "ASCEND"
            ids.sort(key=lambda n: self.live[n])  # stable over a shuffle: ties in any order
        limit = int(body.get("limit", 0)) or len(ids)
        return etcd_types.RangeResult(100, [self._kv(n) for n in ids[:limit]], len(ids), len(ids) > limit)

    def txn(self, compares: list[Any], success: list[dict[str, Any]]) -> etcd_types.TxnResult:
        assert not compares
        return etcd_types.TxnResult(100, True, [self._range(op["request_range"]) for op in success])

    def range(self, key: str, prefix: bool = False, **kw: Any) -> etcd_types.RangeResult:
        body = etcd_ops.range_op(key, prefix, keys_only=True, min_create=kw.get("min_create", 0),
                                 max_create=kw.get("max_create", 0))["request_range"]  # fmt: skip
        return self._range(body)


def _membership(rng: random.Random) -> tuple[dict[str, int], list[str]]:
    """Live ids -> create revisions (some tied: put in one txn) and a head of live and gone ids."""
    n = rng.choice([0, 1, 2, 3, 5, 9, 10, 11, 12, 14, 20, 40, 100])
    live: dict[str, int] = {}
    rev = 10
    ids = [f"n{uuid.UUID(int=rng.getrandbits(128)).hex[:6]}" for _ in range(n)]
    i = 0
    while i < n:
        k = 1 if rng.random() < 0.6 else rng.randint(2, 6)
        for x in ids[i : i + k]:
            live[x] = rev
        rev += rng.randint(1, 3)
        i += k
    gone = [f"g{j}" for j in range(rng.randint(0, 4))]
    pool = ids + gone
    base = rng.sample(pool, min(len(pool), rng.randint(0, HEAD)))
    return live, base


def _answers(base: list[str], view: MemberView, live: dict[str, int], rng: random.Random) -> list[Any]:
    """Leader and successor for every ``me`` (registered or not) and every id dropped."""
    out: list[Any] = []
    mes = [*live, "zz-new"]
    for me in rng.sample(mes, min(len(mes), 6)):
        reg = live.get(me)
        if me == "zz-new":
            reg = max(live.values(), default=0) + 5  # registered after the read
        for drop in [None, *rng.sample([*live, *base], min(len(live) + len(base), 4))]:
            out.append(presumed_leader(base, view, me, reg, False, drop))
            if drop is not None:
                out.append(successor(base, view, me, reg, drop))
    return out


def _check(keys: Keys, read: Any, live: dict[str, int], base: list[str], seed: int) -> MemberView:
    view = read_membership(read, keys, base)
    got = _answers(base, view, live, random.Random(seed))
    want = _answers(base, _full(live), live, random.Random(seed))
    assert got == want, f"membership {live} head {base}: bounded {view}"
    return view


def test_the_bounded_read_gives_the_full_reads_leader_and_successor() -> None:
    """3,000 random memberships (0..100 nodes, tied create revisions, heads of live and gone
    ids, every node as ``me``, each id dropped as a lapsed leader or the leader a successor
    replaces): the same answers as from every id; never more than OLDEST + HEAD keys read
    except a tie's second read."""
    keys = Keys(DEFAULT_PREFIX, "model")
    for seed in range(3000):
        rng = random.Random(seed)
        live, base = _membership(rng)
        model = _Model(keys, live, rng)
        view = _check(keys, model, live, base, seed)
        assert len(model.requests) <= 1 + len(base) + 1
        if len(live) > OLDEST and len(set(live.values())) == len(live):  # no ties: O(1) keys
            assert view.below is not None and len(view.live) <= OLDEST - 1 + len(base)
            assert len(model.requests) == 1 + len(base)  # one txn: the oldest and each head id


def test_an_unchecked_head_is_taken_as_alive_until_its_key_says_otherwise() -> None:
    """A record seen after the read (its head not checked): its first node leads, as the
    protocol before assumed for a record newer than the read; a checked one that is gone does
    not."""
    view = MemberView({"a": 5, "b": 6}, 100, frozenset({"x"}), 7, 40)
    assert presumed_leader(["y", "a"], view, "b", 6) == "y"  # y: not checked, alive as far as we know
    assert presumed_leader(["x", "a"], view, "b", 6) == "a"  # x: checked, gone
    assert presumed_leader(["x", "a"], view, "b", 6, newer=True) == "x"  # the record is newer than the read
    assert successor(["x", "a"], view, "b", 6, "x") == "a"


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")
def test_the_bounded_read_on_a_real_etcd(etcd3: Etcd) -> None:
    """40 random memberships put in a real etcd (ties: several keys in one txn), each compared
    with the full keys-only read of ``nodes/``: the JSON gateway's sort_order/sort_target/limit
    and min/max_create_revision do what the model says."""
    c = v3.Client(etcd3.endpoint)
    for seed in range(40):
        rng = random.Random(1000 + seed)
        keys = Keys(DEFAULT_PREFIX, f"m-{uuid.uuid4().hex[:8]}")
        live, base = _membership(rng)
        groups: dict[int, list[str]] = {}
        for n, r in live.items():
            groups.setdefault(r, []).append(n)
        real: dict[str, int] = {}
        for r in sorted(groups):
            t = c.txn([], [etcd_ops.put_op(keys.node(n), "{}") for n in groups[r]])
            real.update(dict.fromkeys(groups[r], t.revision))
        full = c.range(keys.nodes, prefix=True, keys_only=True)
        assert {key_name(kv.key): kv.create_revision for kv in full.kvs} == real
        _check(keys, c, real, base, seed)


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")
def test_a_registrations_read_does_not_grow_with_the_membership(etcd3: Etcd) -> None:
    """60 registered light ids, then 60 more: a registration's read returns the same number of
    keys (OLDEST + the head's) and about the same bytes, a few KB, where the read of every id
    (the protocol before) grows with them. Bytes are the JSON bodies received (etcd_transport.Stats)."""
    keys = Keys(DEFAULT_PREFIX, f"m-{uuid.uuid4().hex[:8]}")
    w = v3.Client(etcd3.endpoint)
    value = json.dumps({"addr": "127.0.0.2", "pid": 1, "lease": 0, "ttl": 6})
    base = [f"light-{i:03d}" for i in (3, 1, 7, 200)]  # 200: gone
    got: list[tuple[int, int, int]] = []
    for start in (0, 60):
        for i in range(start, start + 60):
            w.put(keys.node(f"light-{i:03d}"), value)  # one put each, as a handler registers
        stats = etcd_transport.Stats()
        view = read_membership(v3.Client(etcd3.endpoint, stats=stats), keys, base)
        full_stats = etcd_transport.Stats()
        v3.Client(etcd3.endpoint, stats=full_stats).range(keys.nodes, prefix=True, keys_only=True)
        got.append((len(view.live), stats.bytes_in, full_stats.bytes_in))
        assert stats.requests == {"txn": 1}, stats.requests  # one request, no tie to read whole
        assert view.count == start + 60
        assert set(view.live) >= {"light-001", "light-003", "light-007"} and "light-200" not in view.live
    (k1, b1, f1), (k2, b2, f2) = got
    # the oldest OLDEST - 1 (the last one read marks the bound: light-000, light-001) and the
    # head's live ids (light-003, light-007)
    assert k1 == k2 == OLDEST - 1 + 2, got
    assert b2 <= b1 + 64 and b1 < 4000, got
    assert f2 > 1.8 * f1 and f1 > 2 * b1, got
