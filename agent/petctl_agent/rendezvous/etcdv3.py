"""A thin etcd v3 client over etcd's JSON gateway (``/v3/...``), standard library only.

The client layer petctl-etcd's v3 handler stands on. Why this and not a library
(docs/rendezvous.md, "The etcd v3 client"): every dependency of the agent ships to every
instance; ``etcd3gw`` pulls ``requests``, ``futurist`` and ``pbr``, ignores a watch's
compaction and keeps no lease alive; ``aetcd`` is asyncio over ``grpcio`` + ``protobuf``
(tens of MB of wheels per node). What the handler needs is ten JSON calls, a streaming watch
and a keepalive loop: this module, on ``http.client`` and ``ssl``.

* **Calls**: :meth:`Client.range` (one key or a prefix, at a revision), :meth:`Client.put`
  (with a lease), :meth:`Client.delete`, :meth:`Client.txn` (compare mod/create revision,
  version, value or lease; success and failure ops), leases (:meth:`Client.grant`,
  :meth:`Client.keepalive_once`, :meth:`Client.revoke`, :meth:`Client.time_to_live`),
  :meth:`Client.status`, :meth:`Client.compact`. Each has a timeout (the socket's, per
  call); nothing waits unbounded. Each answer's header carries the store revision.
* **Errors** (:mod:`.errors`, re-exported here): one family, :class:`EtcdError`:
  :class:`Unavailable` (no answer: refused, reset, timed out: retry, then re-read),
  :class:`Timeout` (a subclass), :class:`RequestFailed` (etcd answered with an error),
  :class:`LeaseNotFound`, :class:`Compacted` (a revision etcd no longer keeps: re-read once,
  then watch from the read's revision), :class:`ClusterChanged` (another etcd, a fresh data
  dir, now answers this address: drop every view read before).
* **Leases**: :class:`Lease` (:mod:`.lease`, re-exported here) keeps one alive from a
  background thread (``keepalive`` every ``ttl/3``); a new etcd that its keepalive meets goes
  to its ``on_error``, not swallowed. A keepalive is no raft write and does not move the store
  revision (tested); the lease runs on etcd's monotonic clock, and the lease's local deadline
  on ``time.monotonic`` (no wall clock anywhere).
* **Watches**: :meth:`Client.watch` from a revision, a key or a prefix; a reader thread parses
  the gateway's stream, :meth:`Watch.get` hands out each answer's events in order with a
  timeout. A start revision below the compacted one ends the watch with :class:`Compacted`.
* **Versions**: etcd 3.4, 3.5 and 3.6 serve the gateway at ``/v3/`` (3.3 only at
  ``/v3beta/``, 3.2 at ``/v3alpha/``); :func:`connect` refuses an etcd older than 3.4.
* **TLS**: ``https`` with a CA bundle and a client certificate and key, the files the agent
  gets today (``PETCTL_ETCD_CACERT``/``CERT``/``KEY``); the server's certificate is checked
  against the CA and the address, as python-etcd does.

Keys are ``str`` (UTF-8), values ``bytes`` or ``str``; etcd's int64s (JSON strings) come back
as ``int``.
"""

from __future__ import annotations

import base64
import http.client
import json
import queue
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from petctl_agent.rendezvous.errors import (
    ClusterChanged,
    Compacted,
    EtcdError,
    LeaseNotFound,
    NoSpace,
    RequestFailed,
    Silent,
    Timeout,
    Unavailable,
)
from petctl_agent.rendezvous.lease import Lease
from petctl_agent.settings import EtcdTls

API = "/v3"
#: the oldest etcd whose gateway serves ``/v3/`` (3.3: ``/v3beta/`` only)
MIN_VERSION = (3, 4)

#: etcd's default ``--max-txn-ops``: the most operations one txn may carry (etcd-io/etcd#7976);
#: more is refused ("too many operations in txn request"), so callers batch
MAX_TXN_OPS = 128

