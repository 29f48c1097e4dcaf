"""The handler's settings: timing knobs and how to reach etcd (``--rdzv-conf`` keys)."""

from __future__ import annotations

import os
from typing import Any

BACKEND = "petctl-etcd"
DEFAULT_PREFIX = "/petctl/rdzv"
DEFAULT_PORT = 2379


class Config:
    """Timing knobs (seconds), and how to reach etcd. Defaults follow issue 10; all can be set
    via ``--rdzv-conf``.

    TLS takes torch's ``etcd`` handler's keys: ``protocol`` (``http``/``https``), ``cacert`` (the
    CA bundle that signed etcd's certificate), ``cert`` and ``key`` (our client certificate and
    its key; ``cert`` alone is a PEM holding both).
    """

    def __init__(
        self,
        ttl: float = 2.0,
        refresh: float = 0.5,
        settle: float = 0.5,
        hint_wait: float = 5.0,
        join_timeout: float = 600.0,
        store_timeout: float = 20.0,
        watch_timeout: float = 30.0,
        request_timeout: float = 5.0,
        reconnect_grace: float | None = None,
        record_ttl: float = 60.0,
        protocol: str = "http",
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        if int(ttl) != ttl or ttl < 1 or not 0 < refresh < ttl:
            raise ValueError(
                f"ttl ({ttl}) must be a whole number of seconds (etcd v2) above refresh ({refresh})"
            )
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
        self.join_timeout = join_timeout
        self.store_timeout = store_timeout
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.reconnect_grace = ttl + 1.0 if reconnect_grace is None else reconnect_grace
        self.record_ttl = int(record_ttl)
        self.protocol = protocol
        self.cacert = cacert or None
        self.cert = cert or None
        self.key = key or None

    def client_tls(self) -> dict[str, Any]:
        """python-etcd ``Client`` arguments for our protocol and certificates."""
        if self.protocol == "http":
            return {}
        return {
            "protocol": "https",
            "ca_cert": self.cacert,
            "cert": (self.cert, self.key) if self.key else self.cert,
        }
