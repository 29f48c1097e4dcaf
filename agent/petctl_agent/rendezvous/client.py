"""etcd access: the v3 client (:mod:`.etcdv3`) with a shared request counter, and what counts
as "etcd unreachable right now"."""

from __future__ import annotations

import logging
import threading
from typing import Any

from petctl_agent.rendezvous import etcd_transport
from petctl_agent.rendezvous import etcdv3 as v3

#: errors that mean "etcd is unreachable or answered oddly right now" (retry; re-read afterwards).
#: ``ClusterChanged`` is one: the handler also drops every view (see Membership._client_error).
TRANSIENT = (v3.Unavailable, v3.ClusterChanged, v3.RequestFailed, v3.Compacted, OSError)


_unexpected: dict[str, int] = {}
_unexpected_lock = threading.Lock()


def unexpected(log: logging.Logger, where: str) -> None:
    """An exception no handler expects (a bug, an answer we did not foresee) in one of the
    handler's threads (its control loop, its re-registration, a watch): log it and go on. A
    thread that died of it would leave the node registered and kept alive but never leading,
    re-registering or seeing a change: every round it should close would wait forever. Logged
    with its traceback the first 3 times per place, then every 60th."""
    with _unexpected_lock:
        n = _unexpected[where] = _unexpected.get(where, 0) + 1
    if n <= 3 or n % 60 == 0:
        log.exception("unexpected error in the rendezvous %s (%d so far); retrying", where, n)


class RequestCounter(etcd_transport.Stats):
    """Counts etcd requests by kind, and their JSON bytes (thread-safe); one can be shared by
    many handlers. Kinds are the v3 calls: ``range``, ``put``, ``txn``, ``grant``,
    ``keepalive``, ``revoke``, ``watch`` (a watch created), ``watch-answer`` (a message a
    watch received: not a request, but its bytes count in ``bytes_in``)."""

    def snapshot(self) -> dict[str, int]:  # type: ignore[override]
        with self._lock:
            return dict(self.requests)

    def bytes(self) -> tuple[int, int]:
        """(sent, received) JSON bytes so far."""
        with self._lock:
            return self.bytes_out, self.bytes_in


def make_client(
    endpoint: str,
    counter: RequestCounter,
    timeout: float,
    tls: dict[str, Any],
    watch_silence: float = etcd_transport.WATCH_SILENCE,
) -> v3.Client:
    """One v3 client for a handler (thread-safe: each thread keeps its own connection); its
    watches end after ``watch_silence`` s of silence (a dead connection: etcdv3.Silent)."""
    return v3.Client(endpoint, timeout=timeout, stats=counter, watch_silence=watch_silence, **tls)
