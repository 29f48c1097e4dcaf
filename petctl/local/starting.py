"""Starting what runs on a local instance: its boot (the user data, with bash), the units its boot
script enables (``systemctl enable --now`` through the IMDS server), and a reboot
(``restart_rdzv``). A mixin of :class:`petctl.local.reconciler.Reconciler`, whose state it shares.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from petctl.local import boot, efs_rate, etcd_release, procs, shims
from petctl.local.environment import LOCAL_ENV, LOCAL_ENV_UNSET
from petctl.local.instance import Instance, iso
from petctl.local.plan import ASG_TAG, JOB_TAG, RDZV_TAG, ROLE_TAG, SPEC_TAG, Seen

log = logging.getLogger("petctl.local.reconciler")

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
        efs_rate.ENV,
        efs_rate.HOOK_ENV,
    )
)


class Starting:
    """Boots instances and starts their units (see the module docstring)."""

    state_dir: Path
    clients: dict[str, Any]
    endpoint_url: str
    imds_url: str
    region: str
    settings: Any
    token: str
    lock: threading.RLock
    instances: dict[str, Instance]
    _user_data_cache: dict[str, str]

    if TYPE_CHECKING:  # provided by Reconciler (petctl.local.reconciler) and the other mixin

        def get(self, instance_id: str) -> Instance: ...

        def _write_procs(self) -> None: ...

    def _new_instance(self, seen: Seen) -> Instance:
        data, tags = seen.data, dict(seen.tags)
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
        environment (not the boot script's variables, as under systemd), its marker, the IMDS URL
        (the local cloud's IMDS is not at 169.254.169.254) and the EFS limits' config
        (:mod:`petctl.local.efs_rate`). The job's requirements are installed once per job, with
        this machine's pip, beside its cached venv (``<state>/venvs/<job>/envs``): the agents of a
        job's instances share it and take turns."""
        env = self._base_env()
        env[procs.MARKER] = rec.marker or ""
        env["PETCTL_IMDS_URL"] = f"{self.imds_url}/{rec.instance_id}"
        if rec.job:
            env["PETCTL_AGENT_ENVS_DIR"] = str(self.state_dir / "venvs" / rec.job / "envs")
        env.update(efs_rate.instance_env(self.state_dir, rec.instance_id, self.settings.efs_rates))
        return env

    def _start(self, rec: Instance) -> None:
        """Boot the instance: run its user data (see petctl.local.boot)."""
        with rec.lock:
            spec = self.job_spec(rec) or {}
            rec.drain_timeout = float(spec.get("drain_timeout") or self.settings.default_drain_timeout)
            rec.status_url = spec.get("status_url") if isinstance(spec.get("status_url"), str) else None
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
                # A rendezvous boot's etcd tarball: the local stand-in for the pinned release.
                etcd_sha256 = (
                    etcd_release.local_release(self.state_dir)[1]
                    if etcd_release.pins_release(script)
                    else None
                )
                root, bin_dir, path = boot.prepare(inst_dir, script, loopback, etcd_sha256)
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
                self.clients.__getitem__,
                rec.az,
            )
        main = next((n for n, x in rec.units.items() if x.proc is rec.proc), None) if rec.proc else None
        rec.units[unit] = u
        # The instance's main process is its first unit's (etcd beside a live job's lighthouse, the
        # agent): a later unit does not take its place, a restart of the main unit does.
        if rec.proc is None or rec.proc.poll() is not None or main == unit:
            rec.proc = u.proc
        self._write_procs()
        return u, deadline

    def _stop_units(self, rec: Instance) -> None:
        """What stopping the instance's services sends first: each unit's KillSignal (KillMode)."""
        for u in list(rec.units.values()):
            u.stop_signal()

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
            rec.reap()
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