# ---- connections that die silently (docs/rendezvous.md, "Connections that die silently")
#: how often the etcd petctl runs sends a progress notification on a quiet watch
#: (``--experimental-watch-progress-notify-interval``, petctl/templates/etcd.py). etcd adds up
#: to 10 % jitter, and a watch that had events in one interval gets none at its end: the
#: longest gap between two messages of a live watch is about 2 x 1.1 intervals (22 s).
PROGRESS_NOTIFY_INTERVAL = 10.0
#: a watch that received nothing (no event, no progress notification) for this long is taken
#: as dead (a NAT or connection-tracking entry dropped, no FIN, no RST): 3 intervals
WATCH_SILENCE = 3 * PROGRESS_NOTIFY_INTERVAL
#: TCP keepalive on every etcd socket: the first probe after this many idle seconds, then every
#: KEEPALIVE_INTERVAL, the connection reset after KEEPALIVE_COUNT unanswered. A probe every 30 s
#: keeps a connection-tracking entry (EC2 drops them after 350 s idle on Nitro v6) alive, and a
#: peer that vanished is noticed within 30 + 3 x 10 = 60 s even without any read timeout.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 30, 10, 3
#: a keep-alive connection unused for this long is not reused: a fresh one costs a handshake,
#: a silently dead one a whole request timeout
MAX_IDLE_REUSE = 60.0


def keepalive(sock: socket.socket) -> socket.socket:
    """Turn on TCP keepalive (SO_KEEPALIVE, and the KEEPALIVE_* timings where the platform has
    them) on ``sock``; returns it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPALIVE", KEEPALIVE_IDLE),  # macOS's name for the idle time
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass
    return sock


def _create_connection(
    address: tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT, source_address: Any = None
) -> socket.socket:
    """``socket.create_connection`` with TCP keepalive (http.client's connection factory)."""
    return keepalive(socket.create_connection(address, timeout, source_address))


# ---- values -------------------------------------------------------------------------------------
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


# ---- requests: compares and ops ---------------------------------------------------------------------
_TARGETS = {"mod": "MOD", "create": "CREATE", "version": "VERSION", "value": "VALUE", "lease": "LEASE"}
_FIELDS = {"MOD": "mod_revision", "CREATE": "create_revision", "VERSION": "version", "VALUE": "value"}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def compare(key: str, target: str, op: str, value: int | str | bytes) -> dict[str, Any]:
    """A txn comparison: ``compare(k, "mod", "==", 7)``; target ``mod``/``create``/``version``/
    ``value``/``lease``; op ``==``/``!=``/``<``/``>``. ``compare(k, "create", "==", 0)``: absent."""
    if target not in _TARGETS or op not in _RESULTS:
        raise ValueError(f"compare({key!r}, {target!r}, {op!r}): target must be one of "
                         f"{sorted(_TARGETS)} and op one of {sorted(_RESULTS)}")  # fmt: skip
    t = _TARGETS[target]
    c: dict[str, Any] = {"key": _b64(key), "target": t, "result": _RESULTS[op]}
    if t == "VALUE":
        if not isinstance(value, (str, bytes)):
            raise ValueError(f"compare({key!r}, 'value', ...): the value must be str or bytes")
        c["value"] = _b64(value)
    elif isinstance(value, int):
        c[_FIELDS.get(t, "lease")] = str(value)
    else:
        raise ValueError(f"compare({key!r}, {target!r}, ...): the value must be an int")
    return c


def put_op(key: str, value: str | bytes, lease: int = 0, prev_kv: bool = False) -> dict[str, Any]:
    return {"request_put": _put_body(key, value, lease, prev_kv)}


def delete_op(
    key: str, prefix: bool = False, prev_kv: bool = False, end: str | None = None
) -> dict[str, Any]:
    return {"request_delete_range": _range_body(key, prefix, end, prev_kv=prev_kv)}


def range_op(
    key: str,
    prefix: bool = False,
    limit: int = 0,
    keys_only: bool = False,
    sort: str | None = None,
    min_create: int = 0,
    max_create: int = 0,
    revision: int = 0,
    count_only: bool = False,
    end: str | None = None,
) -> dict[str, Any]:
    """A txn's read; the options as :meth:`Client.range`'s (``revision``: at that revision, 0:
    the txn's; ``count_only``: the count, no keys; ``end``: every key from ``key`` up to, not
    including, ``end``)."""
    return {
        "request_range": _range_body(
            key,
            prefix,
            end,
            revision=str(revision) if revision else None,
            count_only=count_only,
            **_range_opts(limit, keys_only, sort, min_create, max_create),
        )
    }


#: ``sort`` of a range: "<target>" ascending or "-<target>" descending; the RangeRequest enums
#: by name, as etcd's JSON gateway reads them (``sort_target``: KEY, VERSION, CREATE, MOD, VALUE)
_SORT_TARGETS = {"key": "KEY", "version": "VERSION", "create": "CREATE", "mod": "MOD", "value": "VALUE"}


def _range_opts(
    limit: int, keys_only: bool, sort: str | None, min_create: int, max_create: int
) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "limit": str(limit) if limit else None,
        "keys_only": keys_only,
        "min_create_revision": str(min_create) if min_create else None,
        "max_create_revision": str(max_create) if max_create else None,
    }
    if sort:
        target = _SORT_TARGETS.get(sort.lstrip("-"))
        if target is None:
            raise ValueError(
                f"sort={sort!r}: must be one of {sorted(_SORT_TARGETS)}, '-' first for descending"
            )
        opts["sort_order"] = "DESCEND" if sort.startswith("-") else "ASCEND"
        opts["sort_target"] = target
    return opts


