"""The agent-side store of a round (``RendezvousInfo.store``) over etcd v3 KV, under
``<base>/store/<r>/``: torch's exit barrier and rank assignment use ``set``, ``get``, ``add``,
``wait``, ``check``, ``multi_get``, ``multi_set`` (torch 2.13: ``torch.distributed.elastic.
utils.store`` and ``agent/server/api.py``). No v2 API, no python-etcd.

etcd refuses a txn of more than 128 operations (``--max-txn-ops``): ``multi_get``/``multi_set``
(torch's rank assignment, one key per agent, when ``TORCH_ELASTIC_WORKER_IDENTICAL`` is unset)
go in batches of :data:`~.etcd_ops.MAX_TXN_OPS` (129 nodes closed the
rendezvous for every node). The batches of a read are read at one revision.

**O(N) exit barrier.** torch's barrier is ``add(counter, 1)`` by each of N agents, then a
``wait`` for the key the N-th one sets. A counter kept in one key needs a read-modify-write:
a compare-and-swap on its revision, retried on every conflict, and N agents at once made about
N²/4 txns (300 or so at 32 nodes, 1,000 at 64), and each waiter, woken by every change under the
store's prefix, read again (as many reads). Now each ``add`` writes its own key
(``<key>\\x00`` and a unique suffix, its amount as the value) and reads, in the same txn, the
key's value and its earlier adds: one txn, nothing to retry, and the txn's single revision
orders the adds, so exactly one sees N. A key's value is its ``set`` value (0 if none) plus
every add since: a ``set`` deletes the adds in its txn. A wait reads once, then watches only
the keys it waits for and applies their events (no read per event): 2 requests per waiter.
bench/bench_exit_barrier.py counts them; tests/agent/test_rdzv_store_barrier.py holds the
barrier to at most 3 requests per node.

Keys hold no NUL (``\\x00``): it separates a key from its adds. ``compare_set`` compares the
value ``set`` last, not a count of ``add`` (torch never mixes the two on one key)."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Sequence

from torch.distributed import Store

from petctl_agent.rendezvous import etcd_ops, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3

#: after a key: its adds of 1 (counted, ``count_only``) and its other adds (summed)
_ADDS, _ONES, _MANY = "\x00", "\x001", "\x00n"
#: the end of a key's span: the key itself and its adds, nothing else
_SPAN_END = "\x01"


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _value(key: str, kvs: Sequence[etcd_types.KeyValue]) -> bytes | None:
    """``key``'s value from the keys of its span: its set value, or that plus its adds."""
    plain, adds, total = None, False, 0
    for kv in kvs:
        if kv.key == key:
            plain = kv.value
        else:
            adds, total = True, total + int(kv.value)
    if not adds:
        return plain
    return str(int(plain or b"0") + total).encode()


