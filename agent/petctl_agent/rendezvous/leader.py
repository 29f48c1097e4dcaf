"""Leadership: which node leads, and the control thread that acts on it.

The leader is the first live node in rank order (the last round's participants, then
newcomers by registration): :func:`first_live`, :func:`presumed_leader`, :func:`successor`.
The control thread (:class:`Leadership`, a mixin of the handler) finds who leads on each change;
the leader does its two jobs (:mod:`.leading`: open the next round, close the forming one); every
other node watches only the leader's key, and the node next in line reads the leader's lease
(:mod:`.lapse`) when a round waits for it. The leader need not be in the round itself (a
straggling leader still closes rounds without itself). See docs/rendezvous.md, "Protocol".
"""

from __future__ import annotations

import logging
import time

from petctl_agent.rendezvous import decide
from petctl_agent.rendezvous.client import TRANSIENT, unexpected
from petctl_agent.rendezvous.lapse import LAPSE_AFTER
from petctl_agent.rendezvous.layout import head, key_name, latest_closed
from petctl_agent.rendezvous.leading import Leading
from petctl_agent.rendezvous.membership import MemberView
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")


def first_live(
    base: list[str], live: dict[str, int], me: str, reg: int | None, drop: str | None = None
) -> str | None:
    """``rank_order(base, live + us - drop)[0]``: who leads among ``live`` (id -> registration)."""
    live = dict(live)
    if reg is not None:
        live.setdefault(me, reg)
    if drop is not None:
        live.pop(drop, None)
    if not live:
        return None
    return decide.rank_order(base, set(live), lambda n: live.get(n, 0))[0]


def presumed_leader(
    base: list[str], snap: MemberView, me: str, reg: int | None, newer: bool = False, drop: str | None = None
) -> str | None:
    """A non-leader's leader from its read of ``nodes/`` (``snap``) and the last record's head
    ``base``. ``newer``: the record is newer than the read, so its nodes were alive; a head id the
    read did not check (a record not seen at the read) is taken as alive too: if it is gone,
    its key's watch says so and ``_follow`` reads again (membership.read_membership says why
    the bounded read gives the full read's answer)."""
    live = dict(snap.live)
    for n in base:
        if newer or not snap.knows(n):
            live.setdefault(n, 0)
    return first_live(base, live, me, reg, drop)


def successor(base: list[str], snap: MemberView, me: str, reg: int | None, leader: str) -> str | None:
    """Who leads if ``leader`` is gone: the head's nodes taken as alive (they were, at the record)."""
    live = dict(snap.live)
    for n in base:
        live.setdefault(n, 0)
    return first_live(base, live, me, reg, leader)


