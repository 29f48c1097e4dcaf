"""How the etcd v3 client talks to one endpoint: :class:`Transport`, the base of
:class:`~.etcdv3.Client` and what a :class:`~.etcd_watch.Watch` opens its stream on.

It owns the endpoint (``host:port`` or ``http(s)://host:port``) and its TLS context, one
keep-alive HTTP connection per thread (TCP keepalive on every socket, :func:`keepalive`; a
connection idle for :data:`MAX_IDLE_REUSE` s is not reused; a request that met a connection
etcd closed is sent again only when that is safe), each JSON answer (an error answer becomes
the client's error, ``_error``), the cluster check of every answer's header
(:class:`ClusterChanged`), and :class:`Stats` (requests by kind, bytes). Also the timings of
connections that die silently (docs/rendezvous.md): the watch silence and the TCP keepalive.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections import Counter
from typing import Any

from petctl_agent.rendezvous.errors import (
    ClusterChanged,
    Compacted,
    EtcdError,
    LeaseNotFound,
    NoSpace,
    RequestFailed,
    Timeout,
    Unavailable,
)

API = "/v3"

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


#: how a keep-alive connection that etcd closed fails; calls that only read (safe to repeat)
_STALE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)
_READS = frozenset({"range", "status", "keepalive", "timetolive", "version", "alarm"})


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


class Transport:
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
        """POST ``body`` to ``/v3/<path>``; the answer (for what :class:`~.etcdv3.Client`'s methods leave out)."""
        return self._request("POST", f"{API}/{path}", body, kind, timeout)

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._drop()
