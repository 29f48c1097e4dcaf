"""Leadership: which node leads, and the leader's two jobs in the control thread.

The leader is the first live node in rank order (the last round's participants, then
newcomers by registration). While round r runs it opens round r+1 when a participant is gone
or newcomers are ready (:func:`.decide.open_round`); while round r+1 forms it closes it
(:func:`.decide.close`) with a txn on the open marker's ``mod_revision``. It need not be in
the round itself (a straggling leader still closes rounds without itself). Every other node
watches only the leader's key. See docs/rendezvous.md, "Protocol".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from petctl_agent.rendezvous import decide, etcd_ops, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT, unexpected
from petctl_agent.rendezvous.layout import HEAD, Keys, head, key_name, latest_closed, loads
from petctl_agent.rendezvous.membership import MemberView
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")

#: a round open this long before the leader reads the leases of the nodes it waits for
LAPSE_AFTER = 1.0
#: the least time between two reads of one lease
LAPSE_POLL = 0.25
#: how many lease reads the leader has in flight at once (threads, each with its connection)
LEASE_READERS = 8
#: a lease read in a window that shows it renewed since the window opened: not read again in it
CLEARED = -math.inf
#: how long the leader holds ready newcomers for a read of the size hint's source that began after
#: the first was ready (CapacityHint.fresh: at most its ``min_interval``, 1 s, plus one API call)
HINT_FRESH_WAIT = 3.0
#: how often it looks whether that read came back
HINT_FRESH_POLL = 0.05
#: etcd's default ``--max-txn-ops``: the most operations one txn may carry (etcd-io/etcd#7976)
MAX_TXN_OPS = etcd_ops.MAX_TXN_OPS
#: ids of the open marker's ``waiting`` and ``gone`` lists (their counts are in ``n_waiting``, ``n_gone``)
MARKER_IDS = 16


def publish_round(
    etcd: v3.Client,
    keys: Keys,
    target: int,
    parts: list[str],
    record: dict[str, Any],
    cmp: list[dict[str, Any]],
    ops: list[dict[str, Any]],
) -> tuple[etcd_types.TxnResult, dict[str, Any]]:
    """Close round ``target`` with ``parts`` (rank order): each participant's rank in its own key
    ``ranks/<target>/<nonce>/<id>`` (batches of at most ``MAX_TXN_OPS`` puts, written before the
    record), then one txn guarded by ``cmp`` that writes the record (naming the nonce) and the full
    order (``members/<target>``), deletes round ``target - 2``'s ranks and order, and runs ``ops``
    (at most ``MAX_TXN_OPS - 4``). A leader that loses the race leaves rank keys only
    under a nonce no record names; they go with the round's other keys (``ranks/<target>/`` is
    deleted when round ``target + 2`` closes). Returns the txn's result and the record."""
    nonce = uuid.uuid4().hex[:12]
    puts = [etcd_ops.put_op(keys.rank(target, nonce, n), str(i)) for i, n in enumerate(parts)]
    for i in range(0, len(puts), MAX_TXN_OPS):
        etcd.txn([], puts[i : i + MAX_TXN_OPS])
    rec = {
        **record,
        "state": "closed",
        "round": target,
        "n": len(parts),
        "head": parts[:HEAD],
        "nonce": nonce,
    }
    ops = [
        etcd_ops.put_op(keys.round(target), json.dumps(rec)),
        etcd_ops.put_op(keys.members(target), json.dumps(parts)),
        etcd_ops.delete_op(keys.ranks(target - 2), prefix=True),  # every nonce's, a lost race's too
        etcd_ops.delete_op(keys.members(target - 2)),
        *ops,
    ]
    return etcd.txn(cmp, ops), rec


def read_rank(etcd: v3.Client, keys: Keys, target: int, rec: dict[str, Any], node_id: str) -> int | None:
    """This node's rank in closed round ``target`` (its record ``rec``); None: left out."""
    kv = etcd.get(keys.rank(target, str(rec.get("nonce", "")), node_id))
    return _rank(kv)


