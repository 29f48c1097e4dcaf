"""This instance in its Auto Scaling group: IMDS lifecycle state, warm pool, scale-in, job end.

What the agent reads (IMDS ``autoscaling/target-lifecycle-state``, ``spot/instance-action``)
and does (complete the termination lifecycle action, scale the job's groups to zero, read the
worker group's capacity) about the instance's place in its group. The Auto Scaling client comes
from ``petctl_agent.cloud.aws``; tests point it at moto or a stub.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from petctl_agent.cloud import aws
from petctl_agent.cloud.imds import Imds
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec

log = logging.getLogger("petctl_agent.lifecycle")

STATE_PATH = "meta-data/autoscaling/target-lifecycle-state"
#: The launch hook's heartbeats, as the boot's (user_data/common.sh.j2): every 300 s (the hook's
#: HeartbeatTimeout is 900 s), for at most 5400 s.
HEARTBEAT_EVERY = 300.0
HEARTBEAT_FOR = 5400.0
#: The termination (drain) hook's HeartbeatTimeout is the job's drain timeout, counted from the
#: instance's Terminating:Wait, which the agent sees an IMDS poll later; its drain may take the
#: whole drain timeout, then stops the workers (at least 5 s more), leaves the rendezvous and
#: completes the action. So the agent heartbeats the action every third of the drain timeout,
#: for at most twice the drain timeout plus DRAIN_HEARTBEAT_EXTRA s (AWS's own limit on an
#: action, 100 heartbeat timeouts or 48 h, is far beyond); a drain still running then is cut off
#: by the hook, and a hung agent never holds its instance (and its bill) longer.
DRAIN_HEARTBEAT_EXTRA = 300.0
#: Scaling the job's groups to zero at its end: a failed call is tried again after each of these
#: delays (each try is botocore's, with its own retries), about a minute in all; then the caller's
#: last resort (:meth:`Lifecycle.power_off`).
SCALE_TO_ZERO_DELAYS = (5.0, 15.0, 40.0)


def drain_heartbeat_plan(drain_timeout: float) -> tuple[float, float]:
    """(every, for) in seconds of the termination action's heartbeats for this drain timeout."""
    return max(drain_timeout / 3, 1.0), 2 * drain_timeout + DRAIN_HEARTBEAT_EXTRA


class CapacityHint:
    """The worker group's desired capacity, for petctl-etcd's ``expected_nodes`` hint.

    The handler calls it from its control thread (at most once a second), which must never
    wait on the Auto Scaling API: this returns the last value read at once and refreshes it
    in a background thread when it is older than ``max_age`` seconds. None until the first
    read succeeds, and whenever there is no worker group.

    ``fresh(since)`` is the leader's re-read when newcomers are ready but the hint expects no
    growth (docs/rendezvous.md): it reaches the source, not this cache; after a failed read
    (throttled) it starts none for ``max_age``, as the routine read does. Every read of the
    source, routine or fresh, starts at least ``min_interval`` after the one before (one read
    at a time, from one thread), so an agent makes at most ``1 / min_interval``
    DescribeAutoScalingGroups calls a second whatever its callers ask, and ``1 / max_age`` in
    steady state. The Auto Scaling API has one throttle bucket per account and Region for
    every call (its rate is not published); see docs/rendezvous.md for the bound.
    """

    def __init__(self, probe: Any, max_age: float = 5.0, min_interval: float = 1.0) -> None:
        self.probe = probe
        self.max_age = max_age
        self.min_interval = min_interval
        self.value: int | None = None
        #: how many reads of the source were made (tests, the bench)
        self.reads = 0
        self._tried_at = float("-inf")  # when the last read started (failed ones too)
        self._read_at = float("-inf")  # when the last successful read started: the value's age
        self._failed_at = float("-inf")  # when the last failed read started
        self._busy = threading.Lock()

    def __call__(self) -> int | None:
        if time.monotonic() - self._tried_at > self.max_age:
            self._start()
        return self.value

    def fresh(self, since: float) -> tuple[bool, int | None]:
        """``(True, value)`` once a read of the source that started at or after ``since``
        (``time.monotonic``) succeeded; else ``(False, the cached value)``, and such a read is
        started (at once, or ``min_interval`` after the last one began). Never blocks."""
        if self._read_at >= since:
            return True, self.value
        # a read that failed (throttled, the API down) backs off ``max_age``, as a routine one
        # does: asking again each second would spend a throttled account's bucket further
        if time.monotonic() - self._failed_at >= self.max_age:
            self._start()
        return False, self.value

    def _start(self) -> None:
        if self._busy.acquire(blocking=False):
            threading.Thread(target=self._refresh, name="petctl-capacity", daemon=True).start()

    def _refresh(self) -> None:
        try:
            time.sleep(max(0.0, self._tried_at + self.min_interval - time.monotonic()))
            t = self._tried_at = time.monotonic()
            self.reads += 1
            try:
                cap = self.probe()
            except Exception:
                self._failed_at = t
                raise
            self.value = None if cap is None else int(cap.get("desired", 0)) or None
            self._read_at = t
        except Exception as e:  # noqa: BLE001 - a hint only
            log.debug("capacity hint: %s", e)
        finally:
            self._busy.release()


