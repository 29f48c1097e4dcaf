"""A node that cannot train: the agent's side of ``culprit.py``. This node's failure in a round,
written beside the round (``failurebook.py``); the round's culprit, settled by the first node
whose grace ended; whether the same failure again is a deterministic error of the script or this
node's own; and the node's exclusion once ``exclude_after`` failed rounds in a row began on it.

A mixin of :class:`petctl_agent.elastic.agent.PetctlElasticAgent`, whose state it shares.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.elastic.culprit import Failure, can_begin, failure_time, first_failure, own_error
from petctl_agent.elastic.failurebook import FailureBook
from petctl_agent.elastic.failures import RepeatWatch
from petctl_agent.elastic.handlers import ours
from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.elastic.outcome import Outcome
from petctl_agent.elastic.stopping import WorkerStops

log = logging.getLogger("petctl_agent.elastic")

#: seconds past the failure grace that a node whose failure record is the round's only one waits
#: for a peer's, before it names nobody (culprit.py: a failure that did not spread names nobody)
CULPRIT_WAIT = 2.0


class Exclusion:
    """The culprit and exclusion side of :class:`~petctl_agent.elastic.agent.PetctlElasticAgent`
    (see the module docstring)."""

    pub: StatusPublisher
    instance_id: str | None
    #: K: failed rounds in a row that began on this node before it leaves the job for good; 0: never
    exclude_after: int
    #: the culprit record that excluded this node (Outcome.EXCLUDED)
    excluded: dict[str, Any] | None
    #: the failures of the round whose culprit was settled last (for :meth:`_not_a_repeat`)
    _round_failures: list[Failure]
    _exit_seen_at: float | None
    repeats: RepeatWatch
    stops: WorkerStops
    watch: MembershipWatch
    step_info: Callable[[], dict[str, Any]]
    leave_requested: threading.Event
    phase: str
    outcome: Outcome | None
    fail_reason: str | None
    _worker_group: WorkerGroup

    if TYPE_CHECKING:  # the agent's, and torch's

        def _last_step(self) -> Any: ...
        def leave_rendezvous(self) -> None: ...
        def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None: ...

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
