"""A local copy of one etcd key or directory tree, kept current by a v2 watch in a thread."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Protocol

import etcd

from petctl_agent.rendezvous.client import TRANSIENT, Client

log = logging.getLogger("petctl_agent.rendezvous")


class Owner(Protocol):
    """What a watcher uses of its handler."""

    _cond: threading.Condition
    _stopping: bool

    def _bump(self) -> None: ...

    def _client(self, timeout: float) -> Client: ...

    def _etcd_replaced(self, why: str) -> None: ...


class Watcher:
    """A local copy of one etcd key or directory tree, kept current by a v2 watch in a thread.

    ``items``: leaf key -> (value, createdIndex). After any error it re-reads the tree and
    resumes from the read's ``X-Etcd-Index`` (so etcd restarts heal). When the handler learns
    that etcd was replaced it stops every watcher and starts new ones: a view of the old etcd
    is never used again. Every change bumps the handler's version and notifies its condition.
    """

    def __init__(self, h: Owner, key: str, recursive: bool, timeout: float) -> None:
        self.h = h
        self.key = key
        self.recursive = recursive
        self.timeout = timeout
        self.items: dict[str, tuple[str | None, int]] = {}
        self.index = 0
        self.synced = False
        self.connected = False
        self.reconnected_at = float("-inf")
        self.last_added = float("-inf")
        self.added_at: dict[str, float] = {}
        self._stop = False
        self.thread = threading.Thread(target=self._run, name=f"petctl-rdzv-watch{key}", daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True

    @property
    def stopped(self) -> bool:
        return self._stop

    @property
    def current(self) -> bool:
        """Read since the last error: what etcd holds now, give or take one round trip."""
        return self.synced and self.connected

    def _run(self) -> None:
        client = self.h._client(self.timeout + 5)
        need_sync, backoff = True, 0.05
        while not self._stop and not self.h._stopping:
            try:
                if need_sync:
                    self._sync(client)
                    need_sync, backoff = False, 0.05
                    continue
                ev = client.watch(self.key, self.index + 1, self.timeout, self.recursive)
            except etcd.EtcdWatchTimedOut:
                continue
            except etcd.EtcdEventIndexCleared:
                need_sync = True
                continue
            except TRANSIENT as e:
                if self.connected:
                    log.info("etcd watch on %s failed (%s); re-reading after reconnect", self.key, e)
                with self.h._cond:
                    self.connected = False
                    self.h._bump()
                need_sync = True
                time.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, 1.0)
                continue
            if not self._stop:
                self._apply(ev)

    def _sync(self, client: Client) -> None:
        items: dict[str, tuple[str | None, int]] = {}
        try:
            r = client.get(self.key, "sync", recursive=self.recursive)
            index = int(r.etcd_index)
            for leaf in r.leaves:
                if not leaf.dir:
                    items[leaf.key] = (leaf.value, int(leaf.createdIndex))
        except etcd.EtcdKeyNotFound as e:
            index = int(e.payload.get("index", 0)) if getattr(e, "payload", None) else 0
        now = time.monotonic()
        with self.h._cond:
            if self._stop:
                return
            if index < self.index:  # an etcd index never goes backwards: a new etcd at this address
                self.h._etcd_replaced(f"the index of {self.key} went back from {self.index} to {index}")
                return
            if self.synced and not self.connected:
                self.reconnected_at = now
            added = set(items) - set(self.items)
            for k in added:
                self.added_at[k] = now
            for k in set(self.items) - set(items):
                self.added_at.pop(k, None)
            if added and self.synced:  # what was there before we looked is not a fresh arrival
                self.last_added = now
            self.items, self.index = items, index
            self.synced = self.connected = True
            self.h._bump()

    def _apply(self, ev: etcd.EtcdResult) -> None:
        now = time.monotonic()
        with self.h._cond:
            if ev.action in ("delete", "expire", "compareAndDelete"):
                for k in [k for k in self.items if k == ev.key or k.startswith(ev.key + "/")]:
                    del self.items[k]
                    self.added_at.pop(k, None)
            elif not ev.dir:
                if ev.key not in self.items:
                    self.added_at[ev.key] = now
                    self.last_added = now
                self.items[ev.key] = (ev.value, int(ev.createdIndex))
            self.index = max(self.index, int(ev.modifiedIndex))
            self.h._bump()

    def modified_index(self, key: str) -> int | None:
        v = self.items.get(key)
        return None if v is None else v[1]
