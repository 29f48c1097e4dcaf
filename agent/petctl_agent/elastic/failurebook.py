"""Worker failures beside the round, in etcd: what every agent reads to name a round's culprit.

``failures/<round>/<instance-id>``: one :class:`~petctl_agent.elastic.culprit.Failure` per node
whose workers failed in that round. ``culprits/<round>``: the node the round's failure began on and
how many failed rounds in a row began there (written once, create-if-absent: the first node whose
failure grace ends settles it, every other node reads that one). The decisions are
``culprit.py``'s; this module only reads and writes (petctl-etcd only: torch's etcd-v2
handler has no v3 client). The keys are a few hundred bytes per failed round, bounded by the
restart budget; they go with the run's prefix.
"""

from __future__ import annotations

import json
from typing import Any

from petctl_agent.elastic.culprit import Failure, count_for, culprit_record
from petctl_agent.rendezvous import etcd_ops, etcd_types
from petctl_agent.rendezvous.layout import Keys, key_name, loads

#: how many of the newest culprit records are read to find the one before a round
_RECENT = 16
#: seconds per call: a failure's restart must not wait on an etcd that is down (the count is
#: best effort; the restart and its membership check are not)
TIMEOUT = 2.0


class FailureBook:
    """The job's failure records in etcd (one run's keys)."""

    def __init__(self, etcd: Any, keys: Keys, timeout: float = TIMEOUT) -> None:
        self.etcd = etcd
        self.keys = keys
        self.timeout = timeout

    @classmethod
    def of(cls, handler: Any) -> FailureBook | None:
        """The book of a petctl-etcd handler; None for any other."""
        etcd, keys = getattr(handler, "_etcd", None), getattr(handler, "keys", None)
        return cls(etcd, keys) if etcd is not None and isinstance(keys, Keys) else None

    def write(self, round_: int, failure: Failure) -> None:
        self.etcd.put(
            self.keys.failure(round_, failure.node), json.dumps(failure.to_dict()), timeout=self.timeout
        )

    def read(self, round_: int) -> list[Failure]:
        res = self.etcd.range(self.keys.failures(round_), prefix=True, timeout=self.timeout)
        out = [Failure.from_dict(loads(kv.value)) for kv in res.kvs]
        return [f for f in out if f is not None]

    def previous(self, round_: int) -> dict[str, Any] | None:
        """The culprit record of the newest failed round before ``round_``; None if none."""
        res = self.etcd.range(
            self.keys.culprits, prefix=True, sort="-key", limit=_RECENT, timeout=self.timeout
        )
        for kv in res.kvs:
            name = key_name(kv.key)
            if name.isdigit() and int(name) < round_:
                return loads(kv.value)
        return None

    def settle(self, round_: int, first: Failure) -> dict[str, Any]:
        """Store round ``round_``'s culprit (``first``) with its count, unless a node did already:
        the stored record either way."""
        rec = culprit_record(first, count_for(first, self.previous(round_)), round_)
        key = self.keys.culprit(round_)
        res = self.etcd.txn(
            [etcd_ops.compare(key, "create", "==", 0)],
            [etcd_ops.put_op(key, json.dumps(rec))],
            [etcd_ops.range_op(key)],
            timeout=self.timeout,
        )
        if res.succeeded:
            return rec
        got = res.responses[0] if res.responses else None
        kv = got.get(key) if isinstance(got, etcd_types.RangeResult) else None
        return loads(kv.value) if kv is not None else rec

    def culprit(self, round_: int) -> dict[str, Any] | None:
        kv = self.etcd.get(self.keys.culprit(round_), timeout=self.timeout)
        return loads(kv.value) if kv is not None else None
