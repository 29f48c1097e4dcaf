"""A thin etcd v3 client over etcd's JSON gateway (``/v3/...``), standard library only.

The client layer petctl-etcd's v3 handler stands on. Why this and not a library
(docs/rendezvous.md, "The etcd v3 client"): every dependency of the agent ships to every
instance; ``etcd3gw`` pulls ``requests``, ``futurist`` and ``pbr``, ignores a watch's
compaction and keeps no lease alive; ``aetcd`` is asyncio over ``grpcio`` + ``protobuf``
(tens of MB of wheels per node). What the handler needs is ten JSON calls, a streaming watch
and a keepalive loop: this module, on ``http.client`` and ``ssl``.

This module is the client's face: :class:`Client` (the calls) and :func:`connect`; the errors
and :class:`Lease` are re-exported here. The rest, one job each: :mod:`.etcd_transport` (one
endpoint's connections and answers, :class:`Client`'s base), :mod:`.etcd_types` (values and
results), :mod:`.etcd_ops` (a txn's compares and ops), :mod:`.etcd_watch` (a streaming watch),
:mod:`.errors` and :mod:`.lease`.

* **Calls**: :meth:`Client.range` (one key or a prefix, at a revision), :meth:`Client.put`
  (with a lease), :meth:`Client.delete`, :meth:`Client.txn` (compare mod/create revision,
  version, value or lease; success and failure ops, built with :mod:`.etcd_ops`), leases
  (:meth:`Client.grant`, :meth:`Client.keepalive_once`, :meth:`Client.revoke`,
  :meth:`Client.time_to_live`), :meth:`Client.status`, :meth:`Client.compact`. Each has a
  timeout (the socket's, per call); nothing waits unbounded. Each answer's header carries the
  store revision.
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
* **Watches** (:mod:`.etcd_watch`): :meth:`Client.watch` from a revision, a key or a prefix; a
  reader thread parses the gateway's stream, :meth:`~.etcd_watch.Watch.get` hands out each
  answer's events in order with a timeout. A start revision below the compacted one ends the
  watch with :class:`Compacted`.
* **Versions**: etcd 3.4, 3.5 and 3.6 serve the gateway at ``/v3/`` (3.3 only at
  ``/v3beta/``, 3.2 at ``/v3alpha/``); :func:`connect` refuses an etcd older than 3.4.
* **TLS**: ``https`` with a CA bundle and a client certificate and key, the files the agent
  gets today (``PETCTL_ETCD_CACERT``/``CERT``/``KEY``); the server's certificate is checked
  against the CA and the address, as python-etcd does.

Keys are ``str`` (UTF-8), values ``bytes`` or ``str``; etcd's int64s (JSON strings) come back
as ``int``.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Sequence
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
from petctl_agent.rendezvous.etcd_ops import _put_body, _range_body, _range_opts
from petctl_agent.rendezvous.etcd_transport import Stats, Transport
from petctl_agent.rendezvous.etcd_types import (
    DeleteResult,
    Header,
    KeyValue,
    PutResult,
    RangeResult,
    Status,
    TxnResult,
    _delete_result,
    _put_result,
    _unb64,
)
from petctl_agent.rendezvous.etcd_watch import Watch
from petctl_agent.rendezvous.lease import Lease
from petctl_agent.settings import EtcdTls

#: the client's face: its calls, and the errors (:mod:`.errors`) and :class:`Lease` it re-exports
__all__ = [
    "MIN_VERSION",
    "Client",
    "ClusterChanged",
    "Compacted",
    "EtcdError",
    "Lease",
    "LeaseNotFound",
    "NoSpace",
    "RequestFailed",
    "Silent",
    "Timeout",
    "Unavailable",
    "connect",
    "connect_tls",
]

#: the oldest etcd whose gateway serves ``/v3/`` (3.3: ``/v3beta/`` only)
MIN_VERSION = (3, 4)


class Client(Transport):
    """One etcd endpoint's calls: kv, txn, leases, cluster, watches. Thread-safe. Its
    connections, arguments and errors: :class:`~.etcd_transport.Transport`.
    """

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
