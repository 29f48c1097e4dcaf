"""How this node's agent ends, and what that means for the job.

``LEFT`` (a graceful leave: complete the lifecycle action), ``FAILED`` (one line, published) and,
after the torch agent returned its ``Outcome``, :func:`finish`: who closes the rendezvous, who
scales the job's groups to zero, how long to wait for ``Terminating:Wait``. Exit status 0, 1 or,
for a terminal failure, one of ``petctl_agent.TERMINAL_EXITS`` (``node/failure.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from petctl_agent import EXIT_FAILED, EXIT_JOIN_TIMEOUT, EXIT_TERMINAL
from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.node import markers
from petctl_agent.node.lifecycle import Lifecycle

log = logging.getLogger("petctl_agent")

# In the job's checkpoint dir once any node saw the workers succeed, holding the run's id: a node
# of that run that arrives after the job ended finds the rendezvous closed and this file, and
# succeeds too (node/markers.py).
SUCCESS_MARKER = markers.SUCCESS_MARKER


def finish_leave(lifecycle: Lifecycle | None, pub: StatusPublisher | None, reason: str | None) -> int:
    """Complete a pending lifecycle action, publish LEFT; exit status 0."""
    if lifecycle is not None:
        lifecycle.complete_action()
    if pub:
        pub.update(state="LEFT", reason=reason)
        pub.close()
    return 0


def finish_excluded(lifecycle: Lifecycle, pub: StatusPublisher, reason: str | None) -> int:
    """This node left the job for good: failed rounds in a row began on it (elastic/culprit.py).
    It left the rendezvous as a drain does (the others go on); here it publishes ``LEFT`` with
    the reason, abandons a pending launch action and marks its instance ``Unhealthy``, so its
    group replaces it; exit status 0 (systemd does not restart it). When the mark fails on a node
    of a group, the last resort: power off (EC2 then counts it unhealthy and replaces it)."""
    pub.update(state="LEFT", reason=reason)
    pub.flush()
    if not lifecycle.launch_done.is_set():
        lifecycle.complete_launch("ABANDON")
    if not lifecycle.set_unhealthy() and lifecycle.spec.worker_group:
        lifecycle.power_off(reason or "excluded from the job")
    pub.close()
    return 0


def fail(pub: StatusPublisher | None, reason: str, rc: int = EXIT_FAILED, **event: Any) -> int:
    """Publish FAILED with its reason (and ``event``'s fields in the ``failed`` event); exit status ``rc``."""
    log.error("FAILED: %s", reason)
    if pub:
        pub.event("failed", reason=reason, **event)
        pub.update(state="FAILED", reason=reason)
        pub.flush()
    return rc


def finish(
    outcome: Any,
    fail_reason: str | None,
    handler: Any,
    ckpt_dir: Path,
    pub: StatusPublisher,
    lifecycle: Lifecycle,
    *,
    leave_reason: str | None,
    lifecycle_wait: float,
    last_step: Any,
) -> int:
    """What the torch agent's ``Outcome`` means for this node and for the job; the exit status."""
    from petctl_agent.elastic.outcome import Outcome

    if outcome is Outcome.DRAINED:
        return finish_leave(lifecycle, pub, leave_reason)
    if outcome is Outcome.EXCLUDED:
        return finish_excluded(lifecycle, pub, fail_reason)
    run_id = lifecycle.spec.run_id
    if outcome is Outcome.CLOSED and _succeeded_before(ckpt_dir / SUCCESS_MARKER, run_id):
        outcome = Outcome.SUCCEEDED  # we arrived after the job finished
    if outcome is Outcome.SUCCEEDED:
        markers.mark(ckpt_dir / SUCCESS_MARKER, run_id)
        try:
            if handler is not None:  # None: a live node, which used no torch rendezvous
                handler.shutdown()  # close the rendezvous: late joiners stop instead of waiting
        except Exception as e:  # noqa: BLE001
            log.debug("rendezvous shutdown: %s", e)
        pub.event("succeeded", last_step=last_step())
        # Zero first, then SUCCEEDED: the publisher thread sends a state change at once, so a
        # user (or a script) who sees SUCCEEDED must already see the groups at zero (under load a
        # reader once saw SUCCEEDED with desired still 2, the update call still in flight).
        scaled = lifecycle.scale_groups_to_zero()
        pub.update(state="SUCCEEDED", reason=None)
        _forget_ca_key(lifecycle)
        lifecycle.complete_action_at_end(lifecycle_wait)
        pub.close()
        if not scaled:
            # Exit 0 ends the unit for good (Restart=on-failure): nothing would end this instance
            # but kill-job. The last resort, after the bounded tries: power off.
            lifecycle.power_off("the job succeeded, but its groups could not be scaled to zero")
        return 0
    if outcome is Outcome.JOIN_TIMEOUT:
        # This node's rendezvous timed out. That alone does not end the job: other
        # nodes may be training (this one waited beyond max_nodes) or about to
        # arrive. Do not close the rendezvous, do not scale the groups to zero.
        rc = fail(pub, fail_reason or "rendezvous timed out", EXIT_JOIN_TIMEOUT)
        lifecycle.complete_action_at_end(0)
        pub.close()
        return rc
    try:
        if handler is not None:
            handler.shutdown()  # unrecoverable: close it so the other nodes stop too
    except Exception:  # noqa: BLE001
        pass
    # A failed job must not keep paying for idle instances (the ASG would replace them and
    # systemd would restart the agent): stop the groups; the status, logs and checkpoints stay.
    # Zero before FAILED is published, as for SUCCEEDED above. If that fails for good, the terminal
    # exit's give-up (petctl-agent-failed.service) powers the instance off, its own last resort.
    lifecycle.scale_groups_to_zero()
    # closed: the job failed elsewhere first (`petctl status` quotes that node's reason first)
    closed = {"closed": True} if outcome is Outcome.CLOSED else {}
    rc = fail(pub, fail_reason or "unknown failure", EXIT_TERMINAL, **closed)
    _forget_ca_key(lifecycle)
    lifecycle.complete_action_at_end(lifecycle_wait)
    pub.close()
    return rc


def _succeeded_before(marker: Path, run_id: str) -> bool:
    """A node of this run saw the workers succeed. A marker of an earlier run of the job's name
    is no success of this one; a spec without a run id (an older petctl) keeps the old rule."""
    return markers.of_run(marker, run_id) if run_id else marker.exists()


def _forget_ca_key(lifecycle: Lifecycle) -> None:
    """The job has ended and its groups are going to zero: its etcd CA key goes (cloud/jobend.py)."""
    from petctl_agent.cloud import aws
    from petctl_agent.cloud.jobend import forget_ca_key

    spec = lifecycle.spec
    forget_ca_key(spec, lambda service: aws.client(service, spec.region or None))
