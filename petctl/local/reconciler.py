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
* a unit whose main process exits on its own is restarted as its ``Restart=``,
  ``RestartPreventExitStatus=``, ``RestartSec=`` and start limit say (systemd's rules); a unit
  that ends failed and is not restarted starts its ``OnFailure=`` units; otherwise the exit is recorded (an agent that exited 0 after its job SUCCEEDED, or with a
  terminal status, must stay down — as on AWS, where the instance keeps running idle until
  the group scales to zero or, Unhealthy, replaces it);
* a warm pool instance (Auto Scaling says ``Warmed:*``) boots the same way, with IMDS
  ``target-lifecycle-state`` ``Warmed:Stopped``; once its agent reports ``WARMED`` the pool
  stops it (:func:`petctl.local.moto_warm_pool.mark_warmed`) and its whole tree is SIGSTOPped;
  when a scale-out moves it into its group, IMDS says ``InService`` and the tree is SIGCONTinued.

Each tick reads moto (:class:`petctl.local.observe.Observer`, when it may have changed), snapshots
the local records, asks the pure :func:`petctl.local.plan.diff` what to do, and carries the
actions out (:meth:`Reconciler.execute`).
Booting and units live in :mod:`petctl.local.starting`, leaving and faults in
:mod:`petctl.local.leaving`.

Instance states: see :mod:`petctl.local.instance`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.local import boot, moto_autoscaling, moto_warm_pool, plan, procs
from petctl.local.efs_rate import EfsRates, rates_from_env
from petctl.local.instance import Instance
from petctl.local.leaving import Leaving
from petctl.local.observe import Observer
from petctl.local.shims.base import Refused
from petctl.local.shims.systemctl import on_failure, parse_unit, restart_delay, restart_verdict
from petctl.local.starting import Starting
from petctl_agent.settings import env_float

log = logging.getLogger("petctl.local.reconciler")


@dataclass
class Settings:
    """Knobs, read from the daemon's environment (see docs/local.md)."""

    period: float = field(default_factory=lambda: env_float("PETCTL_LOCAL_PERIOD", 0.5))
    default_drain_timeout: float = field(default_factory=lambda: env_float("PETCTL_LOCAL_DRAIN_TIMEOUT", 60))
    # After the drain timeout: the agent's time to leave and complete the action (AWS: the heartbeat timeout)
    drain_slack: float = field(default_factory=lambda: env_float("PETCTL_LOCAL_DRAIN_SLACK", 10))
    # OS shutdown: SIGTERM, then SIGKILL after this long (spot interruption deadline).
    shutdown_grace: float = field(default_factory=lambda: env_float("PETCTL_LOCAL_SHUTDOWN_GRACE", 5))
    # AWS's EFS throughput limits for the agent's checkpoint I/O (None: off); petctl.local.efs_rate.
    efs_rates: EfsRates | None = field(default_factory=rates_from_env)


class Reconciler(Starting, Leaving):
    """Keeps local process trees in line with moto's EC2 / Auto Scaling state."""

    def __init__(
        self, state_dir: Path, clients: dict[str, Any], endpoint_url: str, imds_url: str, region: str
    ) -> None:
        self.state_dir = state_dir
        self.clients = clients
        self.observer = Observer(clients)
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
        #: (instance, unit) -> monotonic times systemd restarted it (StartLimitBurst)
        self._unit_starts: dict[tuple[str, str], list[float]] = {}
        # Marks each process of this daemon's instances (procs): random, so a marker proves it ours
        self.token = secrets.token_hex(8)
        moto_autoscaling.lifecycle_handler = self.on_lifecycle_call

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

    def tick(self) -> None:
        with self.lock:
            known = dict(self.instances)  # only this loop adds records
        observed = self.observer.observe(known, with_groups=not self._ticks % 4)
        if self.stopping.is_set():
            return
        # Each record's own lock, never inside self.lock: systemd_start takes them the other way.
        local = {iid: _snapshot(rec) for iid, rec in known.items()}
        for action in plan.diff(observed, local):
            self.execute(action)
        self._ticks += 1
        if self._ticks % 40 == 0:  # a scan of all /proc (~0.1 s); orphans only need reaping now and then
            with self.lock:
                leaders = {p.pid for r in self.instances.values() for p in r.popens()}
            procs.reap_orphans(leaders)
        self._write_procs()

    # ------------------------------------------------------------------ execute

    def execute(self, action: plan.Action) -> None:
        """Carry out one action of :func:`petctl.local.plan.diff` (and read moto next tick)."""
        self.observer.stale()
        handlers: dict[type, Callable[[Any], None]] = {
            plan.Boot: self._boot,
            plan.UpdateTags: self._update_tags,
            plan.BootEnded: self._boot_ended,
            plan.MainExited: self._main_exited,
            plan.BootWithoutService: self._boot_without_service,
            plan.Warmed: self._warmed,
            plan.Resume: self._resume,
            plan.Leave: lambda a: self._begin_leave(self.get(a.instance_id), a.why),
            plan.TerminateOrphans: self._terminate_orphans,
            plan.ReplaceUnhealthy: self._replace_unhealthy,
        }
        handlers[type(action)](action)

    def _boot(self, a: plan.Boot) -> None:
        rec = self._new_instance(a.seen)
        if a.warm:
            rec.warm = a.seen.lifecycle
            rec.lifecycle = plan.WARMED + self._pool_state(rec.asg)
        with self.lock:
            self.instances[rec.instance_id] = rec
        self._start(rec)

    def _pool_state(self, group: str | None) -> str:
        try:
            res = self.clients["autoscaling"].describe_warm_pool(AutoScalingGroupName=group)
            return res["WarmPoolConfiguration"].get("PoolState") or "Stopped"
        except Exception:  # noqa: BLE001 - the pool went meanwhile; AWS's default state
            return "Stopped"

    def _update_tags(self, a: plan.UpdateTags) -> None:
        self.get(a.instance_id).tags = dict(a.tags)

    def _boot_ended(self, a: plan.BootEnded) -> None:
        rec = self.get(a.instance_id)
        with rec.lock:
            if rec.state != "running" or rec.boot_rc is not None:
                return
            rec.boot_rc, rec.boot_ended_at = a.rc, time.time()
        took = rec.boot_ended_at - (rec.started_at or rec.boot_ended_at)
        if a.rc:
            log.warning("%s: boot script failed (exit %s) after %.1fs", rec.instance_id, a.rc, took)
        else:
            log.info("%s: boot script done in %.1fs", rec.instance_id, took)

    def _main_exited(self, a: plan.MainExited) -> None:
        """The main unit's process ended: systemd's ``Restart=`` rule decides
        (:func:`petctl.local.shims.systemctl.restart_verdict`); a restart comes ``RestartSec``
        later, with the instance ``restarting`` meanwhile. Else the instance is ``exited``."""
        rec = self.get(a.instance_id)
        with rec.lock:
            if rec.state != "running":
                return
            unit = next((n for n, u in rec.units.items() if u.proc is rec.proc), None)
            why, delay, spec = "no unit", 0.0, None
            if unit is not None:
                try:
                    spec = parse_unit(boot.unit_path(rec.root(self.state_dir), unit).read_text())
                    starts = self._unit_starts.setdefault((rec.instance_id, unit), [])
                    why = restart_verdict(spec, a.rc, starts, time.monotonic())
                    delay = restart_delay(spec)
                except (OSError, Refused) as e:
                    why = f"unit unreadable: {e}"
            if why is not None:
                rec.exit_code, rec.state, rec.ended_at = a.rc, "exited", time.time()
            else:
                rec.exit_code, rec.state = a.rc, "restarting"
        if why is not None:
            log.info("%s (%s) exited with code %s; not restarted: %s", rec.instance_id, rec.role, a.rc, why)
            if spec is not None and unit is not None:
                self._on_failure(rec, spec, unit, a.rc, why)
            return
        log.info(
            "%s (%s): %s exited with code %s; restarting in %gs", rec.instance_id, rec.role, unit, a.rc, delay
        )
        threading.Timer(delay, self._restart_unit, args=(rec, unit)).start()

    def _on_failure(self, rec: Instance, spec: dict[str, Any], unit: str, rc: int, why: str) -> None:
        """The unit ended failed: start its ``OnFailure=`` units, as systemd does, with the
        ``MONITOR_*`` variables (:func:`petctl.local.shims.systemctl.on_failure`). They run as
        processes of the instance but not as its main unit (their exit restarts nothing)."""
        names, monitor = on_failure(spec, unit, rc, why)
        for name in names:
            with rec.lock:
                if rec.state != "exited" or self.stopping.is_set():
                    return  # it left meanwhile
                try:
                    with open(self.state_dir / "logs" / f"{rec.instance_id}.log", "ab") as out:
                        u, _ = boot.start_unit(
                            rec.root(self.state_dir),
                            self.state_dir,
                            name,
                            {**self._unit_env(rec), **monitor},
                            out,
                            self.clients.__getitem__,
                            rec.az,
                        )
                except Exception as e:  # noqa: BLE001 - as systemd: the OnFailure= job fails, logged
                    rec.note = f"OnFailure={name} of {unit} did not start: {e}"
                    log.warning("%s: %s", rec.instance_id, rec.note)
                    continue
                rec.units[name] = u
                self._write_procs()
            log.info(
                "%s: %s failed (%s): started OnFailure=%s, pid %d",
                rec.instance_id,
                unit,
                why,
                name,
                u.proc.pid,
            )

    def _restart_unit(self, rec: Instance, unit: str) -> None:
        with rec.lock:
            if rec.state != "restarting" or self.stopping.is_set():
                return  # it left meanwhile
            self._unit_starts.setdefault((rec.instance_id, unit), []).append(time.monotonic())
            try:
                u, _ = self._start_unit(rec, unit)
            except Exception as e:  # noqa: BLE001 - a unit that cannot start stays down, as systemd's
                rec.state, rec.ended_at, rec.note = "exited", time.time(), f"restart of {unit} failed: {e}"
                log.warning("%s: %s", rec.instance_id, rec.note)
                return
            rec.exit_code, rec.state = None, "running"
            rec.restarts += 1
        log.info("%s: %s restarted, main pid %d", rec.instance_id, unit, u.proc.pid)

    def _boot_without_service(self, a: plan.BootWithoutService) -> None:
        rec = self.get(a.instance_id)
        with rec.lock:
            if rec.state != "running" or rec.proc is not None:
                return
            rec.exit_code, rec.state, rec.ended_at = a.rc, "exited", time.time()
            rec.note = (
                f"boot script failed (exit {a.rc})"
                if a.rc
                else "boot script finished without starting a service"
            )
        log.warning("%s: %s", rec.instance_id, rec.note)

    def _warmed(self, a: plan.Warmed) -> None:
        """Its boot is done in the pool: AWS stops it (moto), and its processes stop here."""
        rec = self.get(a.instance_id)
        with rec.lock:
            state = moto_warm_pool.mark_warmed(rec.instance_id, self.region)
            if state is None or rec.state != "running":
                return  # a scale-out took it meanwhile: the next tick resumes it
            rec.warm = state
            if state != plan.WARMED + "Running" and rec.pgid:
                procs.signal_tree(rec.pgid, rec.marker, signal.SIGSTOP)
                rec.paused = True
        log.info("%s: warmed up; %s in its pool", rec.instance_id, state)

    def _resume(self, a: plan.Resume) -> None:
        """A scale-out moved it from the pool into its group: it runs on, InService."""
        rec = self.get(a.instance_id)
        with rec.lock:
            was = rec.warm
            rec.warm, rec.lifecycle = None, "InService"
            if rec.paused and rec.pgid:
                procs.signal_tree(rec.pgid, rec.marker, signal.SIGCONT)
            rec.paused = False
        log.info("%s: taken from the warm pool (%s) into %s; InService", rec.instance_id, was, rec.asg)

    def _terminate_orphans(self, a: plan.TerminateOrphans) -> None:
        log.info("terminating %s: their Auto Scaling group was deleted", ", ".join(a.instance_ids))
        self.clients["ec2"].terminate_instances(InstanceIds=list(a.instance_ids))

    def _replace_unhealthy(self, a: plan.ReplaceUnhealthy) -> None:
        """Terminated without decrement, so the group replaces it, as its health check does on AWS
        (moto only records the status)."""
        rec = self.get(a.instance_id)
        rec.replaced = True
        log.info("%s: Unhealthy in %s; the group replaces it", rec.instance_id, a.group)
        try:
            self.clients["autoscaling"].terminate_instance_in_auto_scaling_group(
                InstanceId=rec.instance_id, ShouldDecrementDesiredCapacity=False
            )
        except Exception as e:  # noqa: BLE001 - e.g. the group went meanwhile
            log.warning("%s: cannot replace it (%s)", rec.instance_id, e)

    # ------------------------------------------------------------------ status / shutdown

    def get(self, instance_id: str) -> Instance:
        with self.lock:
            rec = self.instances.get(instance_id)
        if rec is None:
            raise LookupError(f"no instance {instance_id} in the local cloud")
        return rec

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
            rec.reap()
        for t in self._threads:
            t.join(timeout=5)
        self._write_procs_empty()
        return killed

    def _write_procs_empty(self) -> None:
        path = self.state_dir / "procs.json"
        if all(not (r.pgid and procs.tree_members(r.pgid, r.marker)) for r in self.instances.values()):
            path.unlink(missing_ok=True)


def _snapshot(rec: Instance) -> plan.Local:
    """The record and its processes as they stand now (the diff's actual state)."""
    with rec.lock:
        return plan.Local(
            state=rec.state,
            tags=dict(rec.tags),
            has_boot=rec.boot is not None,
            boot_rc=rec.boot_rc,
            boot_exit=rec.boot.poll() if rec.boot is not None else None,
            main_exit=rec.proc.poll() if rec.proc is not None else None,
            has_main=rec.proc is not None,
            warm=rec.warm,
            replaced=rec.replaced,
        )
