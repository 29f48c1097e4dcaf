"""The reconciler: one local process tree per running EC2 instance of the local cloud.

Every ``period`` seconds it reads moto's state over HTTP (the same API a real
client uses) and makes the local processes match it:

* an instance tagged ``petctl:role`` that is ``pending``/``running`` and that we
  have not seen boots: the user data of its launch template runs with bash, with the
  instance's paths mapped into its root directory and host commands shimmed
  (:mod:`petctl.local.boot`, :mod:`petctl.local.shims`); the units its boot script starts
  (``systemctl enable --now``: etcd on the rendezvous instance, ``petctl-agent run`` on a
  worker) are started by :meth:`Reconciler.systemd_start` as processes of the instance;
* an instance its group considers ``Unhealthy`` (a failed boot marks itself so) is
  terminated in its group, which replaces it, as AWS's health checks do;
* an instance that left (terminated by a scale-in, deleted group, …) is drained
  the way the termination lifecycle hook would on AWS (IMDS
  ``target-lifecycle-state`` → ``Terminated``, SIGTERM, then Terminating:Wait: a
  group's instance waits until CompleteLifecycleAction or the job's drain
  timeout, even after its agent exited), then its whole process group is
  SIGKILLed — in a thread per instance, so one slow drain never delays the others;
* a tree that exits on its own is recorded, never restarted (an agent that
  exited 0 after its job SUCCEEDED must stay down — as on AWS, where the
  instance keeps running idle until the group scales to zero).

Instance states: see :mod:`petctl.local.instance`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.local import boot, moto_patches, procs, shims
from petctl.local.environment import LOCAL_ENV, LOCAL_ENV_UNSET
from petctl.local.instance import Instance, iso

log = logging.getLogger("petctl.local.reconciler")

LIVE_STATES = ("pending", "running")
ROLE_TAG, JOB_TAG, SPEC_TAG, RDZV_TAG = "petctl:role", "petctl:job", "petctl:spec", "petctl:rdzv"
ASG_TAG = "aws:autoscaling:groupName"
_NOT_INHERITED = frozenset(
    LOCAL_ENV_UNSET
    + (
        "PETCTL_HOME",
        "PETCTL_PROFILE",
        "PETCTL_JOB_NAME",
        "PETCTL_CHECKPOINT_DIR",
        "PETCTL_DRAIN_FILE",
        "PETCTL_PROGRESS_FILE",
        "PETCTL_LOCAL_ADDR",
        "PETCTL_AGENT_PID",
    )
)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass
class Settings:
    """Knobs, read from the daemon's environment (see docs/local.md)."""

    period: float = field(default_factory=lambda: _env_float("PETCTL_LOCAL_PERIOD", 0.5))
    default_drain_timeout: float = field(default_factory=lambda: _env_float("PETCTL_LOCAL_DRAIN_TIMEOUT", 60))
    # Time after the drain timeout for the agent to leave the rendezvous and complete the
    # lifecycle action before the instance is killed (the hook's heartbeat timeout on AWS).
    drain_slack: float = field(default_factory=lambda: _env_float("PETCTL_LOCAL_DRAIN_SLACK", 10))
    # OS shutdown: SIGTERM, then SIGKILL after this long (spot interruption deadline).
    shutdown_grace: float = field(default_factory=lambda: _env_float("PETCTL_LOCAL_SHUTDOWN_GRACE", 5))


