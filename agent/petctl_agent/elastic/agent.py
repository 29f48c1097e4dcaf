"""petctl's ``LocalElasticAgent``: one node's worker group through joins, drains and failures.

We drive torch's own ``LocalElasticAgent`` + ``WorkerSpec`` (not a home-made
launcher) and override a few hooks to (a) publish status/events, (b) run the
drain protocol and leave the rendezvous without closing it for everyone, and
(c) work around torch behaviours that stall elastic jobs. Every workaround names
the torch behaviour it answers and can be switched off (see ``petctl_agent/workarounds.py``).

This module holds the torch hooks, in the order torch calls them (``run`` -> ``_rendezvous`` ->
``_start_workers`` -> ``_invoke_run``'s loop -> ``_restart_workers`` / ``_stop_workers``), and the
state they share. The agent's other parts are mixins of :class:`PetctlElasticAgent` over that
state: the restart budget (``restarts.py``), a node that cannot train (``exclusion.py``), a
membership change or stall while training (``changes.py``), the drain and leave (``leaving.py``),
our workers' processes and signals (``processes.py``). The parts that need none of the state are
plain modules: handlers (``handlers.py``), how long to keep joining (``joining.py``), membership
while training (``membership.py``), how the workers are stopped and waited for (``stopping.py``),
the pure decisions (``decisions.py``), what :meth:`PetctlElasticAgent.run` returns
(``outcome.py``), why workers failed, in their words (``failures.py``), torch's worker-exit log
lines (``tracebacks.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.changes import Changes
from petctl_agent.elastic.culprit import Failure
from petctl_agent.elastic.exclusion import Exclusion
from petctl_agent.elastic.exitwatch import ExitWatch, exit_fds
from petctl_agent.elastic.failures import RepeatWatch
from petctl_agent.elastic.handlers import LeftRendezvous, guard_join, join_timeout_s, ours
from petctl_agent.elastic.joining import join_round
from petctl_agent.elastic.leaving import Leaving
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome
from petctl_agent.elastic.processes import WorkerProcesses, own_signal_handlers
from petctl_agent.elastic.restarts import RestartBudgetSpent, Restarts
from petctl_agent.elastic.stall import StallWatch
from petctl_agent.elastic.stopping import WorkerStops
from petctl_agent.settings import Settings

log = logging.getLogger("petctl_agent.elastic")


class PetctlElasticAgent(Restarts, Exclusion, Changes, Leaving, WorkerProcesses, LocalElasticAgent):
    """torch's LocalElasticAgent plus petctl's drain protocol, status and stall workarounds.

    :meth:`run` returns an :class:`Outcome`; :attr:`fail_reason` says why for the failures.
    :meth:`request_leave` (any thread) drains the workers, or leaves a round being joined.

    Restart budget (``WorkerSpec.max_restarts``): only worker failures that no membership change
    explains spend it (``restarts.py``).
    """

    # class defaults too: a stop of an agent built without __init__ (tests) has them
    after_workers_stopped: Callable[[], None] | None = None
    _restarting = False
    _exit_seen_at: float | None = None

    def __init__(
        self,
        spec: Any,
        logs_specs: Any,
        publisher: StatusPublisher,
        drain_file: Path,
        progress_file: Path,
        drain_timeout: float,
        exit_barrier_timeout: float = 120,
        join_timeout: float = 1800,
        capacity_probe: Callable[[], dict[str, int] | None] | None = None,
        min_nodes: int = 1,
        start_method: str = "spawn",
        step_info: Callable[[], dict[str, Any]] | None = None,
        settings: Settings = Settings(),
        failure_file: Path | None = None,
        instance_id: str | None = None,
        exclude_after: int | None = None,
    ) -> None:
        super().__init__(
            spec, logs_specs, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout
        )
        self.pub = publisher
        self.settings = settings
        #: named in a failure's reason (``rank 0 on i-0abc exit 1: ...``)
        self.instance_id = instance_id or publisher.doc.get("instance_id")
        #: the last charged failure's signature: the same one again, with no membership change in
        #: between, is deterministic and ends the job (failures.py, :meth:`_on_workers_stopped`)
        self.repeats = RepeatWatch()
        #: K: failed rounds in a row that began on this node before it leaves the job for good
        #: (culprit.py, :meth:`_exclude`); 0: never
        self.exclude_after = settings.exclude_after if exclude_after is None else max(0, exclude_after)
        #: when this generation's first worker exit was seen (the ExitWatch's wake; wall clock)
        self._exit_seen_at: float | None = None
        #: the culprit record that excluded this node (Outcome.EXCLUDED)
        self.excluded: dict[str, Any] | None = None
        #: the failures of the round whose culprit was settled last (for :meth:`_not_a_repeat`)
        self._round_failures: list[Failure] = []
        #: this node's workers' last failure, in their words (also the reason of a CLOSED outcome)
        self.last_failure: str | None = None
        self.stops = WorkerStops(drain_file, progress_file, settings.drain_probe, failure_file)
        #: no new step for a while: a peer that vanished without a reset (stall.py)
        self.stall = StallWatch(progress_file)
        #: when our workers were SIGTERMed for a membership change (the stop is then bounded:
        #: :meth:`_kill_after_grace`)
        self._sigterm_at: float | None = None
        #: our failing workers' processes may still be exiting: the next restart joins the round
        #: first and reaps them after (:meth:`_while_failing`)
        self._rendezvous_first = False
        self._rendezvoused = False
        self._stop_first = False  # ... and SIGTERMs the workers before it joins
        self._stop_bounded = False  # ... for a loss or stalled workers: LOSS_STOP_GRACE
        self._failing_seen = False  # the current workers' failure note was acted on
        #: called right before each (re)start of the workers (node/agent.py: flush the log tailer)
        self.before_workers_start: Callable[[], None] | None = None
        # called once the old workers are gone on the way to starting new ones (a restart, never a
        # leave): the node's memory snapshot is checked meanwhile (node/snapshots.py, verify)
        self.after_workers_stopped: Callable[[], None] | None = None
        #: called with (round store, group rank, group world size) once a round closed with us, before
        #: its workers start (node/snapshots.py, after_round: a joining node's snapshot fetch)
        self.after_round: Callable[[Any, int, int], None] | None = None
        self._restarting = False
        #: the loop's wait ends the moment a worker exits, not at its next look (exitwatch.py)
        self._exited = threading.Event()
        self._exit_watch = ExitWatch(self._wake_loop)
        self.drain_timeout = drain_timeout
        self.join_timeout = join_timeout_s(join_timeout, settings)
        self.watch = MembershipWatch(settings, publisher, self._last_step, self.join_timeout)
        self.capacity_probe = capacity_probe or (lambda: None)
        self.min_nodes = min_nodes
        #: () -> {"last_step", "last_checkpoint_step"} (what the status document shows)
        self.step_info = step_info or (lambda: {})
        self.leave_requested = threading.Event()
        self.leave_reason = ""
        self.phase = "init"  # init | rendezvous | running | draining | done
        self.outcome: Outcome | None = None  # set by _invoke_run when it returns
        self.fail_reason: str | None = None
        self._rdzv_reason = "initial"
        self._restarts = 0
        self._starting = False  # our workers have not stepped yet (the start-up lease reads)
        self._free_restarts = 0
        self.sync_timeout = settings.sync_timeout_for(drain_timeout)
        # torch 2.5-2.8 install their own SIGTERM/SIGINT handler every time workers start
        # (PContext.start); ours turn SIGTERM into a drain. Remember them to put them back.
        self._own_signal_handlers: dict[int, Any] = own_signal_handlers()

    def run(self, role: str = DEFAULT_ROLE) -> Outcome:  # type: ignore[override]
        """Run the worker group until this node is done here; never raises for a rendezvous error."""
        try:
            super().run(role)
        except LeftRendezvous as e:
            self.pub.event("drained", clean=True, phase="rendezvous", note=str(e), round=self.watch.round)
            return Outcome.DRAINED
        except RendezvousTimeoutError as e:
            self.fail_reason = (
                f"rendezvous timed out: fewer than min_nodes={self.min_nodes} nodes joined within "
                f"join_timeout {self.join_timeout:.0f}s" + (f"; {e}" if str(e) else "")
            )
            return Outcome.JOIN_TIMEOUT
        except RestartBudgetSpent as e:
            self.fail_reason = str(e)
            return Outcome.FAILED
        except RendezvousClosedError:
            self.fail_reason = "the rendezvous was closed by another node (job failed elsewhere)"
            if self.last_failure:  # ours failed too: say how, first (status quotes one line)
                self.fail_reason = f"{self.last_failure} (then {self.fail_reason})"
            return Outcome.CLOSED
        except Exception as e:  # noqa: BLE001 - reported as FAILED with its reason
            log.exception("elastic agent failed")
            self.fail_reason = f"{type(e).__name__}: {e}"
            return Outcome.FAILED
        return self.outcome or Outcome.FAILED

    # ---- rendezvous ------------------------------------------------------------------
    def _last_step(self) -> Any:
        try:
            return self.step_info().get("last_step")
        except Exception:  # noqa: BLE001 - status detail only
            return None

    def _no_space(self, line: str | None) -> None:
        """petctl-etcd: etcd refuses writes for space (``line``: what ``petctl status`` shows), or
        takes them again (None). From a handler thread; one event each way."""
        if line is not None:
            self.pub.event("rdzv_no_space", round=self.watch.round, detail=line[:400])
        else:
            self.pub.event("rdzv_space_ok", round=self.watch.round)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._rendezvoused:  # done by _restart_workers before it reaped the failing workers
            self._rendezvoused = False
            return
        self.phase = "rendezvous"
        handler = worker_group.spec.rdzv_handler
        mine = ours(handler)
        if self.leave_requested.is_set():
            if mine is not None:
                mine.leave()
            raise LeftRendezvous("asked to leave before joining the rendezvous")
        if mine is not None and mine.on_no_space is None:
            mine.on_no_space = self._no_space
        self.pub.update(state="RENDEZVOUS")
        self.pub.event(
            "rendezvous_start", reason=self._rdzv_reason, round=self.watch.round, step=self._last_step()
        )
        started = time.time()
        if mine is None:
            guard_join(handler, self.leave_requested)
        join_round(
            lambda: super(PetctlElasticAgent, self)._rendezvous(worker_group),
            handler,
            mine,
            self.leave_requested,
            join_timeout=self.join_timeout,
            min_nodes=self.min_nodes,
            capacity_probe=self.capacity_probe,
            retry=self.settings.enabled("RDZV_RETRY"),
            waiting=lambda reason: self.pub.update(reason=reason),
        )
        # the round closed with us: our peers count us in it. A leave that came meanwhile (a
        # SIGTERM the moment the round closed) still publishes it, then leaves it before any
        # worker starts: status and timeline show the round its peers counted
        leaving = mine is not None and self.leave_requested.is_set()
        self.watch.started(handler)
        back = self.watch.take_charge()
        if back and not leaving:  # a node that leaves spends nothing more here
            self._charge_false_loss(worker_group, back)
        world = worker_group.workers[0].world_size if worker_group.workers else None
        self.pub.update(reason=None, world_size=world, round=self.watch.round)
        self.pub.event(
            "rendezvous_done",
            round=self.watch.round,
            world_size=world,
            nodes=worker_group.group_world_size,
            group_rank=worker_group.group_rank,
            reason=self._rdzv_reason,
            started=started,
            seconds=round(time.time() - started, 3),
            **({"leaving": True} if leaving else {}),
        )
        if leaving:
            mine.leave()  # a no-op when request_leave left already (from the watcher thread)
            raise LeftRendezvous("asked to leave as the round closed")

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        mine = ours(worker_group.spec.rdzv_handler)
        if mine is not None and self.leave_requested.is_set():
            # a leave that came after _rendezvous looked (the round already published): leave
            # before any worker starts, not start them into a round this node's handler has left
            mine.leave()
            raise LeftRendezvous("asked to leave before the workers started")
        self.stops.workers_starting()
        self.stall.reset()
        self._failing_seen = False
        self._exit_seen_at = None
        self._rendezvoused = False  # consumed by now; never skip a later round's rendezvous
        if self.after_round is not None:
            try:
                self.after_round(worker_group.store, worker_group.group_rank, worker_group.group_world_size)
            except Exception as e:  # noqa: BLE001 - a speed-up only: the restore's own path remains
                log.debug("after_round: %s", e)
        if self.before_workers_start is not None:
            # torch rmtree()s and re-creates attempt_<n>/ when the restart count is unchanged:
            # read the last lines of the workers that just stopped before they are deleted
            # (with fast restarts the log tailer's next poll came too late: "step=103" lost).
            try:
                self.before_workers_start()
            except Exception as e:  # noqa: BLE001 - logs must never stop a restart
                log.debug("before_workers_start: %s", e)
        pids = super()._start_workers(worker_group)
        self._restore_signal_handlers()
        self.stops.workers_started()
        self.phase = "running"
        self.pub.update(state="RUNNING", restarts=self._restarts)
        try:
            # the newest step persisted on EFS: what a plain script loads; the helper may load a
            # newer one from memory (its EFS write under way), which snapshot_restored then says
            resume = self.step_info().get("last_checkpoint_step")
        except Exception:  # noqa: BLE001
            resume = None
        self.pub.event(
            "workers_started",
            round=self.watch.round,
            world_size=worker_group.workers[0].world_size,
            pids=list(pids.values()),
            step=resume,
            start_method=self._start_method,
        )
        mine = ours(worker_group.spec.rdzv_handler)
        if mine is not None:
            # until they step, a peer lost meanwhile leaves them waiting at process-group init,
            # not failing: the leader reads the leases (fastloss.py) as after a failure
            mine.workers_starting()
            self._starting = True
        self._exited.clear()
        try:
            self._exit_watch.watch(exit_fds(self._pcontext))
        except Exception as e:  # noqa: BLE001 - a speed-up only: the loop polls anyway
            log.debug("exit watch: %s", e)
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        if self._rendezvous_first:
            # our workers are failing (or told to stop) and their processes still exiting (the
            # kernel frees GiBs of state): join the next round meanwhile; they are reaped
            # (SIGTERM, waited for) before the new ones start, as always
            self._rendezvous_first = False
            if self._stop_first:
                self._stop_first = False
                self._sigterm_before_rendezvous()
            self._rendezvous(worker_group)
            self._rendezvoused = True
        self._restarting = True  # torch's restart: stop (after_workers_stopped), rendezvous, start
        try:
            super()._restart_workers(worker_group)
        finally:
            self._restarting = False

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        """torch's stop (SIGTERM, then SIGKILL after 30 s), bounded after a loss
        (:meth:`_kill_after_grace`); then, on a restart, ``after_workers_stopped``."""
        self._kill_after_grace()
        super()._stop_workers(worker_group, *args, **kwargs)
        restarting, self._restarting = self._restarting, False
        if restarting and self.after_workers_stopped is not None:
            try:
                self.after_workers_stopped()
            except Exception as e:  # noqa: BLE001 - a speed-up only: the restore checks for itself
                log.debug("after_workers_stopped: %s", e)

    # ---- main loop (replaces SimpleElasticAgent._invoke_run) -------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        wg = self._worker_group
        self._initialize_workers(wg)
        check_every = self.settings.membership_interval
        next_check = time.monotonic() + check_every
        while True:
            mine = ours(wg.spec.rdzv_handler)
            if mine is not None and wg.state == WorkerState.HEALTHY:
                # petctl-etcd's watches bring a membership change: wake up the moment one does,
                # and look at it on every pass (pending_change reads local state, no request)
                mine.wait_for_change(wg.spec.monitor_interval)
                next_check = 0.0
            else:
                self._exited.wait(wg.spec.monitor_interval)
            self._exited.clear()
            if self.leave_requested.is_set():
                return self._drain_and_leave(wg)
            result = self._monitor_workers(wg)
            wg.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self.phase = "done"
                self.outcome = Outcome.SUCCEEDED
                self._exit_barrier()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                done = self._on_workers_stopped(wg, result)
                if done is not None:
                    return done
                continue
            if result.state == WorkerState.HEALTHY and not self._failing_seen:
                note = self.stops.failure_noted()
                if note is not None:
                    self._failing_seen = True
                    result = self._while_failing(wg, note)
                    if result is None:
                        continue  # restarted for a membership change, the old processes reaped
                    wg.state = result.state
                if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                    done = self._on_workers_stopped(wg, result)
                    if done is not None:
                        return done
                    continue
            if result.state == WorkerState.HEALTHY and self._starting and self.stops.workers_progressed():
                self._starting = False
                if mine is not None:
                    mine.workers_running()  # they stepped: no more lease reads for the start-up
            if result.state == WorkerState.HEALTHY and not self._starting and mine is not None:
                self._check_stall(mine)
            if result.state == WorkerState.HEALTHY and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every
                change, can_sync = self.watch.change()
                if change:
                    done = self._membership_changed(wg, change, can_sync)
                    if done is not None:
                        return done