def _put_body(key: str, value: str | bytes, lease: int, prev_kv: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    if prev_kv:
        body["prev_kv"] = True
    return body


def _range_body(key: str, prefix: bool, end: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key)}
    if prefix or end is not None:
        body["range_end"] = _b64(prefix_end(key) if end is None else end)
    body.update({k: v for k, v in extra.items() if v})
    return body


#: how a keep-alive connection that etcd closed fails; calls that only read (safe to repeat)
_STALE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)
_READS = frozenset({"range", "status", "keepalive", "timetolive", "version", "alarm"})


# ---- the client -------------------------------------------------------------------------------------
class Stats:
    """Requests by kind and the bytes of their JSON bodies (sent, received; HTTP heads not
    counted); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.bytes_out = 0
        self.bytes_in = 0

    def add(self, kind: str, out: int, inn: int) -> None:
        with self._lock:
            self.requests[kind] += 1
            self.bytes_out += out
            self.bytes_in += inn

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.requests), "bytes_out": self.bytes_out, "bytes_in": self.bytes_in}


def _split_endpoint(endpoint: str, protocol: str) -> tuple[str, str, int]:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = protocol, endpoint
    host, _, port = rest.rstrip("/").rpartition(":")
    if scheme not in ("http", "https") or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r}: give host:port or http(s)://host:port")
    return scheme, host.strip("[]"), int(port)


class Client:
    """One etcd endpoint. Thread-safe: each thread keeps its own keep-alive connection.

    ``timeout`` bounds every call (connect, send, each read); a call may pass its own.
    ``cacert``/``cert``/``key``: PEM paths (``cert`` alone may hold the key too); with them
    the protocol is https.
    """

    def __init__(
        self,
        endpoint: str,
        protocol: str = "http",
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        timeout: float = 5.0,
        stats: Stats | None = None,
        watch_silence: float = WATCH_SILENCE,
    ) -> None:
        self.scheme, self.host, self.port = _split_endpoint(endpoint, protocol)
        if (cacert or cert or key) and self.scheme != "https":
            raise ValueError(f"etcd endpoint {endpoint!r}: certificates need https")
        if key and not cert:
            raise ValueError("etcd TLS: a key without a certificate")
        self.timeout = timeout
        #: a watch silent this long is dead (:class:`Silent`); 0: never (an etcd that sends
        #: no progress notifications: a quiet watch would be re-made every ``watch_silence``)
        self.watch_silence = watch_silence
        self.stats = stats or Stats()
        self._ssl: ssl.SSLContext | None = None
        if self.scheme == "https":
            ctx = ssl.create_default_context(cafile=cacert)
            if cert:
                ctx.load_cert_chain(cert, key)
            self._ssl = ctx
        self._local = threading.local()
        self._cluster_lock = threading.Lock()
        self.cluster_id: int | None = None  #: the cluster of the first answer (see ClusterChanged)
        self.max_revision = 0  #: the highest store revision answered (see ClusterChanged)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    # -- transport --
    def _new_conn(self, timeout: float) -> http.client.HTTPConnection:
        """A connection whose socket will have TCP keepalive (:func:`keepalive`)."""
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn._create_connection = _create_connection  # type: ignore[attr-defined]
        return conn

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, kind: str, timeout: float | None
    ) -> dict[str, Any]:
        """One request on this thread's keep-alive connection; its JSON answer.

        A connection etcd closed while idle (etcd restarted, a proxy's idle timeout) fails
        the next request at once: then, and only then, it is sent again on a new connection,
        if the old one failed while sending (etcd cannot have applied it) or the call only
        reads. A write whose answer was lost is never repeated: Unavailable says it may have
        been applied.
        """
        t = self.timeout if timeout is None else timeout
        data = json.dumps(body).encode() if body is not None else b""
        floor = None if body and body.get("serializable") else self.max_revision
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            now = time.monotonic()
            if conn is not None and now - getattr(self._local, "used", now) > MAX_IDLE_REUSE:
                self._drop()  # long idle: maybe forgotten on the way (see MAX_IDLE_REUSE)
                conn = None
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = self._new_conn(t)
            self._local.used = now
            sent = False
            try:
                conn.timeout = t
                if conn.sock is not None:
                    conn.sock.settimeout(t)
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                sent = True
                resp = conn.getresponse()
                raw = resp.read()
                status = resp.status
            except TimeoutError as e:
                self._drop()
                raise Timeout(f"etcd {self.url}: no answer to {kind} within {t:g}s") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                stale = isinstance(e, _STALE) and (not sent or kind in _READS)
                if reused and stale and attempt == 1:
                    continue
                raise Unavailable(f"etcd {self.url}: {kind} failed: {e or type(e).__name__}") from e
            self.stats.add(kind, len(data), len(raw))
            return self._answer(raw, status, kind, floor)
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _answer(self, raw: bytes, status: int, kind: str, floor: int | None = None) -> dict[str, Any]:
        try:
            d = json.loads(raw) if raw else {}
        except ValueError:
            raise RequestFailed(f"etcd {self.url}: {kind}: HTTP {status}, not JSON", status=status) from None
        if status != 200 or "error" in d and "header" not in d:
            raise _error(d, status, f"etcd {self.url}: {kind}")
        self._check_cluster(d.get("header") or (d.get("result") or {}).get("header"), floor)
        return d

    def _check_cluster(self, header: dict[str, Any] | None, floor: int | None = None) -> None:
        """Raise ClusterChanged if ``header`` is another cluster's, or (``floor``: the highest
        revision answered before this request was sent) from a store that went back."""
        if not header or "cluster_id" not in header:
            return
        cid, rev = int(header["cluster_id"]), int(header.get("revision", 0))
        with self._cluster_lock:
            old, self.cluster_id = self.cluster_id, cid
            old_rev = self.max_revision
            back = floor is not None and rev < floor
            self.max_revision = rev if back or old != cid else max(old_rev, rev)
        if old is not None and old != cid:
            raise ClusterChanged(
                f"etcd {self.url}: another cluster ({old:x} -> {cid:x}): state read before is gone", old, cid
            )
        if back:
            raise ClusterChanged(
                f"etcd {self.url}: store revision went back ({floor} -> {rev}): a new etcd, state read before is gone",
                cid,
                cid,
            )

    def call(
        self, path: str, body: dict[str, Any], kind: str, timeout: float | None = None
    ) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``; the answer (for what the methods below leave out)."""
        return self._request("POST", f"{API}/{path}", body, kind, timeout)

    def alarms(self, timeout: float | None = None) -> list[str]:
        """The alarms raised on the cluster (``NOSPACE``, ``CORRUPT``); [] when none."""
        d = self.call("maintenance/alarm", {"action": "GET"}, "alarm", timeout)
        return [str(a.get("alarm", "")) for a in d.get("alarms") or []]

    def version(self, timeout: float | None = None) -> str:
        """etcd's server version (``GET /version``)."""
        d = self._request("GET", "/version", None, "version", timeout)
        return str(d.get("etcdserver", ""))

    def metrics(self, timeout: float | None = None) -> dict[str, float]:
        """etcd's Prometheus counters (``GET /metrics``), unlabelled series only."""
        t = self.timeout if timeout is None else timeout
        conn = self._new_conn(t)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"etcd {self.url}: metrics: {e or type(e).__name__}") from e
        finally:
            conn.close()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    # -- kv --
    def range(
        self,
        key: str,
        prefix: bool = False,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        serializable: bool = False,
        timeout: float | None = None,
        sort: str | None = None,
        min_create: int = 0,
        max_create: int = 0,
    ) -> RangeResult:
        """One key, or every key under ``prefix``, at ``revision`` (0: now; a compacted one
        raises :class:`Compacted`). Linearizable unless ``serializable``. ``sort``: by
        ``"create"`` revision (or key, version, mod, value) ascending, ``"-create"`` descending,
        applied before ``limit`` (etcd sorts the whole range, then cuts: the bytes returned
        are bounded by ``limit``, not etcd's work). ``min_create``/``max_create``: only keys
        created at or after / at or before that revision. ``count`` is the whole range's."""
        body = _range_body(key, prefix, revision=str(revision) if revision else None,
                           serializable=serializable,
                           **_range_opts(limit, keys_only, sort, min_create, max_create))  # fmt: skip
        d = self.call("kv/range", body, "range", timeout)
        return RangeResult.parse(d, Header.parse(d.get("header")).revision)

    def get(self, key: str, timeout: float | None = None) -> KeyValue | None:
        return self.range(key, timeout=timeout).get(key)

    def put(
        self,
        key: str,
        value: str | bytes,
        lease: int = 0,
        prev_kv: bool = False,
        timeout: float | None = None,
    ) -> PutResult:
        """Write ``key`` (attached to ``lease``: deleted when it ends); an unknown or expired lease
        raises :class:`LeaseNotFound`."""
        d = self.call("kv/put", _put_body(key, value, lease, prev_kv), "put", timeout)
        return _put_result(d, Header.parse(d.get("header")).revision)

    def delete(
        self,
        key: str,
        prefix: bool = False,
        prev_kv: bool = False,
        timeout: float | None = None,
        end: str | None = None,
    ) -> DeleteResult:
        """Delete ``key``, every key under it (``prefix``), or every key from it up to ``end``."""
        d = self.call("kv/deleterange", _range_body(key, prefix, end, prev_kv=prev_kv), "delete", timeout)
        return _delete_result(d, Header.parse(d.get("header")).revision)

    def txn(
        self,
        compares: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]] = (),
        failure: Sequence[dict[str, Any]] = (),
        timeout: float | None = None,
    ) -> TxnResult:
        """If every comparison holds, apply ``success``, else ``failure`` (atomically, one
        revision). Build them with :func:`compare`, :func:`put_op`, :func:`delete_op`,
        :func:`range_op`."""
        body = {"compare": list(compares), "success": list(success), "failure": list(failure)}
        d = self.call("kv/txn", body, "txn", timeout)
        rev = Header.parse(d.get("header")).revision
        out: list[RangeResult | PutResult | DeleteResult] = []
        for r in d.get("responses", []):
            if "response_range" in r:
                out.append(RangeResult.parse(r["response_range"], rev))
            elif "response_put" in r:
                out.append(_put_result(r["response_put"], rev))
            elif "response_delete_range" in r:
                out.append(_delete_result(r["response_delete_range"], rev))
        return TxnResult(rev, bool(d.get("succeeded", False)), out)

    def compact(self, revision: int, physical: bool = True, timeout: float | None = None) -> None:
        """Forget every revision below ``revision`` (``physical``: wait until it is done)."""
        self.call("kv/compaction", {"revision": str(revision), "physical": physical}, "compact", timeout)

    # -- leases --
    def grant(self, ttl: int, timeout: float | None = None) -> tuple[int, int]:
        """A new lease: ``(id, ttl)``. etcd may raise the TTL to its minimum (1.5 election
        timeouts, 2 s with the default 1 s election timeout)."""
        d = self.call("lease/grant", {"TTL": str(int(ttl))}, "grant", timeout)
        if d.get("error"):
            raise RequestFailed(f"etcd {self.url}: grant: {d['error']}")
        return int(d["ID"]), int(d["TTL"])

    def keepalive_once(self, lease: int, timeout: float | None = None) -> int:
        """Renew ``lease`` (not a raft write); its TTL. :class:`LeaseNotFound` if it has ended."""
        d = self.call("lease/keepalive", {"ID": str(lease)}, "keepalive", timeout)
        ttl = int((d.get("result") or {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseNotFound(f"etcd {self.url}: lease {lease:x} has expired or was revoked", code=5)
        return ttl

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        """End ``lease`` now, deleting its keys; :class:`LeaseNotFound` if it already ended."""
        self.call("lease/revoke", {"ID": str(lease)}, "revoke", timeout)

    def time_to_live(
        self, lease: int, keys: bool = False, timeout: float | None = None
    ) -> tuple[int, list[str]]:
        """``(seconds left, keys attached)``; seconds left is -1 once the lease has ended.

        The gateway's JSON leaves zero fields out: a live lease with under 1 s left (and an
        expired one not yet revoked, up to ~1.5 s) has no ``TTL``, only ``grantedTTL``; an ended
        one answers ``TTL: -1`` and no ``grantedTTL``. Reading a missing TTL as -1 made the last
        second of a lease read as ended (no lapse: ``decide.lapsed``)."""
        d = self.call("lease/timetolive", {"ID": str(lease), "keys": keys}, "timetolive", timeout)
        ttl = d.get("TTL", 0 if "grantedTTL" in d else -1)
        return int(ttl), [_unb64(k).decode() for k in d.get("keys", [])]

    def lease(self, ttl: int, on_lost: Callable[[Lease], None] | None = None, start: bool = True) -> Lease:
        """Grant a lease and (``start``) keep it alive from a background thread."""
        lid, granted = self.grant(ttl)
        le = Lease(self, lid, granted, on_lost)
        if start:
            le.start()
        return le

    # -- cluster --
    def status(self, timeout: float | None = None) -> Status:
        """This member's view: cluster and member id, store revision, raft term and index."""
        d = self.call("maintenance/status", {}, "status", timeout)
        h = Header.parse(d.get("header"))
        return Status(
            version=str(d.get("version", "")),
            cluster_id=h.cluster_id,
            member_id=h.member_id,
            revision=h.revision,
            raft_term=int(d.get("raftTerm", h.raft_term)),
            raft_index=int(d.get("raftIndex", 0)),
            raft_applied_index=int(d.get("raftAppliedIndex", 0)),
            leader=int(d.get("leader", 0)),
            db_size=int(d.get("dbSize", 0)),
        )

    # -- watches --
    def watch(
        self,
        key: str,
        prefix: bool = False,
        start_revision: int = 0,
        prev_kv: bool = False,
        timeout: float | None = None,
        silence: float | None = None,
        end: str | None = None,
    ) -> Watch:
        """Watch ``key`` (or every key under it; or, with ``end``, every key from ``key`` up to,
        not including, ``end``) from ``start_revision`` (0: from now on).
        Returns once etcd confirmed the watch (within ``timeout``); see :class:`Watch`.

        The watch asks for progress notifications (``progress_notify``), and ends with
        :class:`Silent` once nothing came for ``silence`` s (default: the client's
        ``watch_silence``; 0: never)."""
        body = _range_body(key, prefix, end, start_revision=str(start_revision) if start_revision else None,
                           prev_kv=prev_kv, progress_notify=True)  # fmt: skip
        silence = self.watch_silence if silence is None else silence
        return Watch(self, {"create_request": body}, self.timeout if timeout is None else timeout, silence)

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._drop()


def _error(d: dict[str, Any], status: int, where: str) -> EtcdError:
    msg = str(d.get("message") or d.get("error") or f"HTTP {status}")
    code = int(d.get("code", 0) or 0)
    if "required revision has been compacted" in msg:
        return Compacted(f"{where}: {msg}")
    if "lease not found" in msg:
        return LeaseNotFound(f"{where}: {msg}", code, status)
    if "database space exceeded" in msg:
        return NoSpace(f"{where}: {msg}", code, status)
    return RequestFailed(f"{where}: {msg}", code, status)


def _put_result(d: dict[str, Any], rev: int) -> PutResult:
    return PutResult(rev, KeyValue.parse(d["prev_kv"]) if d.get("prev_kv") else None)


def _delete_result(d: dict[str, Any], rev: int) -> DeleteResult:
    return DeleteResult(rev, int(d.get("deleted", 0)), [KeyValue.parse(kv) for kv in d.get("prev_kvs", [])])


# ---- watches ------------------------------------------------------------------------------------
_END = object()


@dataclass
class _WatchState:
    error: EtcdError | None = None
    watch_id: int = -1
    events: queue.Queue = field(default_factory=queue.Queue)


class Watch:
    """A streaming watch: a daemon thread reads etcd's answers, :meth:`get` hands them out.

    Each answer's events come in revision order, none skipped from the start revision on. A
    compacted start revision, a cancel by etcd, or a broken stream end the watch: :meth:`get`
    then raises (:class:`Compacted` for the first; re-read with :meth:`Client.range`, watch
    again from its revision + 1). A stream that carried nothing for ``silence`` seconds ends
    it too (:class:`Silent`): a quiet key sends nothing, but etcd sends a progress
    notification on a quiet watch every interval (``--experimental-watch-progress-notify-
    interval``), so a live stream is never that silent and a silent one is a dead connection
    (a dropped NAT or connection-tracking entry sends no FIN nor RST: docs/rendezvous.md).
    Resume from :attr:`last_event_revision` + 1: nothing lost, nothing repeated (etcd never
    splits one revision's events between two answers). :meth:`close` ends it, and
    :meth:`get` always returns in time.
    """

    def __init__(self, client: Client, body: dict[str, Any], timeout: float, silence: float = 0.0) -> None:
        self.client = client
        self.silence = silence
        self.revision = 0  #: the header revision of the latest answer: all before it was delivered
        #: the mod revision of the last event handed out by :meth:`get` (0: none yet)
        self.last_event_revision = 0
        self.last_message = time.monotonic()  #: when the stream last carried an answer
        self.progress = 0  #: progress notifications received (answers with no event)
        self._state = _WatchState()
        self._closed = threading.Event()
        self._created = threading.Event()
        self._conn = client._new_conn(timeout)
        data = json.dumps(body).encode()
        try:
            self._conn.request(
                "POST", f"{API}/watch", body=data, headers={"Content-Type": "application/json"}
            )
            self._resp = self._conn.getresponse()
            if self._resp.status != 200:
                raw = self._resp.read()
                self._conn.close()
                client._answer(raw, self._resp.status, "watch")
        except TimeoutError as e:
            self._conn.close()
            raise Timeout(f"etcd {client.url}: no answer to watch within {timeout:g}s") from e
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise Unavailable(f"etcd {client.url}: watch failed: {e or type(e).__name__}") from e
        client.stats.add("watch", len(data), 0)
        self._thread = threading.Thread(target=self._read, name="etcd-watch", daemon=True)
        self._thread.start()
        if not self._created.wait(timeout):
            self.close()
            raise Timeout(f"etcd {client.url}: watch not created within {timeout:g}s")
        if self._state.error is not None and self._state.watch_id < 0:
            self.close()
            raise self._state.error

    def _read(self) -> None:
        st = self._state
        try:
            # a watch closed before this thread ran (its creation timed out under load) has no socket
            sock = self._conn.sock
            if sock is None:
                raise Unavailable(f"etcd {self.client.url}: watch closed before it was read")
            # a live watch carries a progress notification every interval: silence is death
            sock.settimeout(self.silence if self.silence > 0 else None)
            for line in self._lines():
                self.last_message = time.monotonic()
                d = json.loads(line)
                if "error" in d and "result" not in d:
                    err = d["error"]
                    raise _error(
                        err if isinstance(err, dict) else {"message": err},
                        500,
                        f"etcd {self.client.url}: watch",
                    )
                r = d.get("result") or {}
                self.client.stats.add("watch-answer", 0, len(line))
                self.client._check_cluster(r.get("header"))
                compact = int(r.get("compact_revision", 0) or 0)
                if compact:
                    raise Compacted(
                        f"etcd {self.client.url}: watch: revision compacted (oldest kept: {compact})", compact
                    )
                if r.get("canceled"):
                    raise RequestFailed(
                        f"etcd {self.client.url}: watch canceled: {r.get('cancel_reason', '')}"
                    )
                if r.get("created"):
                    st.watch_id = int(r.get("watch_id", 0))
                    self._created.set()
                evs = [
                    Event(
                        e.get("type", "PUT"),
                        KeyValue.parse(e.get("kv") or {}),
                        KeyValue.parse(e["prev_kv"]) if e.get("prev_kv") else None,
                    )
                    for e in r.get("events", [])
                ]
                if evs:  # the created answer and progress notices carry none
                    st.events.put((Header.parse(r.get("header")).revision, evs))
                elif not r.get("created"):
                    self.progress += 1
            raise Unavailable(f"etcd {self.client.url}: watch stream ended")
        except EtcdError as e:
            st.error = e
        except TimeoutError:
            st.error = Silent(
                f"etcd {self.client.url}: watch silent for {self.silence:g}s (no event, no progress "
                "notification): its connection is taken as dead"
            )
        except Exception as e:  # noqa: BLE001 (a closed or broken stream, whatever http.client says)
            st.error = Unavailable(f"etcd {self.client.url}: watch stream broke: {e or type(e).__name__}")
        finally:
            if self._closed.is_set():
                st.error = Unavailable(f"etcd {self.client.url}: watch closed")
            self._created.set()
            st.events.put(_END)

    def _lines(self) -> Iterable[bytes]:
        # the gateway writes one JSON object per message, each followed by a newline
        buf = b""
        while True:
            chunk = self._resp.read1(65536)
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            yield from (ln for ln in lines if ln.strip())

    def get(self, timeout: float) -> list[Event] | None:
        """The events of etcd's next answer (in order), or ``None`` if none came within
        ``timeout``. Raises the error that ended the watch (after every event before it)."""
        try:
            item = self._state.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _END:
            self._state.events.put(_END)  # every later get raises too
            assert self._state.error is not None
            raise self._state.error
        rev, evs = item
        self.revision = max(self.revision, rev)
        self.last_event_revision = max(self.last_event_revision, evs[-1].kv.mod_revision)
        return evs

    def events(self, timeout: float) -> Iterable[Event]:
        """Every event until ``timeout`` seconds pass without one (a convenience for tests)."""
        while True:
            evs = self.get(timeout)
            if evs is None:
                return
            yield from evs

    def close(self) -> None:
        """End the watch: the reader thread sees its socket shut and stops (joined, bounded)."""
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not threading.current_thread():
            self._thread.join(2)
        self._conn.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    endpoint: str,
    protocol: str = "http",
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    timeout: float = 5.0,
    stats: Stats | None = None,
) -> Client:
    """A :class:`Client` for ``endpoint`` whose etcd answered and serves ``/v3/`` (3.4+)."""
    c = Client(endpoint, protocol, cacert, cert, key, timeout, stats)
    v = c.version()
    try:
        major, minor = (int(x) for x in v.split(".")[:2])
    except ValueError:
        raise EtcdError(f"etcd {c.url}: unknown server version {v!r}") from None
    if (major, minor) < MIN_VERSION:
        raise EtcdError(f"etcd {c.url} is {v}: its gateway has no /v3/ API; run etcd 3.4 or newer")
    c.status()  # the cluster id, and a v3 call that works
    return c


def connect_tls(
    endpoint: str, tls: EtcdTls | None, timeout: float = 5.0, stats: Stats | None = None
) -> Client:
    """:func:`connect` with the agent's TLS settings (``PETCTL_ETCD_CACERT``/``CERT``/``KEY``):
    https with them, http without."""
    if tls is None:
        return connect(endpoint, timeout=timeout, stats=stats)
    return connect(endpoint, "https", tls.cacert, tls.cert, tls.key, timeout, stats)
