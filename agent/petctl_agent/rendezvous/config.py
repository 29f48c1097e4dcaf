"""The handler's settings: timing knobs and how to reach etcd (``--rdzv-conf`` keys)."""

from __future__ import annotations

import os
from typing import Any

BACKEND = "petctl-etcd"
DEFAULT_PREFIX = "/petctl/rdzv"
DEFAULT_PORT = 2379
#: written create-if-absent by each boot of the rendezvous server (and by a handler that finds
#: none): a token that changes or disappears means another etcd answers at the same address
BOOT_TOKEN_KEY = "/petctl/etcd-boot-token"


class Config:
    """Timing knobs (seconds), and how to reach etcd. All can be set via ``--rdzv-conf``.

    * ``ttl``: the membership lease's TTL (etcd v3 lease, whole seconds, >= 2); ``refresh``: the
      keepalive interval (a keepalive is no raft write). 6 s / 1 s ride through a 3 s pause of
      the agent or of etcd; a real loss is seen sooner from the data plane (workers' collectives
      fail, a worker exits, the agent re-joins and opens the round).
    * ``settle``: a round closes no sooner than this after it opened (one-shot, never re-armed;
      skipped when the size hint is met or no newcomer joined). ``join_window``: nodes that register later than this
      after the round opened are not waited for (they join the next round). ``straggler``: once
      MIN nodes joined, a registered node that has not joined within this is left out.
      ``stop_wait``: a node of the previous round is waited for this long instead, when longer
      (its workers stopping: the agent sets its sync timeout plus a margin; 0: ``straggler``).
    * ``hint_wait``, ``hint_max``: while running, newcomers that joined are batched while the
      size hint says more are coming: until none has joined for ``hint_wait`` (no more are
      coming soon), at most ``hint_max`` after the first of them. The running nodes train on.
    * ``record_ttl``: the lease a round record gets when the next round replaces it.
    * ``watch_silence``: a watch that received nothing (no event, no progress notification) for
      this long is taken as dead and made again on a new connection from its last revision: a
      connection that a NAT or EC2's connection tracking dropped ends with no FIN nor RST
      (docs/rendezvous.md, "Connections that die silently"). 30 s: 3 x the 10 s progress
      notify interval petctl runs etcd with (``--experimental-watch-progress-notify-interval``);
      an etcd without it sends one every 10 min, and each quiet watch is then made again every
      ``watch_silence`` (0: never; then a dead watch is seen by TCP keepalive only, after 60 s).
    * ``request_timeout``: every unary call's (connect, send, each read).
    * ``reconnect_grace``: after its watch reconnects (or etcd was replaced) the leader acts on
      the membership only this much later, so that nodes still reconnecting (each watcher
      retries within 1 s) re-register first and a replaced etcd's first round has them all.
    * ``outage`` (derived: ``max(refresh + 1, ttl / 2)``, 3 s): a node whose own keepalives got
      no answer this long was cut off from etcd (or etcd paused). Every lease may have expired
      meanwhile, its own too: what the membership shows says nothing of who is alive. It acts
      on the membership (opens, closes or takes over a round) only ``outage_grace`` (derived:
      the TTL) after it reaches etcd again, on a fresh read: a live node has renewed its lease
      or registered again by then (docs/rendezvous.md, "etcd paused or cut off").

    TLS takes torch's ``etcd`` handler's keys: ``protocol`` (``http``/``https``), ``cacert`` (the
    CA bundle that signed etcd's certificate), ``cert`` and ``key`` (our client certificate and
    its key; ``cert`` alone is a PEM holding both).
    """

    def __init__(
        self,
        ttl: float = 6.0,
        refresh: float = 1.0,
        settle: float = 0.5,
        hint_wait: float = 5.0,
        hint_max: float = 60.0,
        join_timeout: float = 600.0,
        store_timeout: float = 20.0,
        watch_timeout: float = 30.0,
        request_timeout: float = 5.0,
        watch_silence: float = 30.0,
        reconnect_grace: float | None = None,
        record_ttl: float = 10.0,
        straggler: float = 10.0,
        join_window: float = 5.0,
        stop_wait: float = 0.0,
        protocol: str = "http",
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        if int(ttl) != ttl or ttl < 2 or not 0 < refresh <= ttl / 2:
            raise ValueError(
                f"ttl ({ttl}) must be a whole number of seconds >= 2 (an etcd lease), "
                f"and refresh ({refresh}) at most half of it"
            )
        if watch_silence and watch_silence < 3 * request_timeout:
            raise ValueError(
                f"watch_silence ({watch_silence}) must be 0 (never) or at least 3 x request_timeout "
                f"({request_timeout}); 30 s goes with etcd's 10 s progress notify interval"
            )
        for name, v in (
            ("settle", settle), ("straggler", straggler), ("join_window", join_window), ("stop_wait", stop_wait),
            ("hint_wait", hint_wait), ("hint_max", hint_max),
        ):  # fmt: skip
            if v < 0:
                raise ValueError(f"{name} ({v}) must not be negative")
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol {protocol!r}: use http or https")
        if key and not cert:
            raise ValueError("key given without cert: give the client certificate too (cert=...)")
        if protocol == "http" and (cacert or cert):
            raise ValueError("cacert/cert/key are for TLS: add protocol=https")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path} is not a file")
        self.ttl = int(ttl)
        self.refresh = refresh
        self.settle = settle
        self.hint_wait = hint_wait
        self.hint_max = hint_max
        self.join_timeout = join_timeout
        self.store_timeout = store_timeout
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.watch_silence = watch_silence
        self.reconnect_grace = 1.5 if reconnect_grace is None else reconnect_grace
        self.outage = max(refresh + 1.0, self.ttl / 2.0)
        self.outage_grace = float(self.ttl)
        self.record_ttl = max(2, int(record_ttl))
        self.straggler = straggler
        self.join_window = join_window
        self.stop_wait = stop_wait
        self.protocol = protocol
        self.cacert = cacert or None
        self.cert = cert or None
        self.key = key or None

    def client_tls(self) -> dict[str, Any]:
        """:class:`~petctl_agent.rendezvous.etcdv3.Client` arguments for our protocol and certificates."""
        if self.protocol == "http":
            return {}
        return {"protocol": "https", "cacert": self.cacert, "cert": self.cert, "key": self.key}
