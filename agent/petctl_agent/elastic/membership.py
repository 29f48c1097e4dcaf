"""While workers train: has the job's membership changed, and is the rendezvous server reachable?

petctl-etcd answers from its watches (``pending_change()``: local state, no request, never
raises). torch's handlers are asked: nodes waiting to join, and, with ``MEMBERSHIP_WATCH``, the
round and participants compared with those the workers started with (torch itself only reacts
to waiting nodes). An etcd that goes away while the workers train is published once
(``rdzv_unreachable``) and its return too (``rdzv_recovered``); the workers never stop for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from threading import Event
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.handlers import dynamic, ours, rendezvous_config, reset_lost_state
from petctl_agent.settings import Settings

log = logging.getLogger("petctl_agent.membership")


class MembershipWatch:
    """Membership of the round this node's workers run in (``started`` at each rendezvous)."""

    def __init__(
        self, settings: Settings, pub: StatusPublisher, last_step: Callable[[], Any], join_timeout: float
    ) -> None:
        self.settings = settings
        self.pub = pub
        self.last_step = last_step
        self.join_timeout = join_timeout
        self.handler: RendezvousHandler | None = None
        self.round: int | None = None
        #: torch's dynamic handler only (MEMBERSHIP_WATCH compares it); None for petctl-etcd
        self.members: set[Any] | None = None
        #: petctl-etcd: rendezvous left in which the nodes named gone by the failure we restarted
        #: for free may come back (then that restart is charged: :meth:`take_charge`), and what
        #: is known of them (:class:`_Loss`)
        self._loss_rounds = 0
        self._loss: _Loss | None = None
        self._charge: list[str] = []
        self._last_etcd_warn = 0.0
        self._down_since: float | None = None  # etcd unreachable while training (event published)

    def started(self, handler: RendezvousHandler) -> None:
        """A round completed with us: remember its number and participants."""
        self.handler = handler
        mine = ours(handler)
        if mine is not None:
            # petctl-etcd: the round only. Its record holds no participant list (O(1): n, head,
            # master, nonce) and change() asks pending_change(), never a member set
            # a leave as the round closed cleared ``round`` (request_leave, another thread): the
            # round we left is the one our peers counted us in
            now = mine.round if mine.round is not None else mine.left_round
            before, self.round, self.members = self.round, now, None
            loss = self._loss
            if loss is not None and self._loss_rounds > 0:
                for r, rec in mine.records_since(before):
                    loss.see(r, rec)
                self._loss_rounds = 0 if loss.all_back() else self._loss_rounds - 1
                self._charge = loss.back_ids() if loss.all_back() else []
                if self._loss_rounds == 0:
                    self._loss = None
        h = dynamic(handler)
        if h is not None:
            st = h._state_holder.state
            self.round, self.members = st.round, set(st.participants)

    def change(self) -> tuple[str | None, bool]:
        """Why the worker group must re-form now (or None), and whether the current
        workers can still take a coordinated checkpoint first (all peers alive)."""
        handler = self.handler
        assert handler is not None
        mine = ours(handler)
        if mine is not None:
            # petctl-etcd: never raises, never makes a request; its watches heal by themselves
            self._note_reachable(mine.connected, "etcd watch disconnected")
            ch = mine.pending_change()
            if ch is None:
                return None, False
            gone = list(ch.get("gone") or [])
            waiting = list(ch.get("waiting") or [])
            why = f"{ch['reason']} (round {ch['round']}"
            why += f"; waiting: {len(waiting)}" if waiting else ""
            why += f"; gone: {', '.join(gone)}" if gone else ""
            # a coordinated checkpoint needs every participant: only when nobody is gone
            return why + ")", not gone
        try:
            waiting = handler.num_nodes_waiting()
        except Exception as e:  # noqa: BLE001
            if not self.settings.enabled("ETCD_OUTAGE"):
                raise  # torch: the exception escapes _invoke_run and the agent dies
            # The workers do not need etcd while they train: keep them running
            # through an etcd restart instead of failing the whole job.
            self._note_reachable(False, f"{type(e).__name__}: {e}")
            if time.monotonic() - self._last_etcd_warn > 10:
                log.warning("rendezvous backend unreachable while training (%s); workers keep running", e)
                self._last_etcd_warn = time.monotonic()
            reset_lost_state(handler)
            return None, False
        self._note_reachable(True, "")
        if waiting > 0:
            return f"{waiting} node(s) waiting to join", True
        h = dynamic(handler)
        if h is None or not self.settings.enabled("MEMBERSHIP_WATCH"):
            return None, False
        # torch only looks at the wait list; a participant that died or left is
        # noticed only when our workers' collectives fail -- which can take the
        # whole collective timeout when a peer died during worker start-up.
        st = h._state_holder.state
        # A participant that is gone cannot join a drain all-reduce: restart at once.
        if st.round != self.round:
            return f"rendezvous round moved on ({self.round} -> {st.round})", False
        members = set(st.participants)
        if self.members is not None and members != self.members:
            gone = sorted(str(n) for n in self.members - members)
            return f"participant(s) left: {', '.join(gone) or '?'}", False
        return None, False

    def failure_explained(self, leaving: Event, until: Callable[[], bool] | None = None) -> str | None:
        """Did the membership change around a worker failure (a peer died or left, a node is waiting)?

        A peer that died is dropped from the round only after the heartbeat expiry, while
        our workers' collectives fail at once. petctl-etcd is told (``workers_failed``): its
        leader reads the running round's leases and opens a round without a lost node within
        ~2-3 s (docs/rendezvous.md). Look for up to the expiry
        (``PETCTL_AGENT_FAILURE_GRACE``; default: petctl-etcd's key TTL + 1.5 s (7.5 s),
        torch's keep-alive x attempts + 2 s (7 s)). ``until``: also stop looking (None) once it
        says so (the failing workers' processes have exited).
        """
        mine = ours(self.handler) if self.handler is not None else None
        if mine is not None:
            # a hard loss: the leader reads the participants' leases now and opens a round naming
            # the lapsed ones gone (~2 s), instead of waiting for the lease to expire
            mine.workers_failed()
            default = mine.cfg.ttl + 1.5
        else:
            cfg = rendezvous_config(self.join_timeout, self.settings)
            default = cfg.get("keep_alive_interval", 5) * cfg.get("keep_alive_max_attempt", 3) + 2
        grace = self.settings.failure_grace
        deadline = time.monotonic() + (default if grace is None else grace)
        while True:
            change, _ = self.change()
            if change and not (mine is not None and _only_a_rejoin(mine.pending_change())):
                self.restart_for_a_loss()
                return change
            left = deadline - time.monotonic()
            if left <= 0 or leaving.is_set() or (until is not None and until()):
                return None
            if mine is not None and change:  # only a re-join: wait_for_change would not wait
                time.sleep(min(left, 0.1))
            elif mine is not None:
                mine.wait_for_change(min(left, 0.25))
            else:
                time.sleep(0.25)

    def restart_for_a_loss(self) -> None:
        """We restart for free because the pending change names nodes gone (a worker failure it
        explained, or the start-up lease reads while our workers had not stepped): if every one
        of them comes back (the same id) in the next round or the one after, none was lost, and
        the restart is charged (:meth:`take_charge`). One that does not come back was really
        lost, and explains the restart alone: free, whoever else came back."""
        mine = ours(self.handler) if self.handler is not None else None
        ch = (mine.pending_change() or {}) if mine is not None else {}
        if ch.get("n_gone"):
            self._loss_rounds = 2
            self._loss = _Loss(int(ch["round"]), [str(n) for n in ch.get("gone") or []], int(ch["n_gone"]))

    def take_charge(self) -> list[str]:
        """After :meth:`started`: the nodes whose "loss" explained the last worker failure (so the
        agent restarted for free), once every one of them is back with the same id (agents that
        stalled past the leader's lease read, no lost node). Non-empty: the agent charges the
        restart now. Each such failure is charged once."""
        back, self._charge = self._charge, []
        return back

    def _note_reachable(self, reachable: bool, detail: str) -> None:
        """Publish ``rdzv_unreachable`` / ``rdzv_recovered`` when etcd goes away / comes back
        while the workers train on (they do not need it)."""
        if not reachable and self._down_since is None:
            self._down_since = time.time()
            log.warning("rendezvous server unreachable while training (%s); workers keep running", detail)
            self.pub.event("rdzv_unreachable", round=self.round, step=self.last_step(), detail=detail[:200])
        elif reachable and self._down_since is not None:
            down = time.time() - self._down_since
            self._down_since = None
            log.info("rendezvous server reachable again after %.1fs", down)
            self.pub.event("rdzv_recovered", round=self.round, step=self.last_step(), seconds=round(down, 3))


