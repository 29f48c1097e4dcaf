"""A local copy of one etcd key or prefix, kept current by a v3 watch (by revision) in a thread."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Protocol

from petctl_agent.rendezvous import etcd_ops, etcd_types, etcd_watch
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT, unexpected
from petctl_agent.rendezvous.config import BOOT_TOKEN_KEY
from petctl_agent.rendezvous.layout import Item

log = logging.getLogger("petctl_agent.rendezvous")


class Owner(Protocol):
    """What a watcher uses of its handler."""

    _cond: threading.Condition
    _stopping: bool
    _etcd: v3.Client

    def _bump(self) -> None: ...

    def _client_error(self, e: BaseException) -> None: ...

    def _check_token(self, token: str | None) -> bool: ...


class Watcher:
    """A local copy of one etcd key (or every key under a prefix), kept current by a v3 watch.

    ``items``: key -> (value, create_revision, mod_revision). It reads the keys once (in the
    same txn it reads the boot token: a changed or missing token means a new etcd) and watches
    from the read's revision + 1: etcd delivers every event after it, in order, with no event
    window. After an error it reads again and resumes from that read; a revision etcd
    compacted away (``Compacted``) costs exactly one re-read (``rereads``). A watch that went
    silent (``Silent``: no event and no progress notification for the client's
    ``watch_silence``, a connection that died without FIN or RST) is made again on a new
    connection from the last revision this copy holds, after one read of the boot token:
    nothing lost, nothing repeated, no re-read of the keys (``resumes``). When the handler
    learns that etcd was replaced it stops every watcher and starts new ones: a view of the
    old etcd is never used again. Every change bumps the handler's version.
    """

    def __init__(self, h: Owner, key: str, prefix: bool, timeout: float) -> None:
        self.h = h
        self.key = key
        self.prefix = prefix
        self.timeout = timeout
        self.items: dict[str, Item] = {}
        self.revision = 0
        self.synced = False
        self.connected = False
        self.rereads = 0  #: reads after the first (errors, compaction)
        self.compactions = 0  #: watches ended by Compacted
        self.resumes = 0  #: silent watches made again from the last revision (no re-read)
        self.reconnected_at = float("-inf")
        self.read_at = float("-inf")  #: when the last whole read of the keys was sent (not a resume)
        self.last_added = float("-inf")
        self.added_at: dict[str, float] = {}
        self._stop = False
        self._watch: etcd_watch.Watch | None = None
        self.thread = threading.Thread(target=self._run, name=f"petctl-rdzv-watch{key}", daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        w = self._watch
        if w is not None and threading.current_thread() is not self.thread:
            threading.Thread(target=w.close, daemon=True).start()  # never block the caller

    @property
    def stopped(self) -> bool:
        return self._stop

    @property
    def current(self) -> bool:
        """Read since the last error: what etcd holds now, give or take one round trip."""
        return self.synced and self.connected

    def _run(self) -> None:
        client = self.h._etcd
        need_sync, resume, backoff = True, False, 0.05
        try:
            while not self._stop and not self.h._stopping:
                try:
                    if need_sync:
                        if self._watch is not None:
                            self._watch.close()
                            self._watch = None
                        rev = self._resume(client) if resume else self._sync(client)
                        resume = False
                        if rev is None:
                            return
                        self._watch = client.watch(
                            self.key, prefix=self.prefix, start_revision=rev + 1, timeout=self.timeout
                        )
                        if self._stop:
                            return
                        need_sync, backoff = False, 0.05
                        continue
                    evs = self._watch.get(1.0)
                    if evs is not None and not self._stop:
                        self._apply(evs)
                except v3.Compacted as e:
                    self.compactions += 1
                    log.info("etcd watch on %s: %s; re-reading once", self.key, e)
                    need_sync = True
                except v3.Silent as e:
                    if self._stop:
                        return
                    # this thread's keep-alive connection went the same way, likely: a new one
                    client.close()
                    log.warning("etcd watch on %s: %s; watching again from revision %d",
                                self.key, e, self.revision + 1)  # fmt: skip
                    need_sync = resume = True
                except TRANSIENT as e:
                    if self._stop:
                        return
                    self.h._client_error(e)
                    if self.connected:
                        log.info("etcd watch on %s failed (%s); re-reading after reconnect", self.key, e)
                    with self.h._cond:
                        self.connected = False
                        self.h._bump()
                    need_sync = True
                    time.sleep(backoff * (1 + random.random()))
                    backoff = min(backoff * 2, 0.5)  # at most 1 s with the jitter: see docs, a replaced etcd
                except Exception:  # noqa: BLE001 - see client.unexpected(): read again, never die
                    if self._stop:
                        return
                    unexpected(log, f"watch on {self.key}")
                    with self.h._cond:
                        self.connected = False
                        self.h._bump()
                    need_sync = True
                    time.sleep(1.0)
        finally:
            if self._watch is not None:
                self._watch.close()

    def _sync(self, client: v3.Client) -> int | None:
        """Read the keys and the boot token at one revision; None if this watcher must end."""
        asked = time.monotonic()
        r = client.txn([], [etcd_ops.range_op(self.key, self.prefix), etcd_ops.range_op(BOOT_TOKEN_KEY)])
        kvs, tok = r.responses[0], r.responses[1]
        assert isinstance(kvs, etcd_types.RangeResult) and isinstance(tok, etcd_types.RangeResult)
        token = tok.kvs[0].text if tok.kvs else None
        if not self.h._check_token(token) or self._stop:
            return None  # etcd was replaced: the handler started new watchers
        items = {kv.key: (kv.text, kv.create_revision, kv.mod_revision) for kv in kvs.kvs}
        now = time.monotonic()
        with self.h._cond:
            if self._stop:
                return None
            if self.synced:
                self.rereads += 1
            if self.synced and not self.connected:
                self.reconnected_at = now
            added = set(items) - set(self.items)
            for k in added:
                self.added_at[k] = now
            for k in set(self.items) - set(items):
                self.added_at.pop(k, None)
            if added and self.synced:  # what was there before we looked is not a fresh arrival
                self.last_added = now
            self.items, self.revision = items, r.revision
            self.read_at = asked
            self.synced = self.connected = True
            self.h._bump()
        return r.revision

    def _resume(self, client: v3.Client) -> int | None:
        """After a silent watch: the boot token (one key), and the revision to watch from (the
        last one this copy holds); None if this watcher must end."""
        tok = client.get(BOOT_TOKEN_KEY)
        if not self.h._check_token(tok.text if tok is not None else None) or self._stop:
            return None  # etcd was replaced: the handler started new watchers
        self.resumes += 1
        return self.revision

    def _apply(self, evs: list[etcd_types.Event]) -> None:
        now = time.monotonic()
        with self.h._cond:
            for ev in evs:
                k = ev.kv.key
                if ev.type == "DELETE":
                    self.items.pop(k, None)
                    self.added_at.pop(k, None)
                else:
                    if k not in self.items:
                        self.added_at[k] = now
                        self.last_added = now
                    self.items[k] = (ev.kv.text, ev.kv.create_revision, ev.kv.mod_revision)
                self.revision = max(self.revision, ev.kv.mod_revision)
            self.h._bump()

    def mod_revision(self, key: str) -> int | None:
        v = self.items.get(key)
        return None if v is None else v[2]
