"""The etcd v3 client's values and results, as etcd's JSON gateway writes them: keys and values in
base64 (``_b64``, ``_unb64``; :func:`prefix_end`, the range end of a prefix), a :class:`KeyValue`
and an answer's :class:`Header`, what the calls return (:class:`RangeResult`, :class:`PutResult`,
:class:`DeleteResult`, :class:`TxnResult`, :class:`Status`) and a watch's :class:`Event`.

Plain data parsed from etcd's answers, no I/O. Keys are ``str`` (UTF-8), values ``bytes`` or
``str``; etcd's int64s (JSON strings) come back as ``int``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def prefix_end(prefix: str | bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    p = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @property
    def text(self) -> str:
        return self.value.decode()

    @classmethod
    def parse(cls, d: dict[str, Any]) -> KeyValue:
        return cls(
            key=_unb64(d.get("key")).decode(errors="surrogateescape"),
            value=_unb64(d.get("value")),
            create_revision=int(d.get("create_revision", 0)),
            mod_revision=int(d.get("mod_revision", 0)),
            version=int(d.get("version", 0)),
            lease=int(d.get("lease", 0)),
        )


@dataclass(frozen=True)
class Header:
    cluster_id: int
    member_id: int
    revision: int
    raft_term: int

    @classmethod
    def parse(cls, d: dict[str, Any] | None) -> Header:
        d = d or {}
        return cls(*(int(d.get(k, 0)) for k in ("cluster_id", "member_id", "revision", "raft_term")))


@dataclass(frozen=True)
class RangeResult:
    revision: int  #: the store's revision when read: watch from revision + 1 to miss nothing
    kvs: list[KeyValue]
    count: int
    more: bool

    def get(self, key: str) -> KeyValue | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    @classmethod
    def parse(cls, d: dict[str, Any], revision: int) -> RangeResult:
        kvs = [KeyValue.parse(kv) for kv in d.get("kvs", [])]
        return cls(revision, kvs, int(d.get("count", 0)), bool(d.get("more", False)))


@dataclass(frozen=True)
class PutResult:
    revision: int
    prev: KeyValue | None


@dataclass(frozen=True)
class DeleteResult:
    revision: int
    deleted: int
    prev: list[KeyValue]


@dataclass(frozen=True)
class TxnResult:
    revision: int
    succeeded: bool
    responses: list[RangeResult | PutResult | DeleteResult]


@dataclass(frozen=True)
class Event:
    type: str  #: "PUT" or "DELETE"
    kv: KeyValue  #: after the event (a DELETE's: key and mod_revision only)
    prev: KeyValue | None  #: before it (watch with ``prev_kv=True``)


@dataclass(frozen=True)
class Status:
    version: str
    cluster_id: int
    member_id: int
    revision: int
    raft_term: int
    raft_index: int
    raft_applied_index: int
    leader: int
    db_size: int


# ---- a put's and a delete's answer (alone or in a txn's responses)
def _put_result(d: dict[str, Any], rev: int) -> PutResult:
    return PutResult(rev, KeyValue.parse(d["prev_kv"]) if d.get("prev_kv") else None)


def _delete_result(d: dict[str, Any], rev: int) -> DeleteResult:
    return DeleteResult(rev, int(d.get("deleted", 0)), [KeyValue.parse(kv) for kv in d.get("prev_kvs", [])])
