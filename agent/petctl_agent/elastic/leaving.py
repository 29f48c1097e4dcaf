"""This node leaving the job: a leave request from any thread (a SIGTERM, a scale-in, a spot
notice), the drain of our workers (drain file, or SIGTERM as torchrun does) and the leave of the
round, never closing the rendezvous for the nodes that go on.

A mixin of :class:`petctl_agent.elastic.agent.PetctlElasticAgent`, whose state it shares.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.handlers import leave_round, ours
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome
from petctl_agent.elastic.stopping import WorkerStops

log = logging.getLogger("petctl_agent.elastic")


class Leaving:
    """The leave and drain of :class:`~petctl_agent.elastic.agent.PetctlElasticAgent` (see the
    module docstring)."""

    pub: StatusPublisher
    leave_requested: threading.Event
    leave_reason: str
    phase: str  # init | rendezvous | running | draining | done
    outcome: Outcome | None
    stops: WorkerStops
    watch: MembershipWatch
    drain_timeout: float
    _worker_group: WorkerGroup

    if TYPE_CHECKING:  # the agent's, and torch's

        def _last_step(self) -> Any: ...
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult: ...
        def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None: ...

    def request_leave(self, reason: str) -> None:
        """Leave the job (drain while training; leave the round at once while joining one).

        With petctl-etcd a node inside ``next_rendezvous`` leaves from this (watcher) thread:
        ``handler.leave()`` deletes its membership key and ``next_rendezvous`` raises
        ``RendezvousLeftError``, which the agent's ``_rendezvous`` turns into ``LeftRendezvous``.
        (``phase`` is set before the leave request is read there, and the request is set
        before ``phase`` is read here: one of the two sides always sees the other.)
        """
        self.leave_reason = reason
        self.leave_requested.set()
        h = ours(self._worker_group.spec.rdzv_handler)
        if h is not None and self.phase == "rendezvous":
            h.leave()

    def _drain_and_leave(self, wg: WorkerGroup) -> RunResult:
        """Stop our workers for good, then leave the round.

        Workers that use the helper (something on this node reported progress, so they
        read the drain file) get the drain file: all ranks of all nodes checkpoint the
        same step and exit 75. Any other script (no progress within
        ``PETCTL_AGENT_DRAIN_PROBE`` s) -- and helper workers still running when the
        drain timeout is up -- gets SIGTERM, as torchrun does, and is waited for (the
        rest of the drain timeout, at least 5 s) before the node leaves the rendezvous.
        """
        self.phase = "draining"
        self.pub.update(state="DRAINING", reason=self.leave_reason)
        self.pub.event(
            "drain_requested", reason=self.leave_reason, round=self.watch.round, step=self._last_step()
        )
        d = self.stops.drain(
            lambda: self._monitor_workers(wg), [w.id for w in wg.workers], self.drain_timeout
        )
        self._stop_workers(wg)
        self.leave_rendezvous()
        self.phase = "done"
        self.outcome = Outcome.DRAINED
        self.pub.event(
            "drained",
            clean=d.clean,
            sigterm=d.sigterm,
            exit_codes=sorted(set(d.codes), key=lambda c: (c is None, c)),
            seconds=round(time.monotonic() - d.started, 3),
            round=self.watch.round,
        )
        # torch's run() records one event per worker and insists every worker has a result
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in wg.workers})

    def leave_rendezvous(self) -> None:
        """Remove this node from the current round so the others re-form at once
        (never ``handler.shutdown()``, which would close the rendezvous for everyone)."""
        if leave_round(self._worker_group.spec.rdzv_handler):
            log.info("left the rendezvous (round %s)", self.watch.round)