def _knows(client: Any, operation: str, parameter: str) -> bool:
    """Whether ``client``'s botocore model has ``parameter`` in ``operation``'s input (setup.py
    admits a botocore older than some parameters; a refused one is a ParamValidationError before
    any request). A client without a botocore model (a test's fake) is taken to know it."""
    meta = getattr(client, "meta", None)
    if meta is None:
        return True
    return parameter in meta.service_model.operation_model(operation).input_shape.members


class Lifecycle:
    """The instance ``instance_id`` of the job ``spec`` in its Auto Scaling groups."""

    def __init__(self, spec: JobSpec, imds: Imds, settings: Settings, instance_id: str) -> None:
        self.spec = spec
        self.imds = imds
        self.settings = settings
        self.instance_id = instance_id
        #: the instance is in Terminating:Wait: our lifecycle action must be completed
        self.pending = False
        #: the launch action was completed (or abandoned): no more launch heartbeats
        self.launch_done = threading.Event()
        #: the termination action was completed (or its completion tried): no more drain heartbeats
        self.action_done = threading.Event()

    def _autoscaling(self) -> Any:
        return aws.client("autoscaling", self.spec.region or None)

    def state(self) -> str:
        """IMDS ``autoscaling/target-lifecycle-state``; absent (404: no group, or a group without
        a warm pool) or unreachable reads as ``InService``."""
        state = (self.imds.get(STATE_PATH) or "").strip()
        return state or "InService"

    def wait_while_warmed(self, leaving: Callable[[], bool], on_warmed: Callable[[str], None]) -> bool:
        """An instance of the group's warm pool never joins: wait until it is put in service.

        On AWS a warmed instance runs its boot (install, mount) and is stopped; started again
        for a scale-out, systemd starts the agent anew. The local cloud pauses the process tree
        (SIGSTOP) and resumes it (SIGCONT). Either way the agent goes on only once the target
        lifecycle state is no longer ``Warmed:*``; ``leaving()`` ends the wait early.
        ``on_warmed(state)`` is called once when the instance is warmed. Returns whether it was.
        """
        state = self.state()
        if not state.startswith("Warmed:"):
            return False
        t0 = time.monotonic()
        log.info("in the warm pool (%s): not joining until InService", state)
        on_warmed(state)
        while state.startswith("Warmed:") and not leaving():
            time.sleep(self.settings.imds_poll)
            # Only a real answer ends the wait: one failed read taken as InService would join a
            # parked instance, re-forming the whole job's round just before AWS stops it.
            state = (self.imds.get(STATE_PATH) or "").strip() or state
        log.info("left the warm pool after %.1fs (%s)", time.monotonic() - t0, state)
        return True

    def complete_launch(self, result: str = "CONTINUE") -> bool:
        """Complete the launch lifecycle action holding this instance (``Warmed:Pending:Wait`` or
        ``Pending:Wait``); whether a call succeeded. Ends the agent's launch heartbeats.

        Only a worker group with a warm pool has a launch hook (``PETCTL_LAUNCH_HOOK``): AWS would
        otherwise stop a pool instance before its boot ran. The agent completes it, not the boot:
        at a first launch into the pool once it has parked (``WARMED`` published: AWS stops the
        instance as soon as the action completes), at a launch straight into service or out of
        the pool once it is ``InService``; ``ABANDON`` after a terminal failure (the instance
        terminates, its group replaces it). Without this an instance would sit in Pending:Wait
        (training, but counted as pending) until the hook's timeout. "No active Lifecycle Action"
        (an instance launched before the hook existed, or started again by systemd) is expected.
        """
        hook, group = self.settings.launch_hook, self.spec.worker_group
        self.launch_done.set()
        if not hook or not group:
            return False
        try:
            self._autoscaling().complete_lifecycle_action(
                LifecycleHookName=hook,
                AutoScalingGroupName=group,
                LifecycleActionResult=result,
                InstanceId=self.instance_id,
            )
            log.info("completed launch lifecycle action %s on %s (%s)", hook, group, result)
            return True
        except Exception as e:  # noqa: BLE001 - no action pending, or the hook's timeout ends it
            log.info("launch lifecycle action %s not completed here: %s", hook, e)
            return False

    def launch_heartbeats(self, every: float = HEARTBEAT_EVERY, limit: float = HEARTBEAT_FOR) -> None:
        """Keep the launch action alive while the agent prepares (the boot's loop stops once the
        agent's unit started): ``RecordLifecycleActionHeartbeat`` every ``every`` s until the
        action is completed, for at most ``limit`` s (an agent that hangs is abandoned by the
        hook's ``DefaultResult``, not held). Best effort, like the boot's. Run in a thread."""
        self._heartbeats(self.settings.launch_hook, self.launch_done, every, limit, "launch")

    def drain_heartbeats(self, every: float | None = None, limit: float | None = None) -> None:
        """Keep the termination action alive while the node drains (``drain_heartbeat_plan``):
        ``RecordLifecycleActionHeartbeat`` every ``every`` s until the action is completed, for
        at most ``limit`` s. Best effort (a failed call is logged). Run in a thread."""
        plan = drain_heartbeat_plan(self.spec.drain_timeout)
        self._heartbeats(
            self.spec.lifecycle_hook, self.action_done, every or plan[0], limit or plan[1], "drain"
        )

    def _heartbeats(self, hook: str, done: threading.Event, every: float, limit: float, what: str) -> None:
        """``RecordLifecycleActionHeartbeat`` on ``hook`` every ``every`` s until ``done`` is set,
        for at most ``limit`` s; a failed call is logged."""
        group = self.spec.worker_group
        if not hook or not group:
            return
        deadline = time.monotonic() + limit
        while not done.wait(every) and time.monotonic() < deadline:
            try:
                self._autoscaling().record_lifecycle_action_heartbeat(
                    LifecycleHookName=hook, AutoScalingGroupName=group, InstanceId=self.instance_id
                )
            except Exception as e:  # noqa: BLE001
                log.info("%s hook heartbeat failed (ignored): %s", what, e)

    def set_unhealthy(self) -> bool:
        """``SetInstanceHealth Unhealthy`` (not respecting the grace period): the group replaces
        this instance, as it does one whose boot failed. Best effort: whether the call succeeded
        (False without a worker group)."""
        if not self.spec.worker_group:
            return False
        try:
            self._autoscaling().set_instance_health(
                InstanceId=self.instance_id, HealthStatus="Unhealthy", ShouldRespectGracePeriod=False
            )
            log.info("marked %s Unhealthy", self.instance_id)
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("could not mark %s Unhealthy (ignored): %s", self.instance_id, e)
            return False

    def watch(self, stop: threading.Event, request_leave: Callable[[str], None]) -> None:
        """Poll IMDS every ``PETCTL_AGENT_IMDS_POLL`` s for a scale-in (lifecycle) or a spot
        interruption notice, and ask the agent to leave on the first one."""
        while not stop.wait(self.settings.imds_poll):
            if self.state() == "Terminated":
                self.pending = True
                threading.Thread(target=self.drain_heartbeats, name="petctl-drain-hb", daemon=True).start()
                request_leave("autoscaling target-lifecycle-state=Terminated")
                return
            spot = self.imds.get("meta-data/spot/instance-action")
            if spot:
                request_leave(f"spot instance-action {spot.strip()}")
                return

    def complete_action_at_end(self, wait: float) -> None:
        """After SUCCEEDED/FAILED: complete our termination lifecycle action as soon as the
        instance enters Terminating:Wait, so it does not sit out the hook's timeout (billed).

        When we just scaled the groups to zero the termination follows within seconds
        to a minute: watch IMDS for up to ``wait`` s. Otherwise only act if it is pending now.
        """
        if not self.spec.lifecycle_hook or not self.spec.worker_group:
            return
        deadline = time.monotonic() + wait
        while True:
            if self.pending or self.state() == "Terminated":
                self.pending = True
                self.complete_action()
                return
            if time.monotonic() >= deadline:
                if wait > 0:
                    log.info("no termination lifecycle action within %.0fs; exiting", wait)
                return
            time.sleep(self.settings.imds_poll)

    def complete_action(self) -> None:
        """Complete our termination lifecycle action (CONTINUE) when one is pending."""
        spec = self.spec
        if not spec.lifecycle_hook or not spec.worker_group:
            return
        if not self.pending and self.state() != "Terminated":
            return
        self.action_done.set()
        try:
            self._autoscaling().complete_lifecycle_action(
                LifecycleHookName=spec.lifecycle_hook,
                AutoScalingGroupName=spec.worker_group,
                LifecycleActionResult="CONTINUE",
                InstanceId=self.instance_id,
            )
            log.info("completed lifecycle action %s on %s", spec.lifecycle_hook, spec.worker_group)
        except Exception as e:  # noqa: BLE001 - the hook's heartbeat timeout completes it anyway
            log.warning("complete_lifecycle_action failed (ignored): %s", e)

    def capacity(self, instances: bool = True) -> dict[str, int] | None:
        """The worker group's capacity (desired, in service, pending), or None without a group.
        ``instances=False``: the desired capacity only (in service and pending read 0), without the
        group's instance list (AWS: a large group's DescribeAutoScalingGroups may be throttled
        unless ``IncludeInstances`` is false)."""
        if not self.spec.worker_group:
            return None
        client = self._autoscaling()
        kw: dict[str, Any] = {"AutoScalingGroupNames": [self.spec.worker_group]}
        if _knows(client, "DescribeAutoScalingGroups", "IncludeInstances"):
            kw["IncludeInstances"] = instances  # a botocore older than the parameter would refuse it
        groups = client.describe_auto_scaling_groups(**kw)["AutoScalingGroups"]
        if not groups:
            return {"desired": 0, "in_service": 0, "pending": 0}
        g = groups[0]
        states = [i.get("LifecycleState", "") for i in g.get("Instances", [])]
        return {
            "desired": int(g.get("DesiredCapacity", 0)),
            "in_service": sum(1 for s in states if s == "InService"),
            "pending": sum(1 for s in states if s.startswith("Pending")),
        }

    def scale_groups_to_zero(
        self, delays: tuple[float, ...] = SCALE_TO_ZERO_DELAYS, sleep: Callable[[float], Any] = time.sleep
    ) -> bool:
        """The job is over (or failed for good): no group may replace its instances. Whether every
        group is at zero now.

        The worker group's warm pool goes first: a group at zero keeps it (its size is absolute,
        MinSize = MaxGroupPreparedCapacity), and its stopped instances would bill their volumes
        until ``kill-job``. Only a group with a warm pool has the launch hook, and only then may
        the role delete a pool. A failed call (throttled, the API unreachable) is tried again after
        each of ``delays``; a group still not at zero then is logged, and False tells the caller to
        take its last resort (:meth:`power_off`): otherwise this instance would idle in service,
        billed, until ``kill-job``.
        """
        pooled = self.spec.worker_group if self.settings.launch_hook else ""
        groups = [g for g in (self.spec.worker_group, self.spec.rdzv_group) if g]
        for attempt, delay in enumerate((0.0, *delays)):
            if delay:
                sleep(delay)
            if pooled:
                try:
                    self._autoscaling().delete_warm_pool(AutoScalingGroupName=pooled, ForceDelete=True)
                    log.info("deleted the warm pool of %s", pooled)
                    pooled = ""
                except Exception as e:  # noqa: BLE001 - tried again below; kill-job deletes it too
                    log.warning("could not delete the warm pool of %s (try %d): %s", pooled, attempt + 1, e)
            for group in list(groups):
                try:
                    self._autoscaling().update_auto_scaling_group(
                        AutoScalingGroupName=group, MinSize=0, DesiredCapacity=0
                    )
                    log.info("set %s to min=desired=0", group)
                    groups.remove(group)
                except Exception as e:  # noqa: BLE001
                    log.warning("could not scale %s to zero (try %d): %s", group, attempt + 1, e)
            if not groups and not pooled:
                return True
        if groups:
            log.error("could not scale %s to zero after %d tries", ", ".join(groups), len(delays) + 1)
        return not groups  # a pool left behind bills volumes only, and kill-job deletes it

    def power_off(self, reason: str) -> bool:
        """The last resort of a node whose job is over but whose group could not be scaled to zero:
        power this instance off (``PETCTL_AGENT_POWER_OFF``, the boot's ``petctl-power-off``:
        ``shutdown -h now``). EC2 stops it (the launch templates keep the default
        InstanceInitiatedShutdownBehavior, stop): no more compute billing, and the group's EC2
        health check, to which a stopped instance is unhealthy, replaces it. Without the setting
        (tests, a machine that is no petctl instance) it only logs. Whether the command ran."""
        command = self.settings.power_off
        if not command:
            log.error("last resort: would power off (%s), but PETCTL_AGENT_POWER_OFF is not set", reason)
            return False
        log.error("last resort: powering this instance off: %s", reason)
        try:
            subprocess.run([command, reason], check=True, timeout=60, stdin=subprocess.DEVNULL)
            return True
        except (OSError, subprocess.SubprocessError) as e:
            log.error("could not power off (%s): %s", command, e)
            return False