class Leadership(Leading):
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): the control thread."""

    def _presumed_leader(self) -> str | None:
        """The first live node in rank order, as far as this node knows (caller holds _cond)."""
        rounds, _ = self._rounds_view()
        rnum, rec = latest_closed(rounds)
        base = head(rec or self._last_record)
        lapsed = self._lapsed_leader
        # the leader's lease is no longer kept alive (a hard loss): the next one leads until the
        # round closes (its record puts the survivors first: the next one still leads)
        drop = lapsed[0] if lapsed is not None and lapsed[1] == rnum and lapsed[0] != self.node_id else None
        if self._members is not None and self._members.synced:
            live = {key_name(k): c for k, (_, c, _) in self._members.items.items()}
            return first_live(base, live, self.node_id, self._reg_index, drop)
        rec_rev = rounds[rnum][1] if rnum in rounds else 0
        newer = bool(rec) and self._snap.revision < rec_rev
        return presumed_leader(base, self._snap, self.node_id, self._reg_index, newer, drop)

    def _successor(self, leader: str) -> str | None:
        """Who leads if ``leader`` is gone, as far as this node knows (caller holds _cond)."""
        rounds, _ = self._rounds_view()
        _, rec = latest_closed(rounds)
        return successor(head(rec or self._last_record), self._snap, self.node_id, self._reg_index, leader)

    def _control(self) -> None:
        """Background coordination: who leads, opening rounds on membership changes, closing rounds."""
        seen = -1
        wait: float | None = None
        while not self._stopping and not self._left:
            with self._cond:
                if self._version == seen:
                    self._cond.wait(timeout=wait if wait is not None else 1.0)
                seen = self._version
            try:
                self._check_no_space()
                wait = self._step(time.monotonic())
            except TRANSIENT as e:
                self._client_error(e)
                log.debug("control step failed: %s", e)
                wait = 0.2
            except Exception:  # noqa: BLE001 - see unexpected()
                unexpected(log, "control step")
                wait = 1.0

    def _step(self, now: float) -> float | None:
        """One pass of the control loop; returns when to look again (None: on the next change)."""
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
                m = self._members
                if m is not None and m.synced:
                    # stepping down: what the membership watch read is a full read of nodes/; a
                    # snapshot from before (without the node that leads) would have us lead
                    # again at once, and flip back and forth while no round closes
                    self._snap = MemberView({key_name(k): c for k, (_, c, _) in m.items.items()}, m.revision)
                for w in (self._members, self._joins):
                    if w is not None:
                        w.stop()
                self._members = self._joins = None
                lk = self.keys.node(leader) if leader else None
                if self._leader_w is not None and self._leader_w.key != lk:
                    self._leader_w.stop()
                    self._leader_w = None
                if lk and self._leader_w is None:
                    self._leader_w = Watcher(self, lk, False, 10.0).start()
        if not me:
            return self._follow(now)
        return self._lead(now)

    def _follow(self, now: float) -> float | None:
        with self._cond:
            w = self._leader_w
            if w is None or not w.synced or not w.connected:
                return None
            if self._cut_off(now) is None and self._reread_after_outage(w) is None:
                self._leader_w = None  # read the leader's key again (_step watches it anew)
                return 0.0
            alive = bool(w.items)
            if not alive:
                # we were cut off ourselves (etcd paused): the leader's lease may have expired
                # with everyone's; it registers again within the grace, as we do
                wait = self._cut_off(now)
                if wait is not None:
                    return wait
        if alive:
            # outside _cond: _watch_leader may read the leader's lease (an etcd request, up to
            # the request timeout when etcd is slow); the watchers, pending_change and the
            # agent's monitor need _cond meanwhile
            return self._watch_leader(now, w)
        with self._cond:
            if w is not self._leader_w or w.items:
                return 0.0  # changed meanwhile: look again
            since = max(w.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            if self._snapped_for == (w.key, w.revision):
                return 0.2  # already re-read the membership for this state of the leader's key
            self._snapped_for = (w.key, w.revision)
        # the leader's key is gone (its lease ended or it left): read the membership, recompute
        self._snapshot()
        return 0.0

    def _watch_leader(self, now: float, w: Watcher) -> float | None:
        """Joining while the leader's key lives: if we would lead without it and have waited
        ``LAPSE_AFTER``, read its lease; not kept alive (a hard loss of the leader), we lead."""
        if self._target is None:  # running: did our workers fail? (fastloss.py; reads a lease)
            return self._leader_after_failure(now, w)
        with self._cond:
            target = self._target
            if target is None:
                return None
            since = self._waiting_since
            if since is None or since[0] != target:
                since = self._waiting_since = (target, now)
            if now < since[1] + LAPSE_AFTER:
                return since[1] + LAPSE_AFTER - now + 0.01
            leader = key_name(w.key)
            if self._successor(leader) != self.node_id:
                return None
            rnum = latest_closed(self._rounds_view()[0])[0]
            if not w.items:
                return 0.0  # the leader's key went meanwhile: _follow looks again
            value = next(iter(w.items.values()))[0]
        lapsed, due = self._lapsed(target, [leader], {leader: value})
        if not lapsed:
            return None if due is None else max(0.0, due - time.monotonic()) + 0.01
        with self._cond:
            self._lapsed_leader = (leader, rnum)
            self._bump()
        self._event(f"leading in place of {leader} (its lease is not kept alive)")
        return 0.0
