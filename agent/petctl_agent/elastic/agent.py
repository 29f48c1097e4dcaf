"""petctl's ``LocalElasticAgent``: one node's worker group through joins, drains and failures.

We drive torch's own ``LocalElasticAgent`` + ``WorkerSpec`` (not a home-made
launcher) and override a few hooks to (a) publish status/events, (b) run the
drain protocol and leave the rendezvous without closing it for everyone, and
(c) work around torch behaviours that stall elastic jobs. Every workaround names
the torch behaviour it answers and can be switched off (see ``petctl_agent/workarounds.py``).
Handlers: ``handlers.py``; how long to keep joining: ``joining.py``; membership while
training: ``membership.py``; how the workers are stopped (drain file, SIGTERM) and waited for:
``stopping.py``; the pure decisions (exit codes, waiting below ``min_nodes``): ``decisions.py``;
what :meth:`PetctlElasticAgent.run` returns: ``outcome.py``; why workers failed, in their words,
and when a failure is deterministic: ``failures.py``; torch's worker-exit log lines: ``tracebacks.py``.

The class stays one module, in the order torch calls its hooks (``run`` -> ``_rendezvous`` ->
``_start_workers`` -> ``_invoke_run``'s loop -> restart / coordinated stop -> drain and leave):
they share one state (``phase``, ``leave_requested``, ``watch``, ``stops``), and the parts that
need none of it (joining, stopping, membership, decisions, handlers) are their own modules.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.culprit import Failure, can_begin, failure_time, first_failure, own_error
from petctl_agent.elastic.decisions import classify_exits
from petctl_agent.elastic.exitwatch import ExitWatch, exit_fds
from petctl_agent.elastic.failurebook import FailureBook
from petctl_agent.elastic.failures import RepeatWatch, describe, signature, stderr_paths, worker_errors
from petctl_agent.elastic.handlers import LeftRendezvous, guard_join, join_timeout_s, leave_round, ours
from petctl_agent.elastic.joining import join_round
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome
from petctl_agent.elastic.stall import StallWatch
from petctl_agent.elastic.stopping import WorkerStops
from petctl_agent.settings import Settings

log = logging.getLogger("petctl_agent.elastic")

#: seconds from the SIGTERM of a restart for a loss (nodes named gone) or of stalled workers to
#: the SIGKILL of workers still running (torch's own stop waits 30 s; a join keeps it): a process holding GiBs of state exits in 0.6 s/GiB idle, a few
#: seconds on a busy box (tests/agent/test_failing_worker.py: 6 s); one hung in a collective
#: whose Python SIGTERM handler cannot run never exits by itself
LOSS_STOP_GRACE = 10.0
#: seconds past the failure grace that a node whose failure record is the round's only one waits
#: for a peer's, before it names nobody (culprit.py: a failure that did not spread names nobody)
CULPRIT_WAIT = 2.0


def live_worker_pids(pc: Any) -> list[int]:
    """The pids of a torch ``PContext``'s workers that are still running (never one reaped, whose
    pid the kernel may have given to another process). Functions (the forkserver's
    ``run_script``): ``MultiprocessContext``; binaries: ``SubprocessContext``."""
    out: list[int] = []
    for proc in getattr(getattr(pc, "_pc", None), "processes", None) or []:
        if proc.is_alive():
            out.append(proc.pid)
    for handler in (getattr(pc, "subprocess_handlers", None) or {}).values():
        if handler.proc.poll() is None:
            out.append(handler.proc.pid)
    return out


class RestartBudgetSpent(Exception):
    """A restart taken as free (a node named gone) is charged once the node is back, and no
    restart is left: the agent fails, as after ``max_restarts`` worker failures."""


class PetctlElasticAgent(LocalElasticAgent):
    """torch's LocalElasticAgent plus petctl's drain protocol, status and stall workarounds.

    :meth:`run` returns an :class:`Outcome`; :attr:`fail_reason` says why for the failures.
    :meth:`request_leave` (any thread) drains the workers, or leaves a round being joined.

    Restart budget (``WorkerSpec.max_restarts``, torch's ``_remaining_restarts``): only
    worker failures that no membership change explains spend it. Joins, drains
    (``classify_exits``) and lost peers (the participants changed within the heartbeat
    expiry after the failure) restart for free.
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
        #: :meth:`_stop_workers`)
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
        self._own_signal_handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                h = signal.getsignal(sig)
                if callable(h) and h not in (signal.default_int_handler,):
                    self._own_signal_handlers[sig] = h

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
    def request_leave(self, reason: str) -> None:
        """Leave the job (drain while training; leave the round at once while joining one).

        With petctl-etcd a node inside ``next_rendezvous`` leaves from this (watcher) thread:
        ``handler.leave()`` deletes its membership key and ``next_rendezvous`` raises
        ``RendezvousLeftError``, which :meth:`_rendezvous` turns into :class:`LeftRendezvous`.
        (``phase`` is set before the leave request is read there, and the request is set
        before ``phase`` is read here: one of the two sides always sees the other.)
        """
        self.leave_reason = reason
        self.leave_requested.set()
        h = ours(self._worker_group.spec.rdzv_handler)
        if h is not None and self.phase == "rendezvous":
            h.leave()

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

    def _charge_false_loss(self, wg: WorkerGroup, back: list[str]) -> None:
        """The last worker failure was restarted for free because nodes were named gone (their
        leases read as not kept alive), but they are back in this round with the same id: they
        were never lost (an agent that stalled, e.g. a repeating OOM on its node). Charge that
        restart now, so that a crash loop spends the budget; none left: the job fails, as
        after ``max_restarts`` worker failures."""
        self._free_restarts = max(0, self._free_restarts - 1)
        if self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            log.warning(
                "the node(s) named gone after our workers failed are back (%s): charging that restart, "
                "%d of %d left", ", ".join(back), self._remaining_restarts, wg.spec.max_restarts,
            )  # fmt: skip
            return
        raise RestartBudgetSpent(
            f"workers failed after {wg.spec.max_restarts} restarts: the last failure was taken for "
            f"the loss of {', '.join(back)}, which came back (a crash loop, not a lost node)"
        )

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

    def _wake_loop(self) -> None:
        """A worker exited (ExitWatch's thread): the loop looks at the workers now."""
        if self._exit_seen_at is None:
            self._exit_seen_at = time.time()
        self._exited.set()
        mine = ours(self._worker_group.spec.rdzv_handler)
        if mine is not None:
            mine.wake()

    def _restore_signal_handlers(self) -> None:
        """Put our SIGTERM/SIGINT handlers back if torch replaced them while starting workers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._own_signal_handlers.items():
            if signal.getsignal(sig) is not handler:
                log.info("torch replaced the %s handler; re-installing the agent's", signal.Signals(sig).name)
                signal.signal(sig, handler)

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

    def _sigterm_before_rendezvous(self) -> None:
        """SIGTERM our workers before joining the next round (they exit meanwhile); the stop is
        bounded (:meth:`_stop_workers`) only for a loss (the change names nodes gone) or workers
        that stalled (hung in a collective): a join, a drain, a re-join keep torch's 30 s, which
        a script's own SIGTERM handler (saving a checkpoint) may need, and a rendezvous longer
        than the grace must not SIGKILL them at once."""
        self._signal_workers(signal.SIGTERM)
        self._sigterm_at = time.monotonic() if self._stop_bounded else None
        self._stop_bounded = False

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        """torch's stop (SIGTERM, then SIGKILL after 30 s), bounded after a loss: workers
        SIGTERMed before the rendezvous for a change that names nodes gone, or while they were
        stalled (:meth:`_sigterm_before_rendezvous`), get ``LOSS_STOP_GRACE`` from that SIGTERM,
        then SIGKILL. A worker hung in a collective with a lost peer (no reset on real AWS: gloo
        waits for its timeout, NCCL for its watchdog) whose script handles SIGTERM in Python never
        runs the handler (the main thread is inside the C++ wait): it held the restart for
        torch's 30 s."""
        at, self._sigterm_at = self._sigterm_at, None
        if at is not None:
            while live_worker_pids(self._pcontext) and time.monotonic() - at < LOSS_STOP_GRACE:
                time.sleep(0.05)
            if live_worker_pids(self._pcontext):
                log.warning(
                    "workers still running %.0fs after SIGTERM (hung in a collective?): SIGKILL",
                    LOSS_STOP_GRACE,
                )
                self._signal_workers(signal.SIGKILL)
        super()._stop_workers(worker_group, *args, **kwargs)
        restarting, self._restarting = self._restarting, False
        if restarting and self.after_workers_stopped is not None:
            try:
                self.after_workers_stopped()
            except Exception as e:  # noqa: BLE001 - a speed-up only: the restore checks for itself
                log.debug("after_workers_stopped: %s", e)

    def _signal_workers(self, sig: signal.Signals) -> None:
        """Send ``sig`` to our live workers without waiting (torch's close() sends the same and
        waits, after the rendezvous)."""
        for pid in live_worker_pids(self._pcontext):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

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

    def _free_restart(self, wg: WorkerGroup, reason: str) -> None:
        """Restart for a membership change: the restart budget is not touched."""
        self._free_restarts += 1
        self.repeats.reset()  # a failure after a membership change is no repeat of one before it
        self._rdzv_reason = reason
        self._restart_workers(wg)

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

    def _while_failing(self, wg: WorkerGroup, note: str) -> RunResult | None:
        """A worker wrote that it is failing (``worker.forkserver.note_failure``: a collective
        raised) and its process is still exiting -- 0.6 s for 1 GiB of state on an idle box,
        seconds on a busy one, all of it before torch reports the failure. Start the hard-loss
        lease reads now and watch for the membership change that explains it: found first, publish
        the failure, join that round while the processes exit, reap them, start (a free restart).
        The processes gone first: their result, for the usual path; no change within the grace
        (or a leave): HEALTHY, the main loop goes on and sees the exit. Only the usual path
        charges the restart budget, as before. None: restarted."""
        log.info("a worker is failing (%s): reading the participants' leases while it exits", note[:200])
        exited: list[RunResult] = []

        def gone() -> bool:
            r = self._monitor_workers(wg)
            if r.state != WorkerState.HEALTHY:
                exited.append(r)
            return bool(exited)

        why = self.watch.failure_explained(self.leave_requested, until=gone)
        if exited:
            return exited[0]
        if not why:  # the main loop waits for the exit (and the leave) as before
            return RunResult(state=WorkerState.HEALTHY)
        self.pub.event(
            "workers_failed", round=self.watch.round, exit_codes=[], failures=f"exiting: {note[:200]}",
            step=self._last_step(), exiting=True,
        )  # fmt: skip
        log.info("workers failing (%s) and %s: joining the next round while they exit", note[:120], why)
        self._rendezvous_first = True
        self._free_restart(wg, f"workers failed ({note[:120]}) after a membership change: {why}")
        return None

    def _describe_failures(self, result: RunResult) -> tuple[str, Any]:
        """The failed ranks in their own words (failures.py), and the failure's signature."""
        errors = worker_errors(result.failures, stderr_paths(self._pcontext))
        world = self._worker_group.workers[0].world_size if self._worker_group.workers else None
        return describe(errors, self.instance_id), signature(errors, self._last_step(), world)

    def _on_workers_stopped(self, wg: WorkerGroup, result: RunResult) -> RunResult | None:
        """Workers stopped with failures: a drain, a membership change, or a failure that
        spends the restart budget. The same failure twice in a row at the same point with no
        membership change in between ends the job at once (deterministic: failures.py). Returns
        a RunResult only when the agent is done."""
        codes = sorted({f.exitcode for f in result.failures.values()}, key=lambda c: (c is None, c))
        if classify_exits(f.exitcode for f in result.failures.values()) == "drain":
            # every failed worker stopped on purpose at a drain checkpoint (a node is
            # leaving or joining; siblings torch terminated after it count too): re-form.
            self._free_restart(wg, "coordinated checkpoint (peer drain/scale)")
            return None
        if self.leave_requested.is_set():
            return self._drain_and_leave(wg)
        # read before the restart: torch deletes attempt_<n>/ (the ranks' stderr) when it restarts
        # with an unchanged restart count
        failures, sig = self._describe_failures(result)
        self.last_failure = failures
        log.warning("workers failed: %s", failures)
        mine = self._failure(result, sig)
        self.pub.event(
            "workers_failed",
            round=self.watch.round,
            exit_codes=codes,
            failures=failures,
            step=self._last_step(),
            began_at=round(mine.t, 3),
        )
        book = self._write_failure(mine)
        why = self.watch.failure_explained(self.leave_requested)
        if why:
            log.info(
                "workers failed (exit codes %s) and %s: restarting, restart budget untouched", codes, why
            )
            self._free_restart(wg, f"workers failed (exit codes {codes}) after a membership change: {why}")
            return None
        if self.leave_requested.is_set():
            return self._drain_and_leave(wg)
        culprit = self._culprit(book, mine)
        if culprit is not None and culprit.get("node") == self.instance_id:
            if int(culprit.get("count") or 0) >= self.exclude_after > 0:
                return self._exclude(wg, culprit, failures)
        repeat = self.repeats.again(sig)
        if repeat and culprit is not None and self._not_a_repeat(mine, culprit):
            repeat = False
        if repeat and self._remaining_restarts > 0:
            log.error(
                "workers failed the same way at the same point as the last time, with no membership "
                "change in between: a deterministic error, not restarting (%d of %d restarts left unused)",
                self._remaining_restarts,
                wg.spec.max_restarts,
            )
            return self._fail_workers(
                wg, result, f"{failures} (the same error twice in a row at the same point, with no "
                "membership change: stopped, not restarted again)",
            )  # fmt: skip
        if self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            log.warning(
                "workers failed (exit codes %s), no membership change explains it: %d of %d restarts left",
                codes,
                self._remaining_restarts,
                wg.spec.max_restarts,
            )
            self._rdzv_reason = f"workers failed (exit codes {codes})"
            self._restart_workers(wg)
            return None
        return self._fail_workers(
            wg, result, f"{failures} (after {wg.spec.max_restarts} restarts: the restart budget is spent)"
        )

    # ---- a node that cannot train: culprit.py ------------------------------------------
    def _failure(self, result: RunResult, sig: Any) -> Failure:
        """This node's failure in this round, as it is written beside the round."""
        codes = [f.exitcode for f in result.failures.values()]
        noted_at = self.stops.failure_noted_at()
        try:
            ckpt = self.step_info().get("last_checkpoint_step")
        except Exception:  # noqa: BLE001 - progress unknown: no reset
            ckpt = None
        return Failure(
            node=str(self.instance_id),
            t=failure_time(noted_at, self._exit_seen_at, time.time()),
            begins=can_begin(codes, noted_at is not None),
            ckpt=ckpt if isinstance(ckpt, int) else None,
            error=sig[0] if sig else None,
        )

    def _write_failure(self, mine: Failure) -> FailureBook | None:
        """Write our failure beside the round (petctl-etcd with exclusion on); the book, or None."""
        if self.exclude_after <= 0 or self.watch.round is None:
            return None
        book = FailureBook.of(ours(self._worker_group.spec.rdzv_handler))
        if book is None:
            return None
        try:
            book.write(self.watch.round, mine)
            return book
        except Exception as e:  # noqa: BLE001 - the count only; the restart goes on
            log.warning("could not record this failure in etcd (ignored): %s", e)
            return None

    def _culprit(self, book: FailureBook | None, mine: Failure) -> dict[str, Any] | None:
        """The round's culprit record (its node and count), settled by the first node whose grace
        ended; None when unknown (exclusion off, another backend, etcd unreachable)."""
        if book is None or self.watch.round is None:
            return None
        try:
            failures = book.read(self.watch.round)
            # our peers' failures come a little after ours (their collectives fail once our workers
            # are gone) and are written at once, well within the grace; a peer slower than that is
            # waited for a little, not forever (one whose collective hangs never writes)
            nodes = getattr(self._worker_group, "group_world_size", None) or 2
            deadline = time.monotonic() + CULPRIT_WAIT
            while (
                nodes > 1
                and len({f.node for f in failures} | {mine.node}) < 2
                and time.monotonic() < deadline
                and not self.leave_requested.is_set()
            ):
                time.sleep(0.2)
                failures = book.read(self.watch.round)
            if not any(f.node == mine.node for f in failures):
                failures.append(mine)
            first = first_failure(failures)
            if first is None:
                return None
            rec = book.settle(self.watch.round, first)
        except Exception as e:  # noqa: BLE001
            log.warning("could not settle this round's culprit (ignored): %s", e)
            return None
        self._round_failures = failures
        log.info(
            "round %s's failure began on %s (%d failed round(s) in a row began there; exclusion after %d)",
            self.watch.round, rec.get("node"), int(rec.get("count") or 0), self.exclude_after,
        )  # fmt: skip
        return rec

    def _not_a_repeat(self, mine: Failure, culprit: dict[str, Any]) -> bool:
        """The deterministic-failure rule (failures.RepeatWatch) does not end the job for a failure
        that began on another node (ours failed because its collective did), nor for one that
        began here with an error no other node had (a bad node, which the count excludes at K)."""
        if culprit.get("node") != self.instance_id:
            log.info(
                "the same failure again, but it began on %s: not a deterministic error here", culprit["node"]
            )
            self.repeats.reset()
            return True
        if own_error(mine, self._round_failures):
            log.info(
                "the same failure again, and this node's alone: counted, not a deterministic error of the script"
            )
            return True
        return False

    def _exclude(self, wg: WorkerGroup, culprit: dict[str, Any], failures: str) -> RunResult:
        """Leave the job for good: ``exclude_after`` failed rounds in a row began on this node with no
        progress in between. The workers are gone already; leave the rendezvous as a drain does
        (never ``handler.shutdown()``: the others go on), then ``node.ending`` marks the instance
        Unhealthy (its group replaces it) and the agent exits."""
        count = int(culprit.get("count") or 0)
        reason = (
            f"excluded: {count} failed rounds in a row began on this node ({self.instance_id}) with no "
            f"new checkpoint in between (PETCTL_AGENT_EXCLUDE_AFTER={self.exclude_after}); the last: {failures}"
        )
        log.error("%s", reason)
        self.excluded = culprit
        self.pub.event(
            "excluded",
            node=self.instance_id,
            failures=count,
            round=self.watch.round,
            reason=reason,
            step=self._last_step(),
        )
        self._stop_workers(wg)
        self.leave_rendezvous()
        self.phase = "done"
        self.outcome = Outcome.EXCLUDED
        self.fail_reason = reason
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in wg.workers})

    def _fail_workers(self, wg: WorkerGroup, result: RunResult, reason: str) -> RunResult:
        """Stop for good: the job fails with ``reason`` (``Outcome.FAILED``)."""
        self._stop_workers(wg)
        wg.state = WorkerState.FAILED
        self.outcome = Outcome.FAILED
        self.fail_reason = reason
        return result

    def _coordinated_stop(self, wg: WorkerGroup, timeout: float) -> RunResult | None:
        """Ask the workers to checkpoint and stop; a RunResult only if they finished the job meanwhile."""
        result = self.stops.coordinated_stop(lambda: self._monitor_workers(wg), timeout, self.leave_requested)
        if result is None:
            return None
        self.phase = "done"
        self.outcome = Outcome.SUCCEEDED
        self._exit_barrier()
        return result

    # ---- graceful leave --------------------------------------------------------------
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