def read_current_rank(
    etcd: v3.Client, keys: Keys, target: int, rec: dict[str, Any], node_id: str
) -> tuple[int | None, bool]:
    """:func:`read_rank`, and whether round ``target + 1`` has closed since (one txn): a view
    that lags (a paused agent, a slow watch) can show ``target`` closed with us after the next
    round replaced it without us. Our rank key lives on until ``target + 2`` closes, so the
    rank alone would have us start workers for a round our peers have left."""
    r = etcd.txn(
        [],
        [
            etcd_ops.range_op(keys.rank(target, str(rec.get("nonce", "")), node_id)),
            etcd_ops.range_op(keys.round(target + 1)),
        ],
    )
    rank, nxt = r.responses
    assert isinstance(rank, etcd_types.RangeResult) and isinstance(nxt, etcd_types.RangeResult)
    replaced = bool(nxt.kvs) and loads(nxt.kvs[0].value).get("state") == "closed"
    return _rank(rank.kvs[0] if rank.kvs else None), replaced


def _rank(kv: etcd_types.KeyValue | None) -> int | None:
    if kv is None:
        return None
    try:
        return int(kv.text)
    except ValueError:
        return None


def _lease_in(value: str | None, ttl: int) -> tuple[int, int] | None:
    """A member's lease and its granted TTL from its value (None: the value does not say)."""
    try:
        d = json.loads(value) if value else {}
    except ValueError:
        d = {}
    if isinstance(d, dict) and d.get("lease"):
        return int(d["lease"]), int(d.get("ttl") or ttl)
    return None


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


