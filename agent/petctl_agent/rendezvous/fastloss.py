"""A hard loss seen from the data plane: when our workers fail, look at the running
round's leases at once instead of waiting for the dead node's lease to expire.

A SIGKILLed node's key lives on until its lease expires (the TTL, 6 s), but its peers'
collectives fail within a fraction of a second. The agent reports its workers' failure
(:meth:`FastLoss.workers_failed`); for a window as long as the agent waits for an explanation
(the TTL + 1.5 s), the leader of the running round reads its participants' leases
(``LeaseTimeToLive``, :func:`.decide.lapsed`) and opens the next round naming the lapsed ones
``gone``. A node silent for ``refresh + 1`` s (and longer than the leader's own silence) is
lapsed, so a hard loss opens the round ~1.5–3 s after the kill. If the leader is the silent one,
the node next in line reads the leader's lease, leads in its place, and does the same.

Only a worker failure, workers that have not yet reported a step since they started (a peer
lost during the start-up leaves them waiting at process-group init, not failing), or workers that
stopped stepping (:meth:`FastLoss.workers_stalled`: a peer that vanished without a reset, as a
real instance does, leaves their collectives hung, not failing; the agent's rule is in
``elastic/stall.py``) starts the reads: an agent or etcd paused 3 s while the workers train opens
no round (their workers keep stepping; a stall's window reads a lease lapsed only after 4.5 s of
silence, ``decide.stall_lapse_after``, so a 3 s pause of another agent meanwhile is ridden
through; a failure's or the start-up's: 2 s). O(N) reads on one node per window, none while the
workers step; a job whose steps exceed 4/3 s opens a stall window each step. A failure or a stall
follows the loss, so each kept-alive lease is read once in its window (a read that shows it
renewed since the window opened: ``_window_since``, lapse.py ``_lapsed``); the start-up window's
loss comes inside it, so its leases are read again whenever they could lapse. The round that
follows has ``gone`` non-empty, so the survivors' restart is free; a worker crash with every
lease kept alive opens nothing here, and the agent spends its restart budget as before. A node
named gone that comes back (the same id: its agent stalled, it was not lost) is listed in the
``returned`` of the round it rejoins (record.py, ``_came_back``); the agents charge that
restart once every node named gone for it has come back (per failure, not per round: a real loss
beside a stall stays free), so a crash loop with a stalling agent still spends the budget.
See docs/rendezvous.md, "A hard loss seen from the data plane".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from petctl_agent.rendezvous import decide
from petctl_agent.rendezvous.layout import key_name, latest_closed

log = logging.getLogger("petctl_agent.rendezvous")


class FastLoss:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state,
    ``_failed``, is made in the handler's ``__init__``)."""

    def workers_failed(self: Any) -> None:
        """Our workers failed in the running round (the agent calls this at once): for the next
        ``ttl + 1.5`` s the leader (or the node next in line) reads the participants' leases and
        opens the next round without the ones no longer kept alive. No request here."""
        with self._cond:
            if self._round is None or self._left:
                return
            now = time.monotonic()
            self._failed = (self._round, now + self.cfg.ttl + 1.5, now)
            self._starting = self._stalled = None
            self._event(f"workers failed in round {self._round}: reading the participants' leases")
            self._bump()

    def workers_starting(self: Any) -> None:
        """Our workers of the running round just started (the agent calls this at once): until
        they report a step (:meth:`workers_running`), at most ``ttl + 1.5`` s, read the leases
        as after a failure. Workers whose peer died while they started do not fail: they wait
        at process-group init for the dead rank (gloo, NCCL), so without this a loss during a
        re-rendezvous waited for the dead node's lease (6.8 s in bench_elastic). An agent paused
        for more than ``refresh + 1`` s in that window is read as lost: every node restarts
        workers that had not trained yet (no step lost; the paused node rejoins the next round).
        No request here. Ends the workers' stores served for earlier rounds: their workers
        here were reaped before these started."""
        self.end_old_stores()
        with self._cond:
            if self._round is None or self._left:
                return
            now = time.monotonic()
            self._failed = (self._round, now + self.cfg.ttl + 1.5, now)
            self._starting, self._stalled = self._round, None
            self._event(f"workers starting in round {self._round}: reading the participants' leases")
            self._bump()

    def workers_stalled(self: Any) -> None:
        """Our workers of the running round stopped making progress (no new step for the agent's
        stall time, ``elastic/stall.py``): a peer that vanished without a reset (a real instance
        lost: no RST) leaves them hung in a collective, failing nothing. For the next
        ``ttl + 1.5`` s, or until they step again (:meth:`workers_running`), read the leases as
        after a failure. A slow step, a long checkpoint, a paused agent or etcd: every lease reads
        kept alive (``decide.lapsed``'s margins) and nothing opens. No request here."""
        with self._cond:
            if self._round is None or self._left:
                return
            f = self._failed
            if f is not None and f[0] == self._round and f[1] >= time.monotonic():
                return  # a failure or start-up window is open: it reads the leases already
            now = time.monotonic()
            self._failed = (self._round, now + self.cfg.ttl + 1.5, now)
            self._stalled = self._round
            self._event(f"workers stalled in round {self._round}: reading the participants' leases")
            self._bump()

    def workers_running(self: Any) -> None:
        """Our workers reported a step: end the start-up window (:meth:`workers_starting`) or
        the stall window (:meth:`workers_stalled`); a failure window opened by
        :meth:`workers_failed` is left alone."""
        with self._cond:
            for r in (self._starting, self._stalled):
                if r is not None and self._failed is not None and self._failed[0] == r:
                    self._failed = None
            self._starting = self._stalled = None

    def _failure_round(self: Any, now: float) -> int | None:
        """The running round our workers failed in, while the window lasts (caller holds _cond)."""
        f = self._failed
        if f is None or now > f[1] or f[0] != self._round:
            return None
        return f[0]

    def _lapsed_participants(
        self: Any, now: float, latest: int, order: list[str], values: dict[str, str]
    ) -> tuple[frozenset[str], float | None]:
        """Leader of running round ``latest``: if our workers failed in it, those of its
        participants (``order``; live ones have ``values``) whose lease is no longer kept alive,
        and when to read the others again."""
        with self._cond:
            if self._failure_round(now) != latest:
                return frozenset(), None
            after, since = self._window_lapse_after(), self._window_since()
        others = [n for n in order if n != self.node_id and n in values]
        lapsed, due = self._lapsed(latest + 1, others, values, after, since)
        if lapsed:
            self._say_lapsed(latest, lapsed)
        return lapsed, due

    def _window_lapse_after(self: Any) -> float | None:
        """The silence that reads a lease lapsed in the open window (caller holds _cond): a stall
        (a weak signal: a slow step, a checkpoint, open for most of a slow job's steps) rides
        through a 3 s pause of another node's agent (``decide.stall_lapse_after``, 4.5 s); a
        failure or the start-up: None, ``decide.lapsed``'s ``refresh + 1`` (2 s)."""
        f = self._failed
        if self._stalled is not None and f is not None and f[0] == self._stalled:
            return decide.stall_lapse_after(self.cfg.refresh)
        return None

    def _window_since(self: Any) -> float | None:
        """When the open window opened, if for a loss before it (caller holds _cond): a failure or
        a stall follows the loss, so a lease renewed since was not lost and is read once in the
        window (lapse.LeaseReads._lapsed). None for the start-up window: a peer lost while the workers start
        is lost inside it, so its leases are read as long as it lasts."""
        f = self._failed
        if f is None or (self._starting is not None and f[0] == self._starting):
            return None
        return f[2]

    def _why_reading(self: Any) -> str:
        """What opened the lease-read window (caller need not hold _cond)."""
        with self._cond:
            if self._stalled is not None:
                return "our workers stalled"
            return "our workers are starting" if self._starting is not None else "our workers failed"

    def _say_lapsed(self: Any, rnum: int, lapsed: frozenset[str]) -> None:
        """Log once per round and set of nodes (INFO: the agent's log shows what found the loss)."""
        with self._cond:
            if self._said_lapsed == (rnum, lapsed):
                return
            self._said_lapsed = (rnum, lapsed)
        log.info(
            "round %d: lease of %s not kept alive (%s): opening the next round without it",
            rnum, ", ".join(sorted(lapsed)), self._why_reading(),
        )  # fmt: skip

    def _leader_after_failure(self: Any, now: float, w: Any) -> float | None:
        """Follower of a running round whose workers failed: if we are next in line, read the
        leader's lease; not kept alive (the leader is the lost node), we lead in its place (and
        then read the other participants' leases as the leader does)."""
        with self._cond:
            if self._failure_round(now) is None:
                return None
            leader = key_name(w.key)
            if self._successor(leader) != self.node_id:
                return None
            rnum = latest_closed(self._rounds_view()[0])[0]
            if rnum != self._round:
                return None
            if not w.items:
                return 0.0  # the leader's key went meanwhile: _follow looks again
            value = next(iter(w.items.values()))[0]
            after, since = self._window_lapse_after(), self._window_since()
        lapsed, due = self._lapsed(rnum + 1, [leader], {leader: value}, after, since)
        if not lapsed:
            return None if due is None else max(0.0, due - time.monotonic()) + 0.01
        with self._cond:
            self._lapsed_leader = (leader, rnum)
            self._bump()
        why = self._why_reading()
        self._event(f"leading in place of {leader} (its lease is not kept alive; {why})")
        self._say_lapsed(rnum, frozenset([leader]))
        return 0.0

    def _known_lapsed(self: Any, target: int) -> bool:
        """Whether a lease read for round ``target`` already found a node lapsed (caller need
        not hold _cond): the close need not wait ``LAPSE_AFTER`` to read leases again."""
        with self._cond:
            return self._lapse_target == target and any(
                v[0] == float("inf") for v in self._lapse_memo.values()
            )