class Reconciler:
    """Keeps local process trees in line with moto's EC2 / Auto Scaling state."""

    def __init__(
        self, state_dir: Path, clients: dict[str, Any], endpoint_url: str, imds_url: str, region: str
    ) -> None:
        self.state_dir = state_dir
        self.clients = clients
        self.endpoint_url = endpoint_url
        self.imds_url = imds_url
        self.region = region
        self.settings = Settings()
        self.instances: dict[str, Instance] = {}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._user_data_cache: dict[str, str] = {}
        self._procs_written: dict[str, Any] | None = None
        self._procs_lock = threading.Lock()
        self._ticks = 0
        # Marks every process of every instance of this daemon (see procs): random per daemon,
        # so a marker proves the process was started by this daemon.
        self.token = secrets.token_hex(8)
        moto_patches.lifecycle_handler = self.on_lifecycle_call

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        """Reconcile until :meth:`shutdown`; errors are logged and retried next period."""
        last_error: str | None = None
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                self.tick()
                last_error = None
            except Exception as e:  # noqa: BLE001 - the loop must survive a bad tick
                if repr(e) != last_error:  # once per distinct error, not twice a second
                    log.exception("reconcile failed; retrying every %.1fs", self.settings.period)
                last_error = repr(e)
            self.stopping.wait(max(0.05, self.settings.period - (time.monotonic() - t0)))

    def _describe(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]] | None]:
        """Live tagged instances, and (every few ticks, if any is in a group) the groups by name."""
        ec2, asg = self.clients["ec2"], self.clients["autoscaling"]
        instances: dict[str, dict[str, Any]] = {}
        for page in ec2.get_paginator("describe_instances").paginate(
            # Only live instances: one that left simply vanishes from the answer (see tick), and
            # the answer does not grow with every instance ever terminated.
            Filters=[
                {"Name": "tag-key", "Values": [ROLE_TAG]},
                {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
            ]
        ):
            for res in page["Reservations"]:
                for i in res["Instances"]:
                    instances[i["InstanceId"]] = i
        in_groups = any(t["Key"] == ASG_TAG for i in instances.values() for t in i.get("Tags", []))
        if not in_groups or self._ticks % 4:
            return instances, None  # moto already terminates a deleted group's instances; this is a backstop
        groups = {}
        for page in asg.get_paginator("describe_auto_scaling_groups").paginate():
            groups.update({g["AutoScalingGroupName"]: g for g in page["AutoScalingGroups"]})
        return instances, groups

    def tick(self) -> None:
        described, groups = self._describe()
        if self.stopping.is_set():
            return
        orphaned = []
        for iid, data in described.items():
            state = data["State"]["Name"]
            tags = {t["Key"]: t["Value"] for t in data.get("Tags", [])}
            with self.lock:
                rec = self.instances.get(iid)
            if state in LIVE_STATES:
                if groups is not None and tags.get(ASG_TAG) and tags[ASG_TAG] not in groups:
                    orphaned.append(iid)  # its group was deleted: AWS terminates its instances
                    continue
                if rec is None:
                    rec = self._new_instance(data, tags)
                    with self.lock:
                        self.instances[iid] = rec
                    self._start(rec)
                else:
                    rec.tags = tags
                    self._check_exit(rec)
            elif rec is not None and rec.state in ("running", "exited", "restarting"):
                self._begin_leave(rec, f"instance is {state}")
        with self.lock:
            vanished = [r for i, r in self.instances.items() if i not in described]
        for rec in vanished:
            if rec.state in ("running", "exited", "restarting"):
                self._begin_leave(rec, "instance is no longer running")
        if orphaned:
            log.info("terminating %s: their Auto Scaling group was deleted", ", ".join(orphaned))
            self.clients["ec2"].terminate_instances(InstanceIds=orphaned)
        if groups is not None:
            self._replace_unhealthy(groups)
        self._ticks += 1
        if self._ticks % 10 == 0:  # a /proc scan; orphans only need reaping now and then
            with self.lock:
                leaders = {p.pid for r in self.instances.values() for p in r.popens()}
            procs.reap_orphans(leaders)
        self._write_procs()

    def _replace_unhealthy(self, groups: dict[str, dict[str, Any]]) -> None:
        """An instance its group holds Unhealthy (SetInstanceHealth, e.g. by a failed boot) is
        terminated and replaced, as the group's health check does on AWS (moto only records it)."""
        for g in groups.values():
            for gi in g.get("Instances", []):
                if gi.get("HealthStatus") != "Unhealthy" or gi.get("LifecycleState") != "InService":
                    continue
                with self.lock:
                    rec = self.instances.get(gi["InstanceId"])
                if rec is None or rec.replaced:
                    continue
                rec.replaced = True
                log.info(
                    "%s: Unhealthy in %s; the group replaces it", rec.instance_id, g["AutoScalingGroupName"]
                )
                try:
                    self.clients["autoscaling"].terminate_instance_in_auto_scaling_group(
                        InstanceId=rec.instance_id, ShouldDecrementDesiredCapacity=False
                    )
                except Exception as e:  # noqa: BLE001 - e.g. the group went meanwhile
                    log.warning("%s: cannot replace it (%s)", rec.instance_id, e)

    def _check_exit(self, rec: Instance) -> None:
        with rec.lock:
            if rec.state != "running":
                return
            if rec.boot is not None and rec.boot_rc is None and rec.boot.poll() is not None:
                rec.boot_rc = rec.boot.returncode
                rec.boot_ended_at = time.time()
                took = rec.boot_ended_at - (rec.started_at or rec.boot_ended_at)
                if rec.boot_rc:
                    log.warning(
                        "%s: boot script failed (exit %s) after %.1fs", rec.instance_id, rec.boot_rc, took
                    )
                else:
                    log.info("%s: boot script done in %.1fs", rec.instance_id, took)
            if rec.proc is not None:
                if rec.proc.poll() is not None:
                    rec.exit_code = rec.proc.returncode
                    rec.state = "exited"
                    rec.ended_at = time.time()
                    log.info(
                        "%s (%s) exited with code %s; not restarted", rec.instance_id, rec.role, rec.exit_code
                    )
            elif rec.boot_rc is not None:
                rec.exit_code = rec.boot_rc
                rec.state = "exited"
                rec.ended_at = time.time()
                rec.note = (
                    f"boot script failed (exit {rec.boot_rc})"
                    if rec.boot_rc
                    else "boot script finished without starting a service"
                )
                log.warning("%s: %s", rec.instance_id, rec.note)

    # ------------------------------------------------------------------ start

    def _new_instance(self, data: dict[str, Any], tags: dict[str, str]) -> Instance:
        return Instance(
            instance_id=data["InstanceId"],
            role=tags.get(ROLE_TAG, ""),
            job=tags.get(JOB_TAG),
            private_ip=data.get("PrivateIpAddress") or "127.0.0.1",
            az=(data.get("Placement") or {}).get("AvailabilityZone") or f"{self.region}a",
            asg=tags.get(ASG_TAG),
            tags=tags,
            instance_type=data.get("InstanceType") or "t3.medium",
            image_id=data.get("ImageId") or "ami-local",
        )

    def job_spec(self, rec: Instance) -> dict[str, Any] | None:
        """The job spec from ``petctl:spec`` (read each time: a job re-created under the same
        name has a new spec at the same URL)."""
        url = rec.tags.get(SPEC_TAG, "")
        if not url.startswith("s3://"):
            return None
        bucket, _, key = url[5:].partition("/")
        try:
            spec = json.loads(self.clients["s3"].get_object(Bucket=bucket, Key=key)["Body"].read())
        except Exception as e:  # noqa: BLE001 - a missing spec only means defaults
            log.warning("%s: cannot read job spec %s (%s); using defaults", rec.instance_id, url, e)
            return None
        return spec if isinstance(spec, dict) else None

    def _base_env(self) -> dict[str, str]:
        # The daemon's environment reaches the instances (so agent knobs like PETCTL_AGENT_* set
        # where the cloud was started apply), minus AWS settings, the local cloud's own
        # settings, and what the contract sets per instance or per worker.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "PETCTL_LOCAL_", "ETCD_")) and k not in _NOT_INHERITED
        }
        env.update(LOCAL_ENV)
        env["AWS_ENDPOINT_URL"] = self.endpoint_url
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _unit_env(self, rec: Instance) -> dict[str, str]:
        """What a unit's process starts with before its Environment= lines: the instance's base
        environment (not the boot script's variables, as under systemd), its marker, and the
        IMDS URL (the local cloud's IMDS is not at 169.254.169.254)."""
        env = self._base_env()
        env[procs.MARKER] = rec.marker or ""
        env["PETCTL_IMDS_URL"] = f"{self.imds_url}/{rec.instance_id}"
        return env

    def _start(self, rec: Instance) -> None:
        """Boot the instance: run its user data (see petctl.local.boot)."""
        with rec.lock:
            spec = self.job_spec(rec) or {}
            rec.drain_timeout = float(spec.get("drain_timeout") or self.settings.default_drain_timeout)
            if not rec.private_ip.startswith("127."):
                # Launched outside the local profile's 127.0.0.0/16 VPC: the address is not local.
                rec.note = f"private IP {rec.private_ip} is not a loopback address; use a 127.0.0.0/16 VPC"
                log.warning("%s: %s", rec.instance_id, rec.note)
            # etcd serves on the rendezvous ENI's address (petctl:rdzv); a worker on its own.
            rec.bind_ip = (rec.tags.get(RDZV_TAG) or rec.private_ip) if rec.role == "rdzv" else rec.private_ip
            rec.bind_ip = rec.bind_ip.partition(":")[0]
            inst_dir = self.state_dir / "instances" / rec.instance_id
            inst_dir.mkdir(parents=True, exist_ok=True)
            rec.marker = f"{rec.instance_id}@{self.token}"
            try:
                script = boot.user_data(self.clients, rec.instance_id, rec.tags, self._user_data_cache)
                boot.check_script(script)
                loopback = rec.private_ip if rec.private_ip.startswith("127.") else None
                root, bin_dir, path = boot.prepare(inst_dir, script, loopback)
            except Exception as e:  # noqa: BLE001 - the instance cannot boot; the cloud goes on
                rec.state, rec.note = "error", f"cannot boot: {e}"
                log.error("%s: %s", rec.instance_id, rec.note)
                return
            env = boot.boot_env(
                self._base_env(),
                root,
                bin_dir,
                {
                    procs.MARKER: rec.marker,
                    "PETCTL_LOCAL_ROOT": str(root),
                    "PETCTL_LOCAL_STATE": str(self.state_dir),
                    "PETCTL_LOCAL_IMDS": f"{self.imds_url}/{rec.instance_id}",
                    "PETCTL_LOCAL_INSTANCE_ID": rec.instance_id,
                    "PETCTL_LOCAL_AZ": rec.az,
                    "PETCTL_LOCAL_JOB": rec.job or "",
                    "PETCTL_LOCAL_SYSTEMD": f"{self.imds_url}/{rec.instance_id}/_petctl/systemd",
                    "PETCTL_LOCAL_SYSTEMD_TOKEN": rec.systemd_token,
                },
            )
            self._spawn(rec, ["bash", str(path)], env)

    def _spawn(self, rec: Instance, argv: list[str], env: dict[str, str]) -> None:
        log_path = self.state_dir / "logs" / f"{rec.instance_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(log_path, "ab") as out:
                out.write(f"==> {iso(time.time())} petctl local: booting {rec.role}: {argv}\n".encode())
                out.flush()
                rec.boot = subprocess.Popen(
                    argv,
                    cwd=str(self.state_dir / "instances" / rec.instance_id / "root"),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: the instance's tree
                    close_fds=True,
                )
        except OSError as e:
            rec.state, rec.note = "error", f"cannot start {argv[0]}: {e}"
            log.error("%s: %s", rec.instance_id, rec.note)
            return
        rec.pgid = rec.boot.pid
        rec.start_ticks = procs.start_ticks(rec.boot.pid)
        rec.started_at = time.time()
        rec.state = "running"
        log.info(
            "%s: booting %s (job %s) on %s, boot script pid %d",
            rec.instance_id,
            rec.role,
            rec.job,
            rec.private_ip,
            rec.boot.pid,
        )
        self._write_procs()

    # ------------------------------------------------------------------ systemd

    def systemd_start(self, instance_id: str, unit: str, token: str) -> tuple[int, dict[str, Any]]:
        """``systemctl enable --now UNIT`` on an instance (called by the IMDS server for the
        systemctl shim): start the unit as a process of the instance. Blocks until a
        ``Type=notify`` unit is ready, as systemctl does."""
        rec = self.get(instance_id)
        if not secrets.compare_digest(token, rec.systemd_token):
            return 403, {"error": "wrong systemd token for this instance"}
        with rec.lock:
            if rec.state not in ("running", "restarting"):
                return 409, {"error": f"instance is {rec.state}"}
            if unit in rec.units and rec.units[unit].proc.poll() is None:
                return 200, {"pid": rec.units[unit].proc.pid, "already": True}
            try:
                u, deadline = self._start_unit(rec, unit)
            except shims.Refused as e:
                return 400, {"error": f"not emulated by the local cloud: {e}"}
            except Exception as e:  # noqa: BLE001 - the unit fails to start, as systemctl reports
                return 500, {"error": str(e)}
        try:
            boot.wait_ready(u, deadline)  # outside the lock: the reconcile loop goes on
        except RuntimeError as e:
            return 500, {"error": str(e)}
        log.info("%s: unit %s started, main pid %d", instance_id, unit, u.proc.pid)
        return 200, {"pid": u.proc.pid}

    def _start_unit(self, rec: Instance, unit: str) -> tuple[boot.Unit, float | None]:
        log_path = self.state_dir / "logs" / f"{rec.instance_id}.log"
        with open(log_path, "ab") as out:
            u, deadline = boot.start_unit(
                rec.root(self.state_dir),
                self.state_dir,
                unit,
                self._unit_env(rec),
                out,
                self.clients["efs"],
                rec.az,
            )
        rec.units[unit] = u
        rec.proc = u.proc
        self._write_procs()
        return u, deadline

    def _stop_units(self, rec: Instance) -> None:
        """What stopping the instance's services sends first: each unit's KillSignal (KillMode)."""
        for u in list(rec.units.values()):
            u.stop_signal()

    # ------------------------------------------------------------------ leave

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
        billing) until then. The agent is also sent SIGTERM at the start (AWS does not;
        the agent reacts to either). An instance outside a group has no hook: it is
        shut down as soon as its agent is gone (or at the timeout).
        """
        t0 = time.monotonic()
        proc = rec.proc
        hooked = bool(rec.asg)
        running = proc is not None and was != "exited" and proc.poll() is None
        if running or hooked:
            if running:
                self._stop_units(rec)
            # The spec is re-read: ``drain_timeout`` is the job's current word on it.
            spec = self.job_spec(rec) or {}
            timeout = float(
                spec.get("drain_timeout") or rec.drain_timeout or self.settings.default_drain_timeout
            )
            deadline = t0 + timeout + self.settings.drain_slack
            while not self.stopping.is_set() and time.monotonic() < deadline:
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
                        timeout + self.settings.drain_slack,
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
            for p in rec.popens():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
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
        return None

    # ------------------------------------------------------------------ faults

    def get(self, instance_id: str) -> Instance:
        with self.lock:
            rec = self.instances.get(instance_id)
        if rec is None:
            raise LookupError(f"no instance {instance_id} in the local cloud")
        return rec

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

    def restart_rdzv(self, job: str) -> dict[str, Any]:
        with self.lock:
            cands = [
                r
                for r in self.instances.values()
                if r.role == "rdzv" and r.job == job and r.state in ("running", "exited")
            ]
        if not cands:
            raise LookupError(f"job {job!r} has no running rendezvous instance in the local cloud")
        rec = max(cands, key=lambda r: r.started_at or 0)
        # A reboot: every process goes; the boot script does not run again (user data runs on the
        # first boot only), systemd starts the enabled units, and the EFS/fstab mounts stay.
        with rec.lock:
            old_pid = rec.proc.pid if rec.proc else None
            rec.state = "restarting"
            if rec.pgid:
                procs.kill_tree(rec.pgid, rec.marker)
            for p in rec.popens():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            rec.exit_code = None
            rec.units, rec.proc = {}, None
            names = boot.enabled_units(rec.root(self.state_dir))
            if not names:
                rec.state, rec.note = "exited", "rebooted, but the boot enabled no unit"
                raise ValueError(f"{rec.instance_id} has no enabled unit to start after the reboot")
            started = [self._start_unit(rec, name) for name in names]
            rec.pgid = started[0][0].proc.pid
            rec.start_ticks = procs.start_ticks(rec.pgid)
            rec.restarts += 1
            rec.state = "running"
        for u, deadline in started:
            boot.wait_ready(u, deadline)
        log.info(
            "%s: rendezvous server of %s rebooted (pid %s -> %s)", rec.instance_id, job, old_pid, rec.proc.pid
        )
        return {
            "job": job,
            "instance_id": rec.instance_id,
            "ip": rec.bind_ip,
            "old_pid": old_pid,
            "pid": rec.proc.pid,
        }

    # ------------------------------------------------------------------ status / shutdown

    def summaries(self) -> list[dict[str, Any]]:
        with self.lock:
            recs = list(self.instances.values())
        live = procs.live_trees()
        return [r.summary(self.state_dir, live) for r in sorted(recs, key=lambda r: r.started_at or 0)]

    def _write_procs(self) -> None:
        with self.lock:
            groups = {
                r.instance_id: {
                    "pgid": r.pgid,
                    "start_ticks": r.start_ticks,
                    "marker": r.marker,
                    "role": r.role,
                }
                for r in self.instances.values()
                if r.pgid and r.state not in ("terminated", "killed", "error")
            }
        data = {"daemon_pid": os.getpid(), "groups": groups}
        with self._procs_lock:  # drain threads and the loop both write it
            if data == self._procs_written:
                return
            path = self.state_dir / "procs.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2))
            os.replace(tmp, path)
            self._procs_written = data

    def shutdown(self) -> list[dict[str, Any]]:
        """Kill every process group this daemon started (no drain). Returns what was killed."""
        self.stopping.set()
        with self.lock:
            recs = list(self.instances.values())
        killed = []
        for rec in recs:
            if rec.pgid and procs.signal_tree(rec.pgid, rec.marker, signal.SIGKILL):
                killed.append({"instance_id": rec.instance_id, "pgid": rec.pgid})
        for rec in recs:
            if rec.pgid:
                procs.kill_tree(rec.pgid, rec.marker)
            for p in rec.popens():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for t in self._threads:
            t.join(timeout=5)
        self._write_procs_empty()
        return killed

    def _write_procs_empty(self) -> None:
        path = self.state_dir / "procs.json"
        if all(not (r.pgid and procs.tree_members(r.pgid, r.marker)) for r in self.instances.values()):
            path.unlink(missing_ok=True)
