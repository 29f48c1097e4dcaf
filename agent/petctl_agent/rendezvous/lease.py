"""A lease kept alive from a background thread (:class:`Lease`; :mod:`.etcdv3` re-exports it,
and ``Client.lease`` grants and starts one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from petctl_agent.rendezvous.errors import ClusterChanged, EtcdError, LeaseNotFound

#: how much sooner than ``interval`` each keepalive goes out (a fraction of it): the margin for a
#: late wake-up or a slow delivery, so that etcd's gaps between renewals stay under ``interval``
LEAD = 0.05


class Client(Protocol):
    """What a lease needs of :class:`~.etcdv3.Client` (no import of it: it imports this)."""

    timeout: float

    def keepalive_once(self, lease: int, timeout: float | None = None) -> int: ...

    def revoke(self, lease: int, timeout: float | None = None) -> None: ...


class Lease:
    """A granted lease, kept alive by a daemon thread every ``interval`` (``ttl/3``): sent on a
    fixed clock, ``LEAD`` of ``interval`` early, however long each round trip takes.

    ``lost`` is set (and ``on_lost`` called once, from the thread) when etcd says the lease
    has ended, or when no keepalive succeeded before the lease's deadline: the last
    successful keepalive + TTL, on ``time.monotonic`` (etcd's own clock is monotonic too).
    A keepalive is answered by the leader from memory: no raft write, no revision.

    ``back_at``: when a keepalive last succeeded after ``outage`` s or more without one (default
    TTL/2): this client was cut off from etcd (or etcd paused) and reaches it again.

    ``on_error`` (from the thread) gets a :class:`ClusterChanged`: the client raises it once, to
    the first call that meets the new etcd, and at steady state that is nearly always a
    keepalive. The lease is then lost at once (the new etcd never held it). Other errors are
    retried until the deadline.
    """

    def __init__(
        self,
        client: Client,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[Lease], None] | None = None,
        interval: float | None = None,
        outage: float | None = None,
        on_error: Callable[[EtcdError], None] | None = None,
    ) -> None:
        self.client, self.id, self.ttl = client, lease_id, ttl
        self.on_error = on_error
        self.interval = interval or max(ttl / 3.0, 0.1)
        self.outage = outage if outage is not None else ttl / 2.0
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.deadline = time.monotonic() + ttl  #: when the lease ends unless renewed
        self.last_ok = self.deadline - ttl  #: when the last successful keepalive (or the grant) was sent
        self.back_at = float("-inf")
        self.keepalives = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Lease:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{self.id:x}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        # A fixed rate, a little faster than ``interval``: etcd hears a renewal at least every
        # ``interval`` s, however long each keepalive's round trip takes. Counted from the answer
        # (as it was), every renewal came ``interval`` + the round trip after the last, so a lease
        # read that asks "renewed in the last ``interval`` s?" (``decide.heard_since``) missed it
        # in about (round trip / interval) of reads: 1 % at 1,000 nodes on 2 cores, each a second
        # read of a live lease (docs/rendezvous.md, "Reads in a window"). An answer slower than
        # the period sends the next at once: one keepalive a round trip, never more than one a
        # period, and never a burst to catch up.
        period = self.interval * (1.0 - LEAD)
        due = time.monotonic() + period
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            sent = time.monotonic()
            due += period
            if due <= sent:  # behind (a stall): on the rate again from this one
                due = sent + period
            # never wait past the deadline: an answer after it would not save the lease; and
            # at most ttl/3, so that a keepalive lost on a dead connection (no FIN, no RST)
            # leaves time to retry on a new one (this thread's, dropped on a timeout)
            # before the lease ends: 6 s TTL, 1 s interval: timed out at +3 s, sent again at once
            # (its due time passed meanwhile), renewed by +6 s if etcd answers at all
            budget = max(0.1, min(self.client.timeout, self.ttl / 3.0, self.deadline - sent))
            try:
                ttl = self.client.keepalive_once(self.id, timeout=budget)
            except LeaseNotFound:
                self._lose()
                return
            except ClusterChanged as e:
                try:
                    if self.on_error is not None:
                        self.on_error(e)
                finally:
                    self._lose()
                return
            except EtcdError:
                if time.monotonic() >= self.deadline:
                    self._lose()
                    return
                continue
            self.deadline = sent + ttl  # counted from before the request: conservative
            if sent - self.last_ok >= self.outage:
                self.back_at = time.monotonic()
            self.last_ok = sent
            self.keepalives += 1

    def _lose(self) -> None:
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(self)

    def stop(self) -> None:
        """Stop renewing (the lease then ends TTL seconds later).

        Safe from a signal handler that interrupted :meth:`start` (a SIGTERM while the node
        registers): a thread not yet running is not joined (``join`` would raise); once it runs, it
        sees the stop at its first wait and ends without a keepalive."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(self.client.timeout + 1)

    def revoke(self) -> None:
        """Stop renewing and end the lease now (its keys go at once); gone already is fine."""
        self.stop()
        try:
            self.client.revoke(self.id)
        except LeaseNotFound:
            pass
