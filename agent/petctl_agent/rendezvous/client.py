"""etcd access: a python-etcd client per thread that counts requests and notices a new etcd."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import etcd
import urllib3.exceptions

#: errors that mean "etcd is unreachable right now" (retry; re-read state afterwards)
TRANSIENT = (
    etcd.EtcdConnectionFailed,
    etcd.EtcdClusterIdChanged,
    etcd.EtcdException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    OSError,
)


class RequestCounter:
    """Counts etcd requests by kind (thread-safe); one can be shared by many handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Client:
    """A python-etcd client (one per thread: watches hold their connection) that counts requests.

    python-etcd remembers the cluster id of its first answer and refuses, once, the first answer
    of another cluster (``EtcdClusterIdChanged``): a new etcd (fresh data dir) now serves this
    address. Then this client starts afresh, tells ``on_new_cluster`` (the handler drops every
    view it read from the old etcd) and re-raises, so the caller retries as after any outage.
    """

    def __init__(
        self,
        host: str,
        port: int,
        counter: RequestCounter,
        timeout: float,
        on_new_cluster: Callable[[str], None],
        tls: dict[str, Any] | None = None,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.tls = tls or {}
        self.counter = counter
        self.on_new_cluster = on_new_cluster
        self.c = self._connect()

    def _connect(self) -> etcd.Client:
        return etcd.Client(
            host=self.host, port=self.port, read_timeout=self.timeout, allow_reconnect=False, **self.tls
        )

    def _call(self, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.counter.add(kind)
        try:
            return fn(*args, **kw)
        except etcd.EtcdClusterIdChanged:
            cluster = str(self.c.expected_cluster_id)
            self.c = self._connect()
            self.on_new_cluster(cluster)
            raise

    def get(self, key: str, kind: str, recursive: bool = False) -> etcd.EtcdResult:
        return self._call(kind, lambda: self.c.read(key, recursive=recursive))

    def write(self, key: str, value: str | None, kind: str, **kw: Any) -> etcd.EtcdResult:
        return self._call(kind, lambda: self.c.write(key, value, **kw))

    def delete(self, key: str, kind: str, **kw: Any) -> None:
        self._call(kind, lambda: self.c.delete(key, **kw))

    def watch(self, key: str, index: int, timeout: float, recursive: bool) -> etcd.EtcdResult:
        return self._call(
            "watch",
            lambda: self.c.read(key, wait=True, waitIndex=index, timeout=timeout, recursive=recursive),
        )
