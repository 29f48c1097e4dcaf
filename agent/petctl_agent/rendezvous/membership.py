"""Membership: this node's key under ``nodes/`` on its lease (registration, the keeper that
re-registers when the lease is lost), the one read of ``nodes/`` a non-leader needs, the boot
token, and what happens when etcd loses our state."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT
from petctl_agent.rendezvous.config import BOOT_TOKEN_KEY
from petctl_agent.rendezvous.layout import key_name
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")


class Membership:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): registration, the keeper and control threads' start,
    the boot token."""

    def _client_error(self, e: BaseException) -> None:
        """Any thread's etcd error: a store revision that went back means a new etcd."""
        if isinstance(e, v3.ClusterChanged):
            self._etcd_replaced(f"etcd replaced ({e})", forget_token=True)

    def _check_token(self, token: str | None) -> bool:
        """The boot token read with a view: False (and every view dropped) if it changed or
        disappeared since we last read it, i.e. another etcd answers our address."""
        if token is None:
            token = self._create_token()
        with self._cond:
            if self._token is None or token == self._token:
                self._token = token
                return True
            old, self._token = self._token, token
        self._etcd_replaced(f"the etcd boot token changed ({old} -> {token})")
        return False

    def _create_token(self) -> str:
        """A bare etcd (or one whose server did not write it): create the token if absent."""
        mine = f"handler-{uuid.uuid4().hex}"
        r = self._etcd.txn(
            [v3.compare(BOOT_TOKEN_KEY, "create", "==", 0)],
            [v3.put_op(BOOT_TOKEN_KEY, mine)],
            [v3.range_op(BOOT_TOKEN_KEY)],
        )
        if r.succeeded:
            return mine
        got = r.responses[0]
        assert isinstance(got, v3.RangeResult)
        return got.kvs[0].text if got.kvs else mine

    def _etcd_replaced(self, why: str, forget_token: bool = False) -> None:
        """etcd lost our state (a new etcd at this address): stop every watcher and start afresh,
        so nothing acts on what the old etcd held. The keeper re-registers at once; a node that
        is joining picks its round again from the new view (see next_rendezvous)."""
        with self._cond:
            if self._stopping or self._left:
                return
            if forget_token:
                self._token = None  # the next read adopts the new etcd's token
            self._generation += 1
            self._replaced_at = time.monotonic()
            for w in (self._members, self._leader_w, self._joins):
                if w is not None:
                    w.stop()
            self._members = self._leader_w = self._joins = None
            self._snapped_for = None
            self._opened_at.clear()
            self._order.clear()
            if self._rounds is not None:
                self._rounds.stop()
                self._rounds = Watcher(self, self.keys.rounds, True, self.cfg.watch_timeout).start()
            self._rereg.set()
            self._bump()
        log.warning("%s: re-reading the rendezvous state", why)
        self._event(f"etcd state lost: {why}")

    def _register(self) -> None:
        """A new lease, and our member key on it (written once per registration)."""
        lid, ttl = self._etcd.grant(self.cfg.ttl)
        # the lease in the value: a leader checks it with one LeaseTimeToLive (no read of the key)
        value = json.dumps({"addr": self.addr, "pid": os.getpid(), "lease": lid, "ttl": ttl})
        r = self._etcd.put(self.node_key, value, lease=lid, prev_kv=True)
        # re-registering while our key lives (same node id) keeps its revision: not a newcomer
        created = r.prev.create_revision if r.prev is not None else r.revision
        lease = v3.Lease(self._etcd, lid, ttl, self._lease_lost, interval=self.cfg.refresh)
        with self._cond:
            old, self._lease = self._lease, lease
            self._reg_index = created
            self._reg_epoch += 1
            self._bump()
        lease.start()
        if old is not None:
            threading.Thread(target=old.stop, daemon=True).start()  # its keys moved to the new lease

    def _lease_lost(self, lease: v3.Lease) -> None:
        if lease is self._lease:
            self._event("membership lease lost")
            self._rereg.set()

    def _snapshot(self) -> None:
        """Read the membership once (non-leaders use it to find the leader): ids only."""
        r = self._etcd.range(self.keys.nodes, prefix=True, keys_only=True)
        snap = {key_name(kv.key): kv.create_revision for kv in r.kvs}
        with self._cond:
            self._snap, self._snap_index = snap, r.revision
            self._bump()

    def _start(self) -> None:
        """Register, start the rounds watcher, the keeper and the control thread (once)."""
        if self._started:
            return
        deadline = time.monotonic() + self.cfg.join_timeout
        while True:
            try:
                self._register()
                self._snapshot()
                break
            except TRANSIENT as e:
                self._client_error(e)
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(f"cannot register at etcd {self._etcd.url}: {e}") from e
                log.warning("etcd unreachable while registering (%s); retrying", e)
                time.sleep(0.5)
        self._started = True
        with self._cond:
            self._rounds = Watcher(self, self.keys.rounds, True, self.cfg.watch_timeout).start()
        for target, name in ((self._keeper, "keeper"), (self._control, "control")):
            t = threading.Thread(target=target, name=f"petctl-rdzv-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _keeper(self) -> None:
        """Re-register when the lease is lost (expired while we were paused too long, or etcd
        replaced) or the handler asks (:meth:`_etcd_replaced`)."""
        while not self._stopping and not self._left:
            # woken by _lease_lost, _etcd_replaced, leave; the timeout is only a safety net
            self._rereg.wait(5.0)
            if self._stopping or self._left:
                break
            lease = self._lease
            if not self._rereg.is_set() and (lease is None or not lease.lost.is_set()):
                continue
            self._rereg.clear()
            try:
                self._register()
                self._event("re-registered")
            except TRANSIENT as e:
                self._client_error(e)
                log.info("re-register failed: %s", e)
                self._rereg.set()
                time.sleep(0.2)
