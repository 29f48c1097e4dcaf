"""The leader's two jobs, in the control thread (:class:`Leading`, a mixin of the handler):
while round r runs, open round r+1 when a participant is gone or newcomers are ready
(:func:`.decide.open_round`, a txn on the marker's absence); while round r+1 forms, close it
(:func:`.decide.close`, :func:`.record.publish_round` guarded by the open marker's
``mod_revision``). What it sees comes from its watches of ``nodes/``, the rounds and the joins;
who leads is :mod:`.leader`'s. See docs/rendezvous.md, "Protocol" and "Closing a round".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any

from petctl_agent.rendezvous import decide, etcd_ops
from petctl_agent.rendezvous.lapse import LAPSE_AFTER, LeaseReads
from petctl_agent.rendezvous.layout import head, key_name, latest_closed, loads
from petctl_agent.rendezvous.membership import MemberView
from petctl_agent.rendezvous.record import MARKER_IDS, _came_back, _order_from_joins, next_seq, publish_round
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")

#: how long the leader holds ready newcomers for a read of the size hint's source that began after
#: the first was ready (CapacityHint.fresh: at most its ``min_interval``, 1 s, plus one API call)
HINT_FRESH_WAIT = 3.0
#: how often it looks whether that read came back
HINT_FRESH_POLL = 0.05


class Leading(LeaseReads):
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): what the leader does in the control thread."""

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