class V3Store(Store):
    """A c10d ``Store`` on etcd v3: each key is ``<prefix><key>``, each ``add`` one more key
    beside it (the module says why); waits watch the keys waited for from the read's revision
    (no polling)."""

    def __init__(self, client: v3.Client, prefix: str, timeout: datetime.timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _set_ops(self, key: str, value: str | bytes) -> list[dict]:
        k = self._k(key)
        return [etcd_ops.put_op(k, _bytes(value)), etcd_ops.delete_op(k + _ADDS, prefix=True)]

    def set(self, key: str, value: str | bytes) -> None:
        self.client.txn([], self._set_ops(key, value))

    def get(self, key: str) -> bytes:
        got = self._wait_get([key], None)
        if got is None:
            raise LookupError(f"key {key} not found in the rendezvous store within {self.timeout}")
        return got[0]

    def add(self, key: str, num: int) -> int:
        """One txn: our add's own key, and the value before it (set value, count of adds of 1,
        other adds), all at the txn's revision. No compare, so no retry however many add at once."""
        k = self._k(key)
        reads = [etcd_ops.range_op(k), etcd_ops.range_op(k + _ONES, prefix=True, count_only=True),
                 etcd_ops.range_op(k + _MANY, prefix=True)]  # fmt: skip
        mine = (
            [etcd_ops.put_op(f"{k}{_ONES if num == 1 else _MANY}{uuid.uuid4().hex}", str(num))] if num else []
        )
        plain, ones, many = self.client.txn([], reads + mine).responses[:3]
        assert isinstance(plain, etcd_types.RangeResult) and isinstance(ones, etcd_types.RangeResult)
        assert isinstance(many, etcd_types.RangeResult)
        base = int(plain.kvs[0].value) if plain.kvs else 0
        return base + ones.count + sum(int(kv.value) for kv in many.kvs) + num

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        k, exp, want = self._k(key), _bytes(expected_value), _bytes(desired_value)
        cmp = etcd_ops.compare(k, "create", "==", 0) if not exp else etcd_ops.compare(k, "value", "==", exp)
        r = self.client.txn([cmp], self._set_ops(key, want), [etcd_ops.range_op(k, end=k + _SPAN_END)])
        if r.succeeded:
            return want
        got = r.responses[0]
        assert isinstance(got, etcd_types.RangeResult)
        now = _value(k, got.kvs)
        return exp if now is None else now

    def wait(self, keys: list[str], override_timeout: datetime.timedelta | None = None) -> None:
        if self._wait_get(keys, override_timeout) is None:
            raise LookupError(f"timeout waiting for keys {keys} in the rendezvous store")

    def check(self, keys: list[str]) -> bool:
        names = [self._k(k) for k in keys]
        return all(n in self._values(names)[0] for n in names)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self._wait_get(keys, None)
        if got is None:
            raise LookupError(f"keys {keys} not all found in the rendezvous store within {self.timeout}")
        return got

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Batches of at most MAX_TXN_OPS ops, in order (each batch atomic, not the whole: a
        reader waits until every key it reads is there)."""
        ops = [op for k, v in zip(keys, values, strict=True) for op in self._set_ops(k, v)]
        # a key's put and the delete of its adds together
        step = etcd_ops.MAX_TXN_OPS - etcd_ops.MAX_TXN_OPS % 2
        for i in range(0, len(ops), step):
            self.client.txn([], ops[i : i + step])

    def delete_key(self, key: str) -> bool:
        k = self._k(key)
        return self.client.delete(k, end=k + _SPAN_END).deleted > 0

    def num_keys(self) -> int:
        kvs = self.client.range(self.prefix, prefix=True, keys_only=True).kvs
        return len({kv.key.split(_ADDS, 1)[0] for kv in kvs})

    def _values(self, names: list[str]) -> tuple[dict[str, bytes], int]:
        """The value of each of ``names`` (full keys) that has one, at one revision, and that
        revision: batches of at most MAX_TXN_OPS reads (each a key's span: the key and its
        adds), the later ones at the first one's revision."""
        out: dict[str, bytes] = {}
        rev = 0
        for i in range(0, max(1, len(names)), etcd_ops.MAX_TXN_OPS):
            chunk = names[i : i + etcd_ops.MAX_TXN_OPS]
            r = self.client.txn([], [etcd_ops.range_op(n, end=n + _SPAN_END, revision=rev) for n in chunk])
            rev = rev or r.revision
            for n, resp in zip(chunk, r.responses, strict=True):
                assert isinstance(resp, etcd_types.RangeResult)
                got = _value(n, resp.kvs)
                if got is not None:
                    out[n] = got
        return out, rev

    def _read(self, keys: list[str]) -> tuple[list[bytes] | None, int]:
        """Every key's value at one revision (None if one is missing), and the revision."""
        names = [self._k(k) for k in keys]
        have, rev = self._values(names)
        return ([have[n] for n in names] if all(n in have for n in names) else None), rev

    def _wait_get(self, keys: list[str], timeout: datetime.timedelta | None) -> list[bytes] | None:
        """Every key's value once all are there, or None at the deadline. One read, then one
        watch of the span from the first key to the last, from the read's revision: the events
        of the keys waited for fill in their values (a set's event carries its value); only a
        delete or an add of one of them reads again. Other keys' events cost nothing."""
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        names = [self._k(k) for k in keys]
        wanted = set(names)
        have, rev = self._values(names)
        while not wanted <= have.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                with self.client.watch(min(names), end=max(names) + _SPAN_END, start_revision=rev + 1,
                                       timeout=min(left, self.client.timeout)) as w:  # fmt: skip
                    while not wanted <= have.keys():
                        evs = w.get(max(0.0, deadline - time.monotonic()))
                        if evs is None:
                            break  # the deadline
                        if not _apply(evs, wanted, have, rev):
                            have, rev = self._values(names)  # the watch goes on: its older events are skipped
            except (v3.Compacted, v3.Unavailable):
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                have, rev = self._values(names)
        return [have[n] for n in names]


def _apply(evs: list[etcd_types.Event], wanted: set[str], have: dict[str, bytes], rev: int) -> bool:
    """Apply the events after ``rev`` of the keys in ``wanted`` to ``have``; False if a value
    can only be read again (a key deleted, or an add to it)."""
    for e in evs:
        k = e.kv.key
        if e.kv.mod_revision <= rev or k.split(_ADDS, 1)[0] not in wanted:
            continue
        if k not in wanted or e.type != "PUT":
            return False
        have[k] = e.kv.value  # a set: its txn deleted the key's adds
    return True