class _Loss:
    """The nodes named gone for one free restart, and which of them came back (the records'
    ``returned``/``out``/``n_out``, docs/rendezvous.md "A node named gone that comes back").

    ``round``: the round the change's marker opened; its record says which named nodes are not
    in it (``out``, ``n_out``); a later record's ``returned`` says which of those came back.
    Every one back: the restart is charged. One never back (a real loss, or not known: more ids
    than a record lists): free."""

    def __init__(self, round_: int, named: list[str], n_named: int) -> None:
        self.round = round_
        self.named = set(named)
        self.complete = n_named <= len(self.named)  # the marker listed every id
        self.back: set[str] = set()
        #: named nodes not back yet, known once the record of ``round`` is seen (None: unknown)
        self.missing: set[str] | None = None
        self.seen_first = False

    def see(self, r: int, rec: dict[str, Any]) -> None:
        returned = {str(n) for n in rec.get("returned") or []}
        if r == self.round:
            out = {str(n) for n in rec.get("out") or []}
            n_out = rec.get("n_out", len(out))
            self.seen_first = True
            self.missing = out if isinstance(n_out, int) and n_out <= len(out) else None
            self.back |= returned & self.named
        elif r > self.round:
            if self.missing is not None:
                self.back |= returned & self.missing
                self.missing -= returned
            self.back |= returned & self.named

    def all_back(self) -> bool:
        if self.seen_first:
            return self.missing is not None and not self.missing and bool(self.back)
        return self.complete and bool(self.named) and self.named <= self.back

    def back_ids(self) -> list[str]:
        return sorted(self.back)


def _only_a_rejoin(ch: dict[str, Any] | None) -> bool:
    """A round opened only because a participant re-joined (no node gone, none waiting): after a
    genuine worker failure that is the first node whose grace ran out and that spent its restart;
    it explains nobody else's failure (every node whose workers failed charges it once)."""
    return (
        bool(ch)
        and ch.get("reason") == "a participant re-joined"
        and not (ch.get("n_gone") or ch.get("n_waiting") or ch.get("gone") or ch.get("waiting"))
    )
