"""Lapse detection: which registered nodes' leases are no longer kept alive, read by the leader
(or the node next in line, for the leader's lease) before the keys expire (:class:`LeaseReads`,
a mixin of the handler; the rule itself is :func:`.decide.lapsed`). Owns when each lease is read
(once per kept-alive lease in a window opened for a loss before it; as long as it is waited for
otherwise) and the reads themselves, together on a few threads. See docs/rendezvous.md, "A hard
loss is not waited for" and "Reads in a window".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from petctl_agent.rendezvous import decide
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT

#: a round open this long before the leader reads the leases of the nodes it waits for
LAPSE_AFTER = 1.0
#: the least time between two reads of one lease
LAPSE_POLL = 0.25
#: how many lease reads the leader has in flight at once (threads, each with its connection)
LEASE_READERS = 8


def _lease_in(value: str | None, ttl: int) -> tuple[int, int] | None:
    """A member's lease and its granted TTL from its value (None: the value does not say)."""
    try:
        d = json.loads(value) if value else {}
    except ValueError:
        d = {}
    if isinstance(d, dict) and d.get("lease"):
        return int(d["lease"]), int(d.get("ttl") or ttl)
    return None


class LeaseReads:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state,
    ``_lapse_memo``, ``_lapse_cleared``, ``_lapse_target``, ``_lapse_window``, ``_lease_pool``, is
    made in the handler's ``__init__``): the lease reads of the control thread."""

    def _lapsed(
        self,
        target: int,
        nodes: list[str],
        values: dict[str, str],
        after: float | None = None,
        since: float | None = None,
    ) -> tuple[frozenset[str], float | None]:
        """Of ``nodes`` (registered, not joined round ``target``), those whose lease is no longer
        kept alive (:func:`.decide.lapsed`; ``after``: the silence that is a lapse, None for
        ``refresh + 1``), and when to read the others again.

        ``since``: a window opened then for a loss before it (our workers failed or stalled): each
        lease is first read :func:`.decide.clear_after` later, and one whose read shows etcd
        renewed it since (:func:`.decide.heard_since`: every kept-alive lease) is not read again
        in the window; the others (the lost node, a keepalive late at the read) are read again no
        sooner than they could lapse. One read per kept-alive lease per window. None (a round
        that forms, the workers' start: a loss may come while it lasts): each lease is read again
        no sooner than it could lapse (:func:`.decide.lapse_recheck`), as long as it is waited for.

        The reads due go out together, ``LEASE_READERS`` at a time (each reader thread on its own
        keep-alive connection: etcd has no LeaseTimeToLive of several leases), not one by one."""
        own = self._lease
        if own is None:
            return frozenset(), None
        need = self.cfg.refresh + 1.0 if after is None else after  # the silence that is a lapse
        with self._cond:
            memo, cleared = self._lapse_memo, self._lapse_cleared
            if self._lapse_target != target:
                memo.clear()
                self._lapse_target = target
            if self._lapse_window != (after, since):
                cleared.clear()  # a new window, or none (a round that forms)
                if since is not None:  # a new window reads every lease from `first` on
                    for k in [k for k, v in memo.items() if v[0] != math.inf]:
                        del memo[k]
                self._lapse_window = (after, since)
        first = 0.0 if since is None else since + decide.clear_after(self.cfg.refresh)
        out: set[str] = set()
        due: float | None = None
        leases = self._leases_of(nodes, values)
        todo: list[tuple[str, int, int]] = []
        now = time.monotonic()
        for n in nodes:
            lease, granted = leases[n]
            if not lease:
                continue
            key = (n, lease)
            at, timed_for = memo.get(key, (0.0, 0.0))
            if at == math.inf:
                out.add(n)
                continue
            if key in cleared:
                continue
            # a read timed for a longer silence than the one in force now would be late: read now
            at = max(at if timed_for <= need else 0.0, first)
            if now < at:
                due = at if due is None else min(due, at)
            else:
                todo.append((n, lease, granted))
        error: BaseException | None = None
        for (n, lease, granted), got in zip(todo, self._read_leases([lease for _, lease, _ in todo])):
            if isinstance(got, BaseException):
                error = error or got  # read again on the next pass
                continue
            remaining, sent, t = got
            own_silence = t - (own.deadline - own.ttl)  # since our last successful keepalive was sent
            if decide.lapsed(remaining, granted, own_silence, self.cfg.refresh, after):
                memo[(n, lease)] = (math.inf, need)
                out.add(n)
                self._event(f"lease of {n} not kept alive ({remaining}s of {granted}s left): not waited for")
                continue
            if since is not None and (remaining < 0 or decide.heard_since(remaining, granted, sent, since)):
                # alive after the window opened (or ended: the watch says so): not read again in
                # it, nor in the round it opens before the lease could have ended (remaining + 1 s):
                # a node lost after this read is seen by its key's expiry, as one lost inside the
                # window is, and a node slow to re-join is not read each second it is waited for
                cleared.add((n, lease))
                memo[(n, lease)] = (t + max(LAPSE_POLL, remaining + 1.0), self.cfg.refresh + 1.0)
                continue
            at = t + max(LAPSE_POLL, decide.lapse_recheck(remaining, granted, self.cfg.refresh, after))
            memo[(n, lease)] = (at, need)
            due = at if due is None else min(due, at)
        if error is not None:
            raise error  # the control loop's retry (0.2 s); what was read is kept in the memo
        return frozenset(out), due

    def _leases_of(self, nodes: list[str], values: dict[str, str]) -> dict[str, tuple[int, int]]:
        """Each node's lease and granted TTL: from its value, or for a node whose value does not
        say (an agent that predates it), a read of its key (those together)."""
        out: dict[str, tuple[int, int]] = {}
        unknown: list[str] = []
        for n in nodes:
            got = _lease_in(values.get(n), self.cfg.ttl)
            if got is None:
                unknown.append(n)
            else:
                out[n] = got
        if unknown:
            out.update(zip(unknown, self._together(self._lease_of_key, unknown)))
        return out

    def _lease_of_key(self, node: str) -> tuple[int, int]:
        kv = self._etcd.get(self.keys.node(node))
        return (kv.lease if kv is not None else 0), self.cfg.ttl

    def _read_leases(self, leases: list[int]) -> list[tuple[int, float, float] | BaseException]:
        """``LeaseTimeToLive`` of each of ``leases``, together: ``(remaining, sent, answered)``
        (``time.monotonic``) or the read's error, in order."""
        if not leases:
            return []

        def read(lease: int) -> tuple[int, float, float] | BaseException:
            sent = time.monotonic()
            try:
                remaining, _ = self._etcd.time_to_live(lease)
            except TRANSIENT as e:
                return e
            return remaining, sent, time.monotonic()

        if len(leases) == 1:
            return [read(leases[0])]
        return self._together(read, leases)

    def _together(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` on the leader's lease-read threads, ``LEASE_READERS`` at once
        (made at the first reads; shut down with the watchers when the handler leaves)."""
        with self._cond:
            if self._left or self._stopping:
                raise v3.Unavailable("the handler left: no lease reads")
            if self._lease_pool is None:
                self._lease_pool = ThreadPoolExecutor(LEASE_READERS, thread_name_prefix="petctl-lease-read")
            pool = self._lease_pool
        try:
            return list(pool.map(fn, items))
        except RuntimeError as e:  # shut down meanwhile: the handler is leaving
            raise v3.Unavailable(f"no lease reads: {e}") from e
