"""While our workers train: a stall that may hide a lost peer (the leases of the running round
read once per stall, ``stall.py``) and a membership change (``membership.py``), answered by a
free restart: the workers checkpoint at an agreed step and stop (a coordinated stop), or they are
SIGTERMed first and reaped once this node has joined the next round.

A mixin of :class:`petctl_agent.elastic.agent.PetctlElasticAgent`, whose state it shares; the
main loop that looks for both stays the agent's ``_invoke_run``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome
from petctl_agent.elastic.stall import StallWatch
from petctl_agent.elastic.stopping import WorkerStops
from petctl_agent.settings import Settings

log = logging.getLogger("petctl_agent.elastic")


class Changes:
    """The membership changes and stalls of :class:`~petctl_agent.elastic.agent.PetctlElasticAgent`
    (see the module docstring)."""

    pub: StatusPublisher
    settings: Settings
    stall: StallWatch
    stops: WorkerStops
    watch: MembershipWatch
    leave_requested: threading.Event
    phase: str
    outcome: Outcome | None
    sync_timeout: float
    _rdzv_reason: str
    _starting: bool  # our workers have not stepped yet (the start-up lease reads)
    #: the next restart joins the round first, SIGTERMs the workers before it joins (the stop
    #: bounded by LOSS_STOP_GRACE for a loss or stalled workers), and reaps them after
    _rendezvous_first: bool
    _stop_first: bool
    _stop_bounded: bool

    if TYPE_CHECKING:  # the agent's (its other mixins included), and torch's

        def _last_step(self) -> Any: ...
        def _free_restart(self, wg: WorkerGroup, reason: str) -> None: ...
        def _drain_and_leave(self, wg: WorkerGroup) -> RunResult: ...
        def leave_rendezvous(self) -> None: ...
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult: ...
        def _exit_barrier(self) -> None: ...

    def _check_stall(self, mine: Any) -> None:
        """Our workers stopped stepping (stall.py): the leases of the running round are read
        (``workers_stalled``), once per stall; a new step ends that. Never a restart by itself."""
        what = self.stall.poll()
        if what == "stalled":
            silence = self.stall.silence() or 0.0
            log.info("no new step for %.1fs: reading the participants' leases", silence)
            self.pub.event(
                "workers_stalled", round=self.watch.round, step=self._last_step(), seconds=round(silence, 2)
            )
            mine.workers_stalled()
        elif what == "resumed":
            mine.workers_running()

    def _membership_changed(self, wg: WorkerGroup, change: str, can_sync: bool) -> RunResult | None:
        """Restart for ``change`` (free); a RunResult only when the agent is done (the workers
        finished the job during a coordinated stop, or this node leaves meanwhile)."""
        log.info("re-rendezvous: %s", change)
        if self._starting or self.stall.stalled:
            # a round the start-up (or stall) lease reads opened: a node named gone
            # that comes back was stalled, not lost, and this restart is charged then
            self.watch.restart_for_a_loss()
        if can_sync and self.settings.enabled("SYNC_RESTART") and self.stops.workers_progressed():
            self._rdzv_reason = change
            done = self._coordinated_stop(wg, self.sync_timeout)
            if done is not None:
                return done
            if self.leave_requested.is_set():
                # a round is open and the others are stopping for it; this node will
                # not join it. Leave it now: its leader waits for a node of the last
                # round as long as a stop may take (stop_wait), a drain takes longer.
                # Our workers' checkpoint at the agreed step is in the old group,
                # whatever the membership says.
                self.leave_rendezvous()
                return self._drain_and_leave(wg)
        # the workers are stopped (SIGTERM) first and reaped after this node has
        # joined the next round: a process holding GiBs of state takes seconds to exit
        self._stop_first = True
        # bounded only for a loss (nodes named gone: no coordinated checkpoint) or
        # hung workers; a join keeps torch's stop (a script's SIGTERM checkpoint)
        self._stop_bounded = not can_sync or self.stall.stalled
        self._rendezvous_first = True
        self._free_restart(wg, change)
        return None

    def _coordinated_stop(self, wg: WorkerGroup, timeout: float) -> RunResult | None:
        """Ask the workers to checkpoint and stop; a RunResult only if they finished the job meanwhile."""
        result = self.stops.coordinated_stop(lambda: self._monitor_workers(wg), timeout, self.leave_requested)
        if result is None:
            return None
        self.phase = "done"
        self.outcome = Outcome.SUCCEEDED
        self._exit_barrier()
        return result
