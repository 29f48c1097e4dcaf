"""The agent-side store of a round (``RendezvousInfo.store``) over etcd v3 KV, under
``<base>/store/<r>/``: torch's exit barrier and rank assignment use ``set``, ``get``, ``add``,
``wait``, ``check``, ``multi_get``, ``multi_set`` (torch 2.13: ``torch.distributed.elastic.
utils.store`` and ``agent/server/api.py``). No v2 API, no python-etcd.

etcd refuses a txn of more than 128 operations (``--max-txn-ops``): ``multi_get``/``multi_set``
(torch's rank assignment, one key per agent, when ``TORCH_ELASTIC_WORKER_IDENTICAL`` is unset)
go in batches of :data:`~.etcdv3.MAX_TXN_OPS` (129 nodes closed the
rendezvous for every node). The batches of a read are read at one revision."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

from torch.distributed import Store

from petctl_agent.rendezvous import etcdv3 as v3


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class V3Store(Store):
    """A c10d ``Store`` on etcd v3: each key is ``<prefix><key>``; ``add`` is a txn on the key's
    ``mod_revision``; waits watch the prefix from the read's revision (no polling)."""

    def __init__(self, client: v3.Client, prefix: str, timeout: datetime.timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        if timeout is not None:
            self.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self.client.put(self._k(key), _bytes(value))

    def get(self, key: str) -> bytes:
        got = self._wait_get([key], None)
        if got is None:
            raise LookupError(f"key {key} not found in the rendezvous store within {self.timeout}")
        return got[0]

    def add(self, key: str, num: int) -> int:
        k = self._k(key)
        while True:
            kv = self.client.get(k)
            if kv is None:
                new, cmp = num, v3.compare(k, "create", "==", 0)
            else:
                new, cmp = int(kv.value or b"0") + num, v3.compare(k, "mod", "==", kv.mod_revision)
            if self.client.txn([cmp], [v3.put_op(k, str(new))]).succeeded:
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        k, exp, want = self._k(key), _bytes(expected_value), _bytes(desired_value)
        cmp = v3.compare(k, "create", "==", 0) if not exp else v3.compare(k, "value", "==", exp)
        r = self.client.txn([cmp], [v3.put_op(k, want)], [v3.range_op(k)])
        if r.succeeded:
            return want
        got = r.responses[0]
        assert isinstance(got, v3.RangeResult)
        return got.kvs[0].value if got.kvs else exp

    def wait(self, keys: list[str], override_timeout: datetime.timedelta | None = None) -> None:
        if self._wait_get(keys, override_timeout) is None:
            raise LookupError(f"timeout waiting for keys {keys} in the rendezvous store")

    def check(self, keys: list[str]) -> bool:
        return self._read(keys)[0] is not None

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self._wait_get(keys, None)
        if got is None:
            raise LookupError(f"keys {keys} not all found in the rendezvous store within {self.timeout}")
        return got

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Batches of at most MAX_TXN_OPS puts, in order (each batch atomic, not the whole: a
        reader waits until every key it reads is there)."""
        ops = [v3.put_op(self._k(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        for i in range(0, len(ops), v3.MAX_TXN_OPS):
            self.client.txn([], ops[i : i + v3.MAX_TXN_OPS])

    def delete_key(self, key: str) -> bool:
        return self.client.delete(self._k(key)).deleted > 0

    def num_keys(self) -> int:
        return self.client.range(self.prefix, prefix=True, keys_only=True).count

    def _read(self, keys: list[str]) -> tuple[list[bytes] | None, int]:
        """Every key's value at one revision (None if one is missing), and the revision: batches
        of at most MAX_TXN_OPS reads, the later ones at the first one's revision."""
        out: list[bytes] = []
        rev = 0
        for i in range(0, max(1, len(keys)), v3.MAX_TXN_OPS):
            chunk = keys[i : i + v3.MAX_TXN_OPS]
            r = self.client.txn([], [v3.range_op(self._k(k), revision=rev) for k in chunk])
            rev = rev or r.revision
            for resp in r.responses:
                assert isinstance(resp, v3.RangeResult)
                if not resp.kvs:
                    return None, rev
                out.append(resp.kvs[0].value)
        return out, rev

    def _wait_get(self, keys: list[str], timeout: datetime.timedelta | None) -> list[bytes] | None:
        t = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + t
        while True:
            got, rev = self._read(keys)
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            try:
                with self.client.watch(self.prefix, prefix=True, start_revision=rev + 1,
                                       timeout=min(left, self.client.timeout)) as w:  # fmt: skip
                    w.get(max(0.0, deadline - time.monotonic()))  # any change under the prefix
            except (v3.Compacted, v3.Unavailable):
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
