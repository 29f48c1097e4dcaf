"""How a local instance leaves: the termination lifecycle hook's drain, an OS shutdown (a spot
interruption's, or its own ``shutdown``: :meth:`Leaving.os_shutdown`), a hard kill, a spot
interruption. A mixin of :class:`petctl.local.reconciler.Reconciler`, whose state
it shares; each drain or deadline runs in its own thread, so one slow drain never delays the
others.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from petctl.local import procs
from petctl.local.instance import Instance, iso
from petctl_agent.settings import env_float

log = logging.getLogger("petctl.local.reconciler")


#: A lifecycle action's global timeout: "48 hours or 100 times the heartbeat timeout, whichever
#: is smaller" (Amazon EC2 Auto Scaling User Guide, "Amazon EC2 Auto Scaling lifecycle hooks").
GLOBAL_TIMEOUT_S = 48 * 3600
GLOBAL_TIMEOUT_HEARTBEATS = 100


def hook_deadline(started: float, heartbeat: float | None, timeout: float, slack: float) -> float:
    """When a termination action that began at ``started`` (monotonic) times out: ``timeout``
    (the hook's HeartbeatTimeout) after its start or its last heartbeat, never later than the
    global timeout after its start (``slack``: the local cloud's allowance for the agent's
    own IMDS poll, added to both)."""
    last = max(started, heartbeat or started)
    cap = started + min(GLOBAL_TIMEOUT_S, GLOBAL_TIMEOUT_HEARTBEATS * timeout)
    return min(last + timeout, cap) + slack


class Leaving:
    """Drains, shuts down and kills instances (see the module docstring)."""

    clients: dict[str, Any]
    settings: Any
    lock: threading.RLock
    stopping: threading.Event
    instances: dict[str, Instance]
    _threads: list[threading.Thread]

    if TYPE_CHECKING:  # provided by Reconciler (petctl.local.reconciler) and the other mixin

        def get(self, instance_id: str) -> Instance: ...

        def job_spec(self, rec: Instance) -> dict[str, Any] | None: ...

        def _stop_units(self, rec: Instance) -> None: ...

        def _write_procs(self) -> None: ...

    def _thread(self, target: Any, *args: Any, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _begin_leave(self, rec: Instance, why: str) -> None:
        with rec.lock:
            if rec.state not in ("running", "exited", "restarting"):
                return
            was = rec.state
            rec.state = "draining"
            rec.lifecycle = "Terminated"
        log.info("%s: leaving (%s); draining", rec.instance_id, why)
        self._thread(self._drain, rec, was, name=f"drain-{rec.instance_id}")

    def _drain(self, rec: Instance, was: str) -> None:
        """The termination lifecycle hook (Terminating:Wait), then the tree is killed.

        An instance of an Auto Scaling group (the job template puts the ``petctl-drain``
        hook on it) stays in Terminating:Wait until CompleteLifecycleAction is called or
        the hook's timeout (the job's drain timeout + ``drain_slack``) runs out -- even if
        its agent has exited meanwhile, as on AWS, where the instance keeps running (and
        billing) until then. As on AWS, RecordLifecycleActionHeartbeat restarts that timeout,
        up to the action's global limit (:func:`hook_deadline`). The agent is also sent
        SIGTERM at the start (AWS does not;
        the agent reacts to either). An instance outside a group has no hook: it is
        shut down as soon as its agent is gone (or at the timeout).
        """
        t0 = time.monotonic()
        proc = rec.proc
        if rec.paused:  # a stopped instance: terminating it ends it, no process runs to drain
            self._finish(rec, "terminated")
            return
        # A warm pool instance never served: the group's termination hook is for its members.
        hooked = bool(rec.asg) and not rec.warm
        running = proc is not None and was != "exited" and proc.poll() is None
        if running or hooked:
            if running:
                self._stop_units(rec)
            # The spec is re-read: ``drain_timeout`` is the job's current word on it.
            spec = self.job_spec(rec) or {}
            timeout = float(
                spec.get("drain_timeout") or rec.drain_timeout or self.settings.default_drain_timeout
            )
            while not self.stopping.is_set() and time.monotonic() < hook_deadline(
                t0, rec.lifecycle_heartbeat, timeout, self.settings.drain_slack
            ):
                if not hooked and (proc is None or proc.poll() is not None):
                    break
                if rec.lifecycle_done.is_set():
                    # The agent completed the lifecycle action: AWS now shuts the instance down.
                    self._shutdown(rec, self.settings.shutdown_grace)
                    break
                time.sleep(0.05)
            else:
                if not self.stopping.is_set():
                    alive = proc is not None and proc.poll() is None
                    log.warning(
                        "%s: lifecycle action not completed within %.0fs (drain timeout %.0fs)%s",
                        rec.instance_id,
                        time.monotonic() - t0,
                        timeout,
                        "; killing it" if alive else "; the instance waited it out",
                    )
        self._finish(rec, "terminated")

    def _shutdown(self, rec: Instance, grace: float) -> None:
        """OS shutdown of an instance: SIGTERM to every process, SIGKILL after ``grace``."""
        if rec.pgid:
            procs.signal_tree(rec.pgid, rec.marker, signal.SIGTERM)
            procs.wait_tree_gone(rec.pgid, rec.marker, grace)

    def _finish(self, rec: Instance, state: str) -> None:
        if rec.pgid:
            procs.kill_tree(rec.pgid, rec.marker)
        with rec.lock:
            rec.reap()
            if rec.proc is not None:
                rec.exit_code = rec.proc.returncode if rec.exit_code is None else rec.exit_code
            if rec.state != "killed":  # a hard kill during a drain stays a hard kill
                rec.state = state
            rec.ended_at = rec.ended_at or time.time()
        log.info("%s: process tree gone (%s)", rec.instance_id, rec.state)
        self._write_procs()

    def on_lifecycle_call(self, instance_id: str, action: str, params: dict[str, Any]) -> str | None:
        """Called by the patched moto for CompleteLifecycleAction / RecordLifecycleActionHeartbeat."""
        with self.lock:
            rec = self.instances.get(instance_id)
        if rec is None or rec.state != "draining":
            return f"No active Lifecycle Action found with instance ID {instance_id}"
        if action == "complete":
            log.info("%s: lifecycle action completed (%s)", instance_id, params.get("LifecycleActionResult"))
            rec.lifecycle_done.set()
        elif action == "heartbeat":
            rec.lifecycle_heartbeat = time.monotonic()
        return None

    def os_shutdown(self, instance_id: str, token: str, minutes: float | None) -> tuple[int, dict[str, Any]]:
        """``shutdown`` on the instance (its shim): power off in ``minutes`` (0: now), each minute
        ``PETCTL_LOCAL_SHUTDOWN_MINUTE`` seconds (60; tests shorten it), or cancel (None). A second
        schedule replaces the first, as systemd's does."""
        rec = self.get(instance_id)
        if not secrets.compare_digest(token, rec.systemd_token):
            return 403, {"error": "wrong systemd token for this instance"}
        with rec.lock:
            if rec.state not in ("running", "exited"):
                return 409, {"error": f"instance is {rec.state}"}
            if minutes is None:
                rec.shutdown_at = None
                return 200, {"cancelled": True}
            seconds = max(minutes, 0.0) * env_float("PETCTL_LOCAL_SHUTDOWN_MINUTE", 60.0)
            rec.shutdown_at = deadline = time.monotonic() + seconds
        log.info("%s: power-off scheduled in %.0f min (%.1fs here)", instance_id, minutes, seconds)
        self._thread(self._power_off_at, rec, deadline, name=f"poweroff-{instance_id}")
        return 200, {"scheduled": f"in {minutes:g} min"}

    def _power_off_at(self, rec: Instance, deadline: float) -> None:
        """At ``deadline`` (unless cancelled or rescheduled meanwhile): the OS powers off. Every
        process gets SIGTERM, then SIGKILL after the grace; EC2 stops the instance (the launch
        templates keep the default InstanceInitiatedShutdownBehavior, stop); a group's EC2 health
        check counts an instance in any state but running as unhealthy, and the group terminates it
        and launches a replacement (Amazon EC2 Auto Scaling User Guide, "Health checks for
        instances in an Auto Scaling group")."""
        while not self.stopping.wait(min(max(deadline - time.monotonic(), 0.0), 0.5)):
            if rec.shutdown_at != deadline or rec.state not in ("running", "exited"):
                return  # cancelled, replaced by a later schedule, or the instance is gone
            if time.monotonic() >= deadline:
                break
        with rec.lock:
            if (
                self.stopping.is_set()
                or rec.shutdown_at != deadline
                or rec.state not in ("running", "exited")
            ):
                return
            # "powered-off" only once the tree is gone (``_finish``): a reader that sees it may
            # rely on every process of the instance having ended
            rec.state, rec.shutdown_at = "powering-off", None
        log.info("%s: the OS powers off (shutdown)", rec.instance_id)
        self._shutdown(rec, self.settings.shutdown_grace)
        self._finish(rec, "powered-off")
        try:
            self.clients["ec2"].stop_instances(InstanceIds=[rec.instance_id])
        except Exception as e:  # noqa: BLE001 - gone meanwhile
            log.warning("%s: EC2 stop failed (%s)", rec.instance_id, e)
        if rec.asg:
            rec.replaced = True
            self._terminate_in_aws(rec)

    def _terminate_in_aws(self, rec: Instance) -> bool:
        """Terminate in moto as a hard failure would; True if the group will replace it."""
        if rec.asg:
            try:
                self.clients["autoscaling"].terminate_instance_in_auto_scaling_group(
                    InstanceId=rec.instance_id, ShouldDecrementDesiredCapacity=False
                )
                return True
            except Exception as e:  # noqa: BLE001 - e.g. the group is gone meanwhile
                log.warning("%s: autoscaling terminate failed (%s); terminating in EC2", rec.instance_id, e)
        self.clients["ec2"].terminate_instances(InstanceIds=[rec.instance_id])
        return False

    def kill_instance(self, instance_id: str) -> dict[str, Any]:
        rec = self.get(instance_id)
        with rec.lock:
            if rec.state not in ("running", "exited", "restarting", "draining"):
                raise ValueError(f"instance {instance_id} is {rec.state}: nothing to kill")
            # A draining instance is already terminated in AWS: only its processes remain.
            was_draining = rec.state == "draining"
            rec.state = "killed"
        log.info("%s: hard kill (fault injection)", instance_id)
        t0 = time.monotonic()
        self._finish(rec, "killed")
        replaced = False if was_draining else self._terminate_in_aws(rec)
        return {
            "instance_id": instance_id,
            "pgid": rec.pgid,
            "killed": True,
            "kill_seconds": round(time.monotonic() - t0, 3),
            "replaced_by_group": replaced,
        }

    def spot_interrupt(self, instance_id: str, seconds: float) -> dict[str, Any]:
        rec = self.get(instance_id)
        with rec.lock:
            if rec.state not in ("running", "exited"):
                raise ValueError(f"instance {instance_id} is {rec.state}: cannot interrupt it")
            if rec.spot_action:
                raise ValueError(
                    f"instance {instance_id} already has a spot notice for {rec.spot_action['time']}"
                )
            when = time.time() + seconds
            rec.spot_action = {"action": "terminate", "time": iso(when)}
        log.info("%s: spot interruption notice, termination at %s", instance_id, rec.spot_action["time"])
        self._thread(self._spot_deadline, rec, when, name=f"spot-{instance_id}")
        return {"instance_id": instance_id, "spot_action": rec.spot_action}

    def _spot_deadline(self, rec: Instance, when: float) -> None:
        # Early exit: once the drained agent is gone the instance has nothing left to do,
        # so the local cloud terminates it at once instead of idling until the deadline.
        while time.time() < when and not self.stopping.is_set():
            if rec.state not in ("running", "exited") or (rec.proc and rec.proc.poll() is not None):
                break
            time.sleep(0.05)
        with rec.lock:
            if self.stopping.is_set() or rec.state not in ("running", "exited"):
                return
            rec.state = "interrupted"
            rec.lifecycle = "Terminated"
        self._shutdown(rec, self.settings.shutdown_grace)
        self._finish(rec, "terminated")
        self._terminate_in_aws(rec)
