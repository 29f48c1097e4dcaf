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
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from petctl_agent.rendezvous import etcd_ops, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT, unexpected
from petctl_agent.rendezvous.config import BOOT_TOKEN_KEY
from petctl_agent.rendezvous.layout import HEAD, Keys, head, key_name, latest_closed
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")

#: while etcd's NOSPACE alarm is noted, how often the control thread asks whether it still is (s)
NO_SPACE_RECHECK = 5.0
#: the oldest registrations a non-leader reads: the two it may need (read_membership says why)
#: and one that marks where the read stops (a tie on it is read whole)
OLDEST = 3


@dataclass(frozen=True)
class MemberView:
    """What a non-leader knows of ``nodes/`` (:func:`read_membership`): enough to find the
    leader and its successor, never every id.

    ``live`` holds every live node registered before ``below`` (all of them when ``below`` is
    None: the read saw the whole of ``nodes/``) and each id of the ``checked`` head that is
    live. Another id is *unknown*, not dead (:meth:`knows`)."""

    live: dict[str, int] = field(default_factory=dict)  #: node id -> registration (create) revision
    revision: int = 0  #: the store revision of the read
    checked: frozenset[str] = frozenset()  #: ids read one by one (the head at the read)
    below: int | None = None  #: every live node with a smaller create revision is in ``live``
    count: int = 0  #: keys under nodes/ at the read

    def knows(self, node: str) -> bool:
        """Whether ``live`` says if ``node`` is alive."""
        return self.below is None or node in self.live or node in self.checked


def read_membership(etcd: v3.Client, keys: Keys, base: list[str]) -> MemberView:
    """The read of ``nodes/`` a non-leader makes (at each registration, and when the leader's key
    goes): one read-only txn of the ``OLDEST`` keys by create revision plus one key per id of
    ``base`` (the last record's head, <= HEAD ids), keys only: at most ``OLDEST + HEAD`` keys
    whatever the membership's size. A second read only when the last key read shares its create revision
    with another one read (several keys put in one txn: never a handler's registration, which
    is one put): then every key of that revision, so ``live`` stays closed downwards.

    Why this is enough (tests/agent/test_rdzv_v3_members.py checks it against the full read,
    and fails with one key fewer or without the tie's read): ``live`` holds ``T``, every live
    node below a create revision (a down-set of the live nodes in ``(revision, id)`` order) and
    at least 2 of them unless it holds all. The leader is ``rank_order(base, live)[0]`` after
    ``us`` is added and at most one id ``R`` is dropped (a lapsed leader; for the successor the
    leader, with every ``base`` id taken as alive). A live ``base`` id not dropped answers, and
    each ``base`` id's liveness is read. Otherwise every live ``base`` id is ``R``, so ``T``
    minus ``base`` and ``R`` keeps one node or more, and its least is the full membership's
    least outside ``base`` and ``R``: a lesser one would be in ``T``. ``us`` is added with our
    own revision in both. So 2 suffice whatever the head's size. A head read later (a newer
    record) that this read did not check is taken as alive (``leader.presumed_leader``): at
    worst a follower watches a gone leader's key, sees it absent and reads again with the new
    head (``_follow``)."""
    base = list(dict.fromkeys(base))[:HEAD]
    oldest = etcd_ops.range_op(keys.nodes, prefix=True, limit=OLDEST, keys_only=True, sort="create")
    ops = [oldest, *(etcd_ops.range_op(keys.node(n), keys_only=True) for n in base)]
    r = etcd.txn([], ops)
    first, *heads = r.responses
    assert isinstance(first, etcd_types.RangeResult)
    kvs = list(first.kvs)
    below: int | None = None
    if first.more and kvs:
        below = kvs[-1].create_revision
        if sum(1 for kv in kvs if kv.create_revision == below) > 1:
            tied = etcd.range(keys.nodes, prefix=True, keys_only=True, revision=r.revision,
                              min_create=below, max_create=below)  # fmt: skip
            kvs += tied.kvs
            below += 1  # every key of that revision is read too
    live = {key_name(kv.key): kv.create_revision for kv in kvs if below is None or kv.create_revision < below}
    for n, got in zip(base, heads, strict=True):
        assert isinstance(got, etcd_types.RangeResult)
        if got.kvs:
            live[n] = got.kvs[0].create_revision
    return MemberView(live, r.revision, frozenset(base), below, first.count)