class Leadership:
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

    def _lead(self, now: float) -> float | None:
        with self._cond:
            m = self._members
            if m is None or not m.current or self._rounds is None or not self._rounds.current:
                return None
            since = max(m.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            # we lost etcd ourselves (etcd paused, a partition): every lease may have expired, and
            # the live nodes are registering again; act on a read made after the grace, not before
            wait = self._cut_off(now)
            if wait is not None:
                return wait
            if self._reread_after_outage(m) is None:
                # until the new read lands, who leads is found from the old one (_presumed_leader)
                self._snap = MemberView({key_name(k): c for k, (_, c, _) in m.items.items()}, m.revision)
                self._members = Watcher(self, self.keys.nodes, True, 10.0).start()
                if self._joins is not None:
                    self._joins.stop()
                    self._joins = None
                return None
            if self._reread_after_outage(self._joins) is None:
                self._joins = None
            live = {key_name(k): c for k, (_, c, _) in m.items.items()}
            values = {key_name(k): v for k, (v, _, _) in m.items.items()}
            seen_at = {key_name(k): t for k, t in m.added_at.items()}
            rounds, closed = self._rounds_view()
            if closed:
                return None
            latest, rec = latest_closed(rounds)
            target = latest + 1
            jkey = self.keys.joins(target)
            if self._joins is not None and self._joins.key != jkey:
                self._joins.stop()
                self._joins = None
            if self._joins is None:
                self._joins = Watcher(self, jkey, True, 10.0).start()
                return None
            if not self._joins.current:
                return None
            joins = {key_name(k): loads(v) for k, (v, _, _) in self._joins.items.items()}
            ready = {key_name(k): self._joins.added_at.get(k, now) for k in self._joins.items}
            marker = rounds.get(target)
            members_rev = m.revision
            # a node's deadline runs from when we first saw it registered while this round forms:
            # one whose key goes and comes back (a flapping lease: registered again, seen anew)
            # keeps it, or it could hold the round until the others' join timeout
            key = (self._generation, target)
            if self._first_seen_for != key:
                self._first_seen.clear()
                self._first_seen_for = key
            for n, t in seen_at.items():
                self._first_seen[n] = min(t, self._first_seen.get(n, t))
            seen_at = {n: self._first_seen[n] for n in seen_at}
        if marker is None and not joins and rec is None:
            return None
        order = self._order_of(latest, rec)
        if rec is not None and marker is None:
            return self._maybe_open(now, latest, order, live, ready, values)
        if marker is None and not joins:
            return None
        with self._cond:
            opened_at = self._opened_at.setdefault(target, now)
        base = order if rec is not None else _order_from_joins(joins)
        seq = next_seq(rec, latest, joins)
        return self._try_close(now, target, opened_at, live, seen_at, joins, members_rev, base, values, seq)

    def _order_of(self, latest: int, rec: dict[str, Any] | None) -> list[str]:
        """The full rank order of closed round ``latest``: known if we closed it or read it
        before, else one read of ``members/<latest>`` (a leader that takes over)."""
        if rec is None:
            return []
        with self._cond:
            key = (self._generation, latest)
            got = self._order.get(key)
        if got is not None:
            return got
        kv = self._etcd.get(self.keys.members(latest))
        try:
            order = json.loads(kv.text) if kv is not None else None
        except ValueError:
            order = None
        if not isinstance(order, list):
            log.warning(
                "round %d: no member list (%s); using the record's head", latest, self.keys.members(latest)
            )
            return head(rec)
        with self._cond:
            self._order = {k: v for k, v in self._order.items() if k[0] == key[0] and k[1] >= latest - 1}
            self._order[key] = order
        return order

    def _maybe_open(
        self,
        now: float,
        latest: int,
        order: list[str],
        live: dict[str, int],
        ready: dict[str, float],
        values: dict[str, str] | None = None,
    ) -> float | None:
        """Leader of a running round: announce the next round when the membership changed (a
        participant whose lease is not kept alive after our workers failed is gone: fastloss.py)."""
        lapsed, due = self._lapsed_participants(now, latest, order, values or {})
        live = {n: c for n, c in live.items() if n not in lapsed}
        expected = self._expected()
        newcomers = [t for n, t in ready.items() if n not in order and n in live]
        gone = any(p not in live for p in order)  # opens at once, whatever the hint
        if expected is not None and expected <= len(order) and newcomers and not gone:
            # newcomers are ready but the hint expects no growth: it may predate the scale-out
            # (the handler reads it at most once a second, the agent's CapacityHint caches the
            # Auto Scaling API's answer for 5 s). Auto Scaling raises the desired capacity before
            # it launches an instance, so a read of the source that began after the first
            # newcomer was ready sees the scale-out: wait for one (it runs in the background;
            # the running nodes keep training), at most HINT_FRESH_WAIT, then go on with what we have
            since = min(newcomers)
            expected, pending = self._expected_fresh(since)
            if pending and now < since + HINT_FRESH_WAIT:
                return HINT_FRESH_POLL
        view = decide.OpenView(
            now, order, live, ready, self.max_nodes, expected, self.cfg.hint_wait, self.cfg.hint_max
        )
        got, again = decide.open_round(view)
        if got is None:
            if due is not None:
                again = min(again if again is not None else math.inf, max(0.0, due - time.monotonic()) + 0.01)
            return again
        waiting, gone = got
        marker = {
            "state": "open", "by": self.node_id,
            "waiting": waiting[:MARKER_IDS], "n_waiting": len(waiting),
            "gone": gone[:MARKER_IDS], "n_gone": len(gone),
        }  # fmt: skip
        key = self.keys.round(latest + 1)
        r = self._etcd.txn(
            [etcd_ops.compare(key, "create", "==", 0)], [etcd_ops.put_op(key, json.dumps(marker))]
        )
        if r.succeeded:
            self._event(f"opened round {latest + 1}: waiting={len(waiting)} gone={len(gone)}")
        return None

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
        with self._cond:
            memo = self._lapse_memo
            if self._lapse_target != target:
                memo.clear()  # (node, lease) -> when to read it again; inf: lapsed; CLEARED
                self._lapse_target = target
            if self._lapse_window != (after, since):
                # a new window, or a stall window became a failure's (or a round's close): the
                # next reads were timed for the other one; a lapse found stays one
                for k in [k for k, v in memo.items() if v != math.inf]:
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
            at = memo.get((n, lease), first)
            if at == math.inf:
                out.add(n)
            elif at == CLEARED:
                continue
            elif now < at:
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
                memo[(n, lease)] = math.inf
                out.add(n)
                self._event(f"lease of {n} not kept alive ({remaining}s of {granted}s left): not waited for")
                continue
            if since is not None and (remaining < 0 or decide.heard_since(remaining, granted, sent, since)):
                memo[(n, lease)] = CLEARED  # alive after the window opened (or ended: the watch says so)
                continue
            at = t + max(LAPSE_POLL, decide.lapse_recheck(remaining, granted, self.cfg.refresh, after))
            memo[(n, lease)] = at
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

    def _try_close(
        self,
        now: float,
        target: int,
        opened_at: float,
        live: dict[str, int],
        seen_at: dict[str, float],
        joins: dict[str, dict[str, Any]],
        members_rev: int,
        base: list[str],
        values: dict[str, str] | None = None,
        seq: int = 0,
    ) -> float | None:
        for n, j in joins.items():
            # joined, but its registration not seen yet (it is in flight on the other watch)
            if n not in live and int(j.get("reg", 0)) > members_rev:
                return None
        view = decide.CloseView(
            now=now, opened_at=opened_at, live=live, seen_at=seen_at, joined=set(joins), base=base,
            min_nodes=self.min_nodes, max_nodes=self.max_nodes, expected=self._expected(),
            settle=self.cfg.settle, join_window=self.cfg.join_window, straggler=self.cfg.straggler,
            stop_wait=self.cfg.stop_wait,
        )  # fmt: skip
        parts, again = decide.close(view)
        if parts is None and again is not None:
            # waiting for a registered node: a hard loss (SIGKILL) holds its key until its lease
            # expires; its lease read shows it is no longer kept alive (docs/rendezvous.md)
            if now < opened_at + LAPSE_AFTER and not self._known_lapsed(target):
                return min(again, opened_at + LAPSE_AFTER - now + 0.01)
            waited = [
                n for n in live
                if n not in joins and seen_at.get(n, opened_at) <= opened_at + self.cfg.join_window
            ]  # fmt: skip
            lapsed, due = self._lapsed(target, waited, values or {})
            if lapsed:
                parts, again = decide.close(dataclasses.replace(view, lapsed=lapsed))
            if parts is None and again is not None and due is not None:
                again = min(again, max(0.0, due - time.monotonic()) + 0.01)
        if parts is None:
            return again
        left_out = sorted(n for n in live if n not in joins)
        record = {
            "master_addr": joins[parts[0]].get("addr"),
            "master_port": int(joins[parts[0]]["port"]),
            "leader": self.node_id,
            "seq": seq or target,
        }
        key = self.keys.round(target)
        with self._cond:
            cur = self._rounds.items.get(key) if self._rounds is not None else None
            prev = self._rounds.items.get(self.keys.round(target - 1)) if self._rounds is not None else None
        record.update(_came_back(cur[0] if cur else None, prev[0] if prev else None, parts))
        cmp = etcd_ops.compare(key, "mod", "==", cur[2]) if cur else etcd_ops.compare(key, "create", "==", 0)
        ops = [
            etcd_ops.delete_op(self.keys.joins(target - 1), prefix=True),
            etcd_ops.delete_op(self.keys.store(target - 2), prefix=True),
        ]
        if prev is not None:
            # only the record just replaced gets a TTL; older ones got theirs when they were replaced
            lid, _ = self._etcd.grant(self.cfg.record_ttl)
            ops.append(etcd_ops.put_op(self.keys.round(target - 1), prev[0], lease=lid))
        r, rec = publish_round(self._etcd, self.keys, target, parts, record, [cmp], ops)
        if not r.succeeded:
            return None  # someone else wrote it; the rounds watch brings it (our ranks: an unnamed nonce)
        self._event(
            f"closed round {target} with {len(parts)}" + (f", left out {left_out}" if left_out else "")
        )
        with self._cond:
            if self._rounds is not None and not self._rounds.stopped:
                self._rounds.items[key] = (json.dumps(rec), cur[1] if cur else r.revision, r.revision)
            # only the order of the round just closed is needed again (a leader closing every
            # round never misses the cache, where the other pruning happens)
            self._order = {(self._generation, target): parts}
            self._opened_at.pop(target, None)
            self._bump()
        return None


def _came_back(marker: str | None, prev_record: str | None, parts: list[str]) -> dict[str, Any]:
    """The record's ``returned`` and ``out`` (at most ``MARKER_IDS`` ids each, only when not empty).

    ``out``: nodes the opening marker named gone that are not in this round. ``returned``:
    participants of this round that were named gone by its marker, or are the previous round's
    ``out``: the same node id (the same agent process) came back within a round, so it was never
    lost (its agent stalled past the lease read, not dead). The agents charge the restart they
    took as free for that "loss" (docs/rendezvous.md, "A node named gone that comes back").
    """
    named_now = loads(marker).get("gone") if marker else None
    out_before = loads(prev_record).get("out") if prev_record else None
    gone = [str(n) for n in named_now] if isinstance(named_now, list) else []
    named = set(gone) | ({str(n) for n in out_before} if isinstance(out_before, list) else set())
    in_round = set(parts)
    got: dict[str, Any] = {}
    back = sorted(named & in_round)
    if back:
        got["returned"] = back[:MARKER_IDS]
    out = sorted(n for n in gone if n not in in_round)
    if out:
        got["out"] = out[:MARKER_IDS]
    # n_out: how many named gone are not in this round. A marker names at most MARKER_IDS ids:
    # the ones it did not list are counted out (not known to be back), so n_out > len(out) says
    # "not every one is known": an agent then never charges (docs/rendezvous.md)
    n_gone = loads(marker).get("n_gone") if marker else None
    n_out = len(out) + (max(0, n_gone - len(gone)) if isinstance(n_gone, int) else 0)
    if n_out:
        got["n_out"] = n_out
    return got


def _prev(j: dict[str, Any]) -> tuple[int, int, str | None] | None:
    """A join's ``prev``: ``[seq, rank, token]`` (the ``seq`` of the round it last ran in, its
    rank there, the boot token of the etcd that round ran on); ``[round, rank]`` from a node
    that predates them."""
    p = j.get("prev")
    if not isinstance(p, list) or len(p) not in (2, 3) or not all(isinstance(x, int) for x in p[:2]):
        return None
    token = p[2] if len(p) == 3 and isinstance(p[2], str) else None
    return p[0], p[1], token


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def next_seq(rec: dict[str, Any] | None, latest: int, joins: dict[str, dict[str, Any]]) -> int:
    """The ``seq`` of the round that follows closed round ``latest`` (its record ``rec``; None:
    no closed round in this etcd). Round numbers restart on every etcd, so they cannot be
    compared across a replacement; ``seq`` is a Lamport clock that can: one more than the
    newest round any participant ran in (``prev``) or saw closed (``seen``), on any etcd, and
    than this etcd's last round. With no replacement ever it equals the round number."""
    top = _int(rec.get("seq", latest)) if rec is not None else 0
    for j in joins.values():
        p = _prev(j)
        top = max(top, p[0] if p else 0, _int(j.get("seen")))
    return top + 1


def _order_from_joins(joins: dict[str, dict[str, Any]]) -> list[str]:
    """With no closed round in this etcd (a first round, or etcd replaced): the rank order each
    joined node remembers (``prev``), those of the newest round only. Newest by ``seq``, not by
    round number: after two replacements a node that last ran on the first etcd carries a round
    number of that etcd, which says nothing against the second one's. Two rounds with the same
    ``seq`` (on two etcds, no node of one having seen the other) are told apart by the etcd's
    boot token: the one most joined nodes ran in wins."""
    prevs = {n: p for n, p in ((n, _prev(j)) for n, j in joins.items()) if p is not None}
    if not prevs:
        return []
    top = max(p[0] for p in prevs.values())
    groups: dict[str | None, list[str]] = {}
    for n, p in prevs.items():
        if p[0] == top:
            groups.setdefault(p[2], []).append(n)
    _, best = max(groups.items(), key=lambda kv: (len(kv[1]), kv[0] or ""))
    return sorted(best, key=lambda n: (prevs[n][1], n))
