"""Membership: this node's key under ``nodes/`` (registration, the refresher that keeps its TTL),
the one read of ``nodes/`` a non-leader needs, and what happens when etcd loses our state."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import etcd
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from petctl_agent.rendezvous.client import TRANSIENT, Client
from petctl_agent.rendezvous.layout import key_name
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")


class Membership:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): registration, the refresher and control threads' start,
    and the etcd clients."""

    def _client(self, timeout: float) -> Client:
        return Client(self.host, self.port, self.counter, timeout, self._new_cluster, self.cfg.client_tls())

    def _new_cluster(self, cluster_id: str) -> None:
        """A client met another etcd cluster at our address (each client tells it once)."""
        with self._cond:
            if cluster_id == self._cluster_id:
                return  # another client told it first
            self._cluster_id = cluster_id
            self._etcd_replaced(f"etcd cluster id changed to {cluster_id}")

    def _etcd_replaced(self, why: str) -> None:
        """etcd lost our state (a new etcd at this address, or our key vanished): stop every watcher
        and start afresh, so nothing acts on what the old etcd held. The refresher re-registers;
        a node that is joining picks its round again from the new view (see next_rendezvous)."""
        with self._cond:
            if self._stopping or self._left:
                return
            self._generation += 1
            self._replaced_at = time.monotonic()
            for w in (self._members, self._leader_w, self._joins):
                if w is not None:
                    w.stop()
            self._members = self._leader_w = self._joins = None
            self._snapped_for = None
            if self._rounds is not None:
                self._rounds.stop()
                self._rounds = Watcher(self, self.keys.rounds, True, self.cfg.watch_timeout).start()
            self._bump()
        log.warning("%s: re-reading the rendezvous state", why)
        self._event(f"etcd state lost: {why}")

    def _register(self, client: Client) -> None:
        value = json.dumps({"addr": self.addr, "pid": os.getpid()})
        try:
            r = client.write(self.node_key, value, "register", ttl=self.cfg.ttl, prevExist=False)
        except etcd.EtcdAlreadyExist:
            r = client.write(self.node_key, None, "refresh", ttl=self.cfg.ttl, refresh=True, prevExist=True)
        with self._cond:
            self._reg_index = int(r.createdIndex)
            self._reg_epoch += 1
            self._bump()

    def _snapshot(self, client: Client) -> None:
        """Read the membership once (non-leaders use it to find the leader)."""
        try:
            r = client.get(self.keys.nodes, "snapshot", recursive=True)
            snap = {
                key_name(n.key): int(n.createdIndex)
                for n in r.leaves
                if not n.dir and n.key != self.keys.nodes
            }
            index = int(r.etcd_index)
        except etcd.EtcdKeyNotFound as e:
            snap, index = {}, int(e.payload.get("index", 0))
        with self._cond:
            self._snap, self._snap_index = snap, index
            self._bump()

    def _start(self) -> None:
        """Register, start the rounds watcher, the refresher and the control thread (once)."""
        if self._started:
            return
        deadline = time.monotonic() + self.cfg.join_timeout
        while True:
            try:
                self._register(self._main)
                self._snapshot(self._main)
                break
            except TRANSIENT as e:
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"cannot register at etcd {self.cfg.protocol}://{self.host}:{self.port}: {e}"
                    ) from e
                log.warning("etcd unreachable while registering (%s); retrying", e)
                time.sleep(0.5)
        self._started = True
        self._rounds = Watcher(self, self.keys.rounds, True, self.cfg.watch_timeout).start()
        for target, name in ((self._refresher, "refresh"), (self._control, "control")):
            t = threading.Thread(target=target, name=f"petctl-rdzv-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _refresher(self) -> None:
        client = self._client(self.cfg.request_timeout)
        while not self._stopping and not self._left:
            t0 = time.monotonic()
            try:
                client.write(self.node_key, None, "refresh", ttl=self.cfg.ttl, refresh=True, prevExist=True)
            except etcd.EtcdKeyNotFound:
                if self._left or self._stopping:
                    break
                self._etcd_replaced("our membership key vanished (expired, or etcd was replaced)")
                try:
                    self._register(client)
                    self._event("re-registered")
                except TRANSIENT as e:
                    log.info("re-register failed: %s", e)
            except TRANSIENT as e:
                log.debug("refresh failed: %s", e)
            with self._cond:
                pending, self._cleanup = self._cleanup, []
            for job in pending:
                try:
                    job(client)
                except TRANSIENT as e:
                    log.debug("cleanup failed: %s", e)
            time.sleep(max(0.0, self.cfg.refresh - (time.monotonic() - t0)))
