"""The restart budget: which restarts spend it and which are free, and when workers that failed
are not restarted at all.

Only worker failures that no membership change explains spend ``WorkerSpec.max_restarts``
(torch's ``_remaining_restarts``). Joins, drains (``classify_exits``) and lost peers (the
participants changed within the heartbeat expiry after the failure) restart for free; a free
restart for nodes named gone that come back is charged after all (:class:`RestartBudgetSpent`
once none is left). The same failure twice in a row at the same point with no membership change
in between (``failures.RepeatWatch``) ends the job at once, as a spent budget does.

A mixin of :class:`petctl_agent.elastic.agent.PetctlElasticAgent`, whose state it shares.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.culprit import Failure
from petctl_agent.elastic.decisions import classify_exits
from petctl_agent.elastic.failurebook import FailureBook
from petctl_agent.elastic.failures import RepeatWatch, describe, signature, stderr_paths, worker_errors
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome

log = logging.getLogger("petctl_agent.elastic")


class RestartBudgetSpent(Exception):
    """A restart taken as free (a node named gone) is charged once the node is back, and no
    restart is left: the agent fails, as after ``max_restarts`` worker failures."""


class Restarts:
    """The restart accounting of :class:`~petctl_agent.elastic.agent.PetctlElasticAgent` (see the
    module docstring)."""

    pub: StatusPublisher
    instance_id: str | None
    exclude_after: int
    #: the last charged failure's signature: the same one again, with no membership change in
    #: between, is deterministic and ends the job
    repeats: RepeatWatch
    #: this node's workers' last failure, in their words (also the reason of a CLOSED outcome)
    last_failure: str | None
    watch: MembershipWatch
    leave_requested: threading.Event
    outcome: Outcome | None
    fail_reason: str | None
    _rdzv_reason: str
    _free_restarts: int
    _rendezvous_first: bool
    _remaining_restarts: int
    _pcontext: Any
    _worker_group: WorkerGroup

    if TYPE_CHECKING:  # the agent's (its other mixins included), and torch's

        def _last_step(self) -> Any: ...
        def _drain_and_leave(self, wg: WorkerGroup) -> RunResult: ...
        def _failure(self, result: RunResult, sig: Any) -> Failure: ...
        def _write_failure(self, mine: Failure) -> FailureBook | None: ...
        def _culprit(self, book: FailureBook | None, mine: Failure) -> dict[str, Any] | None: ...
        def _not_a_repeat(self, mine: Failure, culprit: dict[str, Any]) -> bool: ...
        def _exclude(self, wg: WorkerGroup, culprit: dict[str, Any], failures: str) -> RunResult: ...
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult: ...
        def _restart_workers(self, worker_group: WorkerGroup) -> None: ...
        def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None: ...

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

    def _free_restart(self, wg: WorkerGroup, reason: str) -> None:
        """Restart for a membership change: the restart budget is not touched."""
        self._free_restarts += 1
        self.repeats.reset()  # a failure after a membership change is no repeat of one before it
        self._rdzv_reason = reason
        self._restart_workers(wg)

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

    def _fail_workers(self, wg: WorkerGroup, result: RunResult, reason: str) -> RunResult:
        """Stop for good: the job fails with ``reason`` (``Outcome.FAILED``)."""
        self._stop_workers(wg)
        wg.state = WorkerState.FAILED
        self.outcome = Outcome.FAILED
        self.fail_reason = reason
        return result
