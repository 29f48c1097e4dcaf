"""What the local cloud knows about one EC2 instance and its process tree (:class:`Instance`).

Instance states (``Instance.state``):

``running``
    booting or booted (boot script and/or its units running); moto says the instance runs.
``exited``
    the main unit's process exited by itself, or the boot script ended (failed, or without
    starting a unit), while the instance still runs in moto.
``restarting``
    ``restart_rdzv``: the instance reboots (its enabled units are killed and started again).
``draining``
    moto terminated the instance; waiting for the drain (lifecycle hook emulation).
``interrupted``
    a spot interruption's deadline passed: shutting down before termination.
``killed``
    hard-killed by ``kill_instance`` (no drain).
``powering-off``
    its OS is shutting down (the ``shutdown`` shim's time came): its units are being stopped.
``powered-off``
    its OS shut down (the ``shutdown`` shim): the tree is gone, EC2 stopped it, and its group
    replaces it (``Leaving.os_shutdown``).
``terminated``
    the tree is gone after the instance left.
``error``
    the boot could not be started (no bash user data, …; see ``note``).
"""

from __future__ import annotations

import datetime as dt
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.local import boot, procs, shims


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Instance:
    """What the local cloud knows about one EC2 instance and its process tree."""

    instance_id: str
    role: str
    job: str | None
    private_ip: str
    az: str
    asg: str | None
    tags: dict[str, str]
    bind_ip: str | None = None
    state: str = "running"
    lifecycle: str = "InService"  # the target lifecycle state IMDS serves
    warm: str | None = None  # its lifecycle state while in a warm pool (Warmed:Pending, Warmed:Stopped)
    paused: bool = False  # every process SIGSTOPped: a stopped warm pool instance
    status_url: str | None = None  # the job's agent status prefix (s3://…/status/), from its spec
    spot_action: dict[str, str] | None = None
    proc: subprocess.Popen | None = None  # the main unit's process (the agent, etcd)
    boot: subprocess.Popen | None = None  # the boot script (bash running the user data)
    boot_rc: int | None = None
    boot_ended_at: float | None = None
    units: dict[str, boot.Unit] = field(default_factory=dict)
    systemd_token: str = field(default_factory=lambda: secrets.token_hex(16))
    replaced: bool = False  # Unhealthy: already terminated in its group
    pgid: int | None = None  # the boot script's process group
    start_ticks: int | None = None
    exit_code: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    restarts: int = 0
    drain_timeout: float | None = None
    marker: str | None = None  # PETCTL_LOCAL_INSTANCE of every process of this instance
    note: str | None = None
    instance_type: str = "t3.medium"
    image_id: str = "ami-local"
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    lifecycle_done: threading.Event = field(default_factory=threading.Event, repr=False)
    #: monotonic time of the last RecordLifecycleActionHeartbeat of its termination action
    lifecycle_heartbeat: float | None = None
    #: monotonic time of its scheduled power-off (``shutdown +N``), None when none is scheduled
    shutdown_at: float | None = None

    def popens(self) -> list[subprocess.Popen]:
        return [p for p in [self.boot, *(u.proc for u in self.units.values())] if p is not None]

    def reap(self, timeout: float = 5) -> None:
        """Collect the exit status of the processes this daemon started for the instance."""
        for p in self.popens():
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    @property
    def alive(self) -> bool:
        return bool(self.pgid and procs.tree_members(self.pgid, self.marker))

    def summary(self, state_dir: Path, live: tuple[set[int], set[str]] | None = None) -> dict[str, Any]:
        if live is None:
            alive = self.alive
        else:
            alive = bool(self.pgid and (self.pgid in live[0] or self.marker in live[1]))
        return {
            "instance_id": self.instance_id,
            "role": self.role,
            "job": self.job,
            "ip": self.private_ip,
            "bind_ip": self.bind_ip,
            "az": self.az,
            "group": self.asg,
            "state": self.state,
            "lifecycle_state": self.lifecycle,
            "warm": self.warm,
            "paused": self.paused,
            "spot_action": self.spot_action,
            # the main unit's process once there is one; the boot script's before
            "pid": self.proc.pid if self.proc else self.boot.pid if self.boot else None,
            "pgid": self.pgid,
            "alive": alive,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            # /mnt/efs, or (a job's access point) /mnt/efs/petctl/jobs/<job>
            "efs_id": next(
                (
                    source.split(":")[0]
                    for point, source in sorted(shims.mounted(self.root(state_dir)).items())
                    if point == "/mnt/efs" or point.startswith("/mnt/efs/")
                ),
                None,
            ),
            "boot": self._boot_summary(state_dir),
            "units": {n: {"pid": u.proc.pid, "exit_code": u.proc.poll()} for n, u in self.units.items()},
            "root": str(self.root(state_dir)),
            "refused": self._refused(state_dir),
            "log": str(state_dir / "logs" / f"{self.instance_id}.log"),
            "note": self.note,
        }

    def _boot_summary(self, state_dir: Path) -> dict[str, Any]:
        if self.boot is not None and self.boot_rc is None and self.boot.poll() is not None:
            # Ended while the instance was leaving (the reconcile loop no longer looks at it).
            self.boot_rc, self.boot_ended_at = self.boot.returncode, time.time()
        rc = self.boot_rc
        return {
            "pid": self.boot.pid if self.boot else None,
            "state": None
            if self.boot is None
            else "running"
            if rc is None
            else "done"
            if rc == 0
            else "failed",
            "exit_code": rc,
            "seconds": round(self.boot_ended_at - self.started_at, 2)
            if self.boot_ended_at and self.started_at
            else None,
            "script": str(state_dir / "instances" / self.instance_id / "user-data.sh"),
        }

    def _refused(self, state_dir: Path) -> list[str]:
        """What the boot's shims refused (newest last): the local cloud cannot model it."""
        try:
            return shims.refusals_file(self.root(state_dir)).read_text().splitlines()[-5:]
        except OSError:
            return []

    def root(self, state_dir: Path) -> Path:
        return state_dir / "instances" / self.instance_id / "root"
