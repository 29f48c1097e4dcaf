"""Leadership: which node leads, and the leader's two jobs in the control thread.

The leader is the first live node in rank order (the last round's participants, then
newcomers by registration). While it runs round r it opens round r+1 when a participant is
gone or a node waits; while it joins round r it closes it (writes the record) once every
live registered node has joined, at least MIN did, and no node registered within ``settle``.
Every other node watches only the leader's key. See docs/rendezvous.md, "Protocol".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import etcd

from petctl_agent.rendezvous.client import TRANSIENT, Client
from petctl_agent.rendezvous.layout import Rounds, key_name, latest_closed, loads
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")


class Leadership:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): the control thread."""

    def _order(self, base: list[str], nodes: set[str], reg: Callable[[str], int]) -> list[str]:
        survivors = [n for n in base if n in nodes]
        rest = sorted(nodes - set(survivors), key=lambda n: (reg(n), n))
        return survivors + rest

    def _presumed_leader(self) -> str | None:
        """The first live node in rank order, as far as this node knows (caller holds _cond)."""
        rounds, _ = self._rounds_view()
        rnum, rec = latest_closed(rounds)
        rec = rec or self._last_record
        base = list(rec["participants"]) if rec else []
        if self._members is not None and self._members.synced:
            live = {key_name(k): idx for k, (_, idx) in self._members.items.items()}
        else:
            live = dict(self._snap)
            rec_idx = rounds[rnum][1] if rnum in rounds else 0
            if rec and self._snap_index < rec_idx:
                for n in base:  # the record is newer than our read of nodes/: its nodes were alive
                    live.setdefault(n, 0)
        if self._reg_index is not None:
            live.setdefault(self.node_id, self._reg_index)
        if not live:
            return None
        return self._order(base, set(live), lambda n: live.get(n, 0))[0]

    def _control(self) -> None:
        """Background coordination: who leads, opening rounds on membership changes, closing rounds."""
        client = self._client(self.cfg.request_timeout)
        seen = -1
        wait: float | None = None
        while not self._stopping and not self._left:
            with self._cond:
                if self._version == seen:
                    self._cond.wait(timeout=wait if wait is not None else 1.0)
                seen = self._version
            try:
                wait = self._step(client)
            except TRANSIENT as e:
                log.debug("control step failed: %s", e)
                wait = 0.2

    def _step(self, client: Client) -> float | None:
        """One pass of the control loop; returns when to look again (None: on the next change)."""
        now = time.monotonic()
        with self._cond:
            leader = self._presumed_leader()
            me = leader == self.node_id
            if me:
                if self._leader_w is not None:
                    self._leader_w.stop()
                    self._leader_w = None
                if self._members is None:
                    self._members = Watcher(self, self.keys.nodes, True, 10.0).start()
                    self._event("leading")
            else:
                if self._members is not None:
                    self._members.stop()
                    self._members = None
                if self._joins is not None:
                    self._joins.stop()
                    self._joins = None
                lk = self.keys.node(leader) if leader else None
                if self._leader_w is not None and self._leader_w.key != lk:
                    self._leader_w.stop()
                    self._leader_w = None
                if lk and self._leader_w is None:
                    self._leader_w = Watcher(self, lk, False, 10.0).start()
        if not me:
            return self._follow(client, now)
        return self._lead(client, now)

    def _follow(self, client: Client, now: float) -> float | None:
        with self._cond:
            w = self._leader_w
            if w is None or not w.synced or w.items:
                return None
            if not w.connected:
                return None
            since = max(w.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            if self._snapped_for == (w.key, w.index):
                return 0.2  # already re-read the membership for this state of the leader's key
            self._snapped_for = (w.key, w.index)
        # the leader's key is gone (expired or deleted): read the membership again, recompute
        self._snapshot(client)
        return 0.0

    def _lead(self, client: Client, now: float) -> float | None:
        with self._cond:
            m = self._members
            if m is None or not m.synced or not m.connected:
                return None
            since = max(m.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            live = {key_name(k): idx for k, (_, idx) in m.items.items()}
            rounds, closed = self._rounds_view()
            if closed:
                return None
            latest, rec = latest_closed(rounds)
            target = self._target
            running = self._round
        if target is not None and target == latest + 1:
            return self._try_close(client, now, target, live, rounds, rec)
        if running is not None and running == latest and rec is not None:
            return self._maybe_open(client, now, latest, rec, live, rounds)
        return None

    def _maybe_open(
        self,
        client: Client,
        now: float,
        latest: int,
        rec: dict[str, Any],
        live: dict[str, int],
        rounds: Rounds,
    ) -> float | None:
        """Leader of a running round: announce the next round when the membership changed."""
        if latest + 1 in rounds:
            return None  # already open
        parts = list(rec["participants"])
        gone = [p for p in parts if p not in live]
        waiting = [n for n in sorted(live, key=lambda n: live[n]) if n not in parts]
        if len(parts) - len(gone) >= self.max_nodes:
            waiting = []
        retry = None
        if waiting and not gone:
            exp = self._expected()
            if exp is not None and len(parts) + len(waiting) < min(exp, self.max_nodes):
                with self._cond:
                    at = self._members.added_at if self._members is not None else {}
                    first = min(at.get(self.keys.node(n), now) for n in waiting)
                if now - first < self.cfg.hint_wait:
                    return self.cfg.hint_wait - (now - first) + 0.01
        if not gone and not waiting:
            return retry
        marker = {"state": "open", "by": self.node_id, "waiting": waiting, "gone": gone, "t": time.time()}
        try:
            client.write(self.keys.round(latest + 1), json.dumps(marker), "open", prevExist=False)
            self._event(f"opened round {latest + 1}: waiting={len(waiting)} gone={len(gone)}")
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
            pass
        return None

    def _try_close(
        self,
        client: Client,
        now: float,
        target: int,
        live: dict[str, int],
        rounds: Rounds,
        rec: dict[str, Any] | None,
    ) -> float | None:
        with self._cond:
            jkey = self.keys.joins(target)
            if self._joins is not None and self._joins.key != jkey:
                self._joins.stop()
                self._joins = None
            if self._joins is None:
                self._joins = Watcher(self, jkey, True, 10.0).start()
                return None
            if not self._joins.synced:
                return None
            joins = {key_name(k): loads(v) for k, (v, _) in self._joins.items.items()}
            members_index = self._members.index if self._members else 0
            last_added = self._members.last_added if self._members else float("-inf")
        if not set(live) <= set(joins):
            return None  # a live registered node has not joined yet
        for n, j in joins.items():
            # joined, but its registration not seen yet (it is in flight on the other watch)
            if n not in live and int(j.get("reg", 0)) > members_index:
                return None
        joined = {n for n in joins if n in live}
        if len(joined) < self.min_nodes:
            return None
        base = list((rec or self._last_record or {}).get("participants", []))
        order = self._order(base, joined, lambda n: live[n])
        parts = order[: self.max_nodes]
        exp = self._expected()
        survivors = [n for n in base if n in joined]
        if exp is not None and len(parts) > len(survivors) and exp <= len(survivors):
            # newcomers are joining but the hint expects no growth: it predates them (a desired
            # capacity read before the scale-out). A stale hint must not skip the settle window.
            exp = None
        hinted = exp is not None and len(parts) >= min(exp, self.max_nodes)
        if not hinted and now - last_added < self.cfg.settle:
            return self.cfg.settle - (now - last_added) + 0.01
        if parts[0] != self.node_id:
            return None  # our view of the order is stale; the watchers will catch up
        record = {
            "state": "closed",
            "round": target,
            "participants": parts,
            "addrs": [joins[n].get("addr") for n in parts],
            "master_addr": joins[parts[0]].get("addr"),
            "master_port": int(joins[parts[0]]["port"]),
            "leader": self.node_id,
            "t": time.time(),
        }
        key = self.keys.round(target)
        cur = rounds.get(target)
        try:
            if cur is None:
                r = client.write(key, json.dumps(record), "record", prevExist=False)
            else:
                r = client.write(
                    key, json.dumps(record), "record", prevIndex=self._rounds.modified_index(key)
                )
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return None  # someone else wrote it; the rounds watch brings it
        self._event(f"closed round {target} with {len(parts)}")
        with self._cond:
            if self._rounds is not None:
                self._rounds.items[key] = (json.dumps(record), int(r.createdIndex))
                self._rounds.index = max(self._rounds.index, int(r.modifiedIndex))
            old = [k for k in rounds if k < target]
            self._cleanup.append(lambda c: self._gc(c, target, old))
            self._bump()
        return None

    def _gc(self, client: Client, target: int, old: list[int]) -> None:
        """After closing ``target``: older round keys expire (silently) later; old joins/stores go."""
        for r in old:
            try:
                client.write(
                    self.keys.round(r), None, "cleanup", ttl=self.cfg.record_ttl, refresh=True, prevExist=True
                )
            except etcd.EtcdKeyNotFound:
                pass
        for key in (self.keys.joins(target - 1), self.keys.store(target - 2)):
            try:
                client.delete(key, "cleanup", recursive=True)
            except etcd.EtcdKeyNotFound:
                pass