class Membership:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): registration, the keeper and control threads' start,
    the boot token."""

    def _client_error(self, e: BaseException) -> None:
        """Any thread's etcd error: a store revision that went back means a new etcd; a write
        refused for space means etcd's NOSPACE alarm is raised (:attr:`no_space`)."""
        if isinstance(e, v3.ClusterChanged):
            self._etcd_replaced(f"etcd replaced ({e})", forget_token=True)
        elif isinstance(e, v3.NoSpace):
            self._set_no_space(str(e))

    @property
    def no_space(self) -> str | None:
        """One line while etcd refuses writes for space (its NOSPACE alarm), else None. Every
        join and registration fails meanwhile: no round forms, and the handler retries."""
        return self._no_space

    def _set_no_space(self, detail: str | None) -> None:
        """Note the alarm (``detail``: the refused write) or its end (None); tell ``on_no_space``."""
        line = None
        if detail is not None:
            line = (
                f"etcd is out of space: {detail}; every write fails until its history is compacted, "
                "its database defragmented and its NOSPACE alarm disarmed (docs/rendezvous.md)"
            )
        with self._cond:
            was, self._no_space = self._no_space, line
            self._no_space_checked = time.monotonic()
        if (was is None) == (line is None):
            return
        if line is not None:
            log.error("%s", line)
            self._event("etcd out of space")
        else:
            log.warning("etcd takes writes again (its NOSPACE alarm is disarmed)")
            self._event("etcd has space again")
        hook = self.on_no_space
        if hook is not None:
            try:
                hook(line)
            except Exception:  # noqa: BLE001 - a status report only
                log.debug("on_no_space failed", exc_info=True)

    def _check_no_space(self) -> None:
        """While the alarm is noted: every ``NO_SPACE_RECHECK`` s, is it still raised? (the
        control thread; steady state writes nothing, so no refused write would say it ended)."""
        if self._no_space is None or time.monotonic() - self._no_space_checked < NO_SPACE_RECHECK:
            return
        try:
            raised = "NOSPACE" in self._etcd.alarms()
        except TRANSIENT:
            raised = True  # look again later
        if raised:
            self._no_space_checked = time.monotonic()
        else:
            self._set_no_space(None)

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
            [etcd_ops.compare(BOOT_TOKEN_KEY, "create", "==", 0)],
            [etcd_ops.put_op(BOOT_TOKEN_KEY, mine)],
            [etcd_ops.range_op(BOOT_TOKEN_KEY)],
        )
        if r.succeeded:
            return mine
        got = r.responses[0]
        assert isinstance(got, etcd_types.RangeResult)
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
        lease = v3.Lease(self._etcd, lid, ttl, self._lease_lost, interval=self.cfg.refresh,
                         outage=self.cfg.outage, on_error=self._client_error)  # fmt: skip
        with self._cond:
            old, self._lease = self._lease, lease
            if old is not None and lease.last_ok - old.last_ok >= self.cfg.outage:
                self._back_at = time.monotonic()  # registered again after an outage (_cut_off)
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

    def _cut_off(self, now: float) -> float | None:
        """Whether this node may act on what its watches show of the membership: None, or when
        to look again. Not while its own keepalives go unanswered (``cfg.outage``: it is cut
        off from etcd, or etcd is paused), nor within ``cfg.outage_grace`` after it reached etcd
        again (renewed, or registered again: :attr:`back`): when etcd paused or every node was
        cut off, every lease expired at once, and the live nodes are registering again."""
        lease = self._lease
        if lease is None:
            return None
        if now - lease.last_ok >= self.cfg.outage:
            return 0.25
        until = self.back + self.cfg.outage_grace
        return until - now + 0.05 if now < until else None

    @property
    def back(self) -> float:
        """When this node last reached etcd again after an outage (-inf: never, or an etcd
        replaced then: every node registers again as it sees the new boot token, and the leader
        waits ``reconnect_grace`` for that; the new etcd never held the old leases)."""
        lease = self._lease
        back = max(self._back_at, lease.back_at if lease is not None else float("-inf"))
        if self._replaced_at >= back - self.cfg.outage_grace:
            return float("-inf")
        return back

    def _reread_after_outage(self, w: Watcher | None) -> Watcher | None:
        """``w`` if it was read after the outage grace (or there was no outage); else None, after
        stopping it (the caller makes it again: a fresh read of what etcd holds now, not the
        events of the outage replayed on a connection that hung through it)."""
        if w is None:
            return None
        back = self.back
        if back == float("-inf") or w.read_at >= back + self.cfg.outage_grace:
            return w
        w.stop()
        return None

    def _snapshot(self) -> None:
        """Read what a non-leader needs of the membership to find the leader (:func:`read_membership`)."""
        with self._cond:
            rounds, _ = self._rounds_view()
            base = head(latest_closed(rounds)[1] or self._last_record)
        view = read_membership(self._etcd, self.keys, base)
        with self._cond:
            self._snap = view
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
            except Exception:  # noqa: BLE001 - see client.unexpected()
                unexpected(log, "re-registration")
                self._rereg.set()
                time.sleep(1.0)
