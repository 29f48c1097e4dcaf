"""The agent's ``PETCTL_*`` knobs, read from the environment once (docs/agent.md, "Environment").

Standard library only: ``petctl.local`` imports :func:`env_float` from here. The agent builds one
:class:`Settings` at start (:meth:`Settings.from_env`) and passes it to what it constructs; no
constructor reads the environment. Worker-side variables (``PETCTL_CHECKPOINT_DIR``,
``PETCTL_DRAIN_FILE``, ...) are the agent's output to its workers, read there by
``petctl_agent.checkpoint``/``distributed``, and are not settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from petctl_agent.workarounds import WORKAROUNDS, switched_off

#: IMDS base URL on EC2 (the local cloud's is ``PETCTL_IMDS_URL``); ``cloud.imds`` uses it too
DEFAULT_IMDS_URL = "http://169.254.169.254"


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """``float($name)``, or ``default`` when it is unset, empty or not a number."""
    try:
        return float((os.environ if env is None else env).get(name) or default)
    except ValueError:
        return default


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """``int($name)`` (``2.0`` reads as 2), or ``default`` when it is unset, empty or not a number."""
    return int(env_float(name, default, env))


def exclude_after(env: Mapping[str, str], default: int = 3) -> int:
    """``PETCTL_AGENT_EXCLUDE_AFTER`` in ``env`` (the agent's environment, or a job's own ``run-job
    --env``, which overrides it): failed rounds in a row that began on one node before it leaves the
    job; 0 (or less): never."""
    return max(0, env_int("PETCTL_AGENT_EXCLUDE_AFTER", default, env))


def _env_opt(name: str, env: Mapping[str, str]) -> float | None:
    """An optional override: None when unset (the default then comes from the spec or the backend)."""
    try:
        return float(env[name]) if env.get(name) else None
    except ValueError:
        return None


@dataclass(frozen=True)
class EtcdTls:
    """Client TLS to the job's etcd: CA bundle, client certificate and its key (paths)."""

    cacert: str
    cert: str
    key: str


@dataclass(frozen=True)
class Settings:
    """Every knob of the agent process. Field defaults are the documented defaults."""

    imds_url: str = DEFAULT_IMDS_URL  # PETCTL_IMDS_URL
    efs_mount: Path = Path("/mnt/efs")  # PETCTL_EFS_MOUNT
    agent_dir: Path = Path("/var/lib/petctl")  # PETCTL_AGENT_DIR
    #: where the job's environments (its requirements) are cached; empty: <agent_dir>/envs
    envs_dir: str = ""  # PETCTL_AGENT_ENVS_DIR
    efs_wait: float = 300.0  # PETCTL_AGENT_EFS_WAIT
    join_timeout: float | None = None  # PETCTL_AGENT_JOIN_TIMEOUT (None: the spec's)
    rdzv_attempt: float = 300.0  # PETCTL_AGENT_RDZV_ATTEMPT
    failure_grace: float | None = None  # PETCTL_AGENT_FAILURE_GRACE (None: from the backend)
    lifecycle_wait: float = 120.0  # PETCTL_AGENT_LIFECYCLE_WAIT
    drain_probe: float = 5.0  # PETCTL_AGENT_DRAIN_PROBE
    leave_fallback: float = 30.0  # PETCTL_AGENT_LEAVE_FALLBACK
    last_call: int = 5  # PETCTL_AGENT_LAST_CALL
    failure_limit: int = 5  # PETCTL_AGENT_FAILURE_LIMIT: unclean ends on one instance (node/crashes.py)
    #: failed rounds in a row that began on one node before it leaves the job (elastic/culprit.py);
    #: 0: never. The job's ``run-job --env PETCTL_AGENT_EXCLUDE_AFTER=N`` overrides it
    exclude_after: int = 3  # PETCTL_AGENT_EXCLUDE_AFTER
    keepalive: int = 1  # PETCTL_AGENT_KEEPALIVE
    keepalive_attempts: int = 5  # PETCTL_AGENT_KEEPALIVE_ATTEMPTS
    store_timeout: float = 20.0  # PETCTL_AGENT_STORE_TIMEOUT
    sync_timeout: float | None = None  # PETCTL_AGENT_SYNC_TIMEOUT (None: from drain_timeout)
    membership_interval: float = 1.0  # PETCTL_AGENT_MEMBERSHIP_INTERVAL
    imds_poll: float = 1.0  # PETCTL_AGENT_IMDS_POLL
    status_interval: float = 5.0  # PETCTL_AGENT_STATUS_INTERVAL
    rdzv_backend: str = ""  # PETCTL_AGENT_RDZV_BACKEND ("" = the spec's)
    cloudwatch: bool = True  # PETCTL_AGENT_NO_CLOUDWATCH=1 turns it off
    log_level: str = "INFO"  # PETCTL_AGENT_LOG_LEVEL
    torch_log: str = "WARNING"  # PETCTL_AGENT_TORCH_LOG
    #: workarounds switched off with PETCTL_AGENT_NO_<NAME>=1
    workarounds_off: frozenset[str] = field(default_factory=frozenset)
    etcd_cacert: str = ""  # PETCTL_ETCD_CACERT
    etcd_cert: str = ""  # PETCTL_ETCD_CERT
    etcd_key: str = ""  # PETCTL_ETCD_KEY
    launch_hook: str = ""  # PETCTL_LAUNCH_HOOK (set by the worker boot only with a warm pool)
    #: the command that powers this instance off, the last resort after a failed scale to zero
    #: (the worker's unit sets the boot's petctl-power-off); empty: none, only logged
    power_off: str = ""  # PETCTL_AGENT_POWER_OFF
    #: memory snapshots of replicated state: the tmpfs under which the agent keeps
    #: <job>/<instance-id>; on by default, PETCTL_AGENT_NO_SNAPSHOTS=1 (or an empty dir) turns them off
    snapshot_dir: str = "/dev/shm/petctl"  # PETCTL_AGENT_SNAPSHOT_DIR
    snapshots: bool = True  # PETCTL_AGENT_NO_SNAPSHOTS=1 turns them off
    #: a joining node fetches its peers' newest snapshot agent to agent as the round closes
    snapshot_fetch: bool = True  # PETCTL_AGENT_NO_SNAPSHOT_FETCH=1 turns it off (the restore's gloo path)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        snapshot_dir = e.get("PETCTL_AGENT_SNAPSHOT_DIR", "/dev/shm/petctl")
        return cls(
            imds_url=(e.get("PETCTL_IMDS_URL") or DEFAULT_IMDS_URL).rstrip("/"),
            efs_mount=Path(e.get("PETCTL_EFS_MOUNT") or "/mnt/efs").absolute(),
            # workers run in the job's work dir, not here: keep the paths absolute
            agent_dir=Path(e.get("PETCTL_AGENT_DIR") or "/var/lib/petctl").absolute(),
            envs_dir=e.get("PETCTL_AGENT_ENVS_DIR", ""),
            efs_wait=env_float("PETCTL_AGENT_EFS_WAIT", 300, e),
            join_timeout=_env_opt("PETCTL_AGENT_JOIN_TIMEOUT", e),
            rdzv_attempt=env_float("PETCTL_AGENT_RDZV_ATTEMPT", 300, e),
            failure_grace=_env_opt("PETCTL_AGENT_FAILURE_GRACE", e),
            lifecycle_wait=env_float("PETCTL_AGENT_LIFECYCLE_WAIT", 120, e),
            drain_probe=env_float("PETCTL_AGENT_DRAIN_PROBE", 5, e),
            leave_fallback=env_float("PETCTL_AGENT_LEAVE_FALLBACK", 30, e),
            last_call=env_int("PETCTL_AGENT_LAST_CALL", 5, e),
            failure_limit=env_int("PETCTL_AGENT_FAILURE_LIMIT", 5, e),
            exclude_after=exclude_after(e),
            keepalive=env_int("PETCTL_AGENT_KEEPALIVE", 1, e),
            keepalive_attempts=env_int("PETCTL_AGENT_KEEPALIVE_ATTEMPTS", 5, e),
            store_timeout=env_float("PETCTL_AGENT_STORE_TIMEOUT", 20, e),
            sync_timeout=_env_opt("PETCTL_AGENT_SYNC_TIMEOUT", e),
            membership_interval=env_float("PETCTL_AGENT_MEMBERSHIP_INTERVAL", 1, e),
            imds_poll=env_float("PETCTL_AGENT_IMDS_POLL", 1, e),
            status_interval=env_float("PETCTL_AGENT_STATUS_INTERVAL", 5, e),
            rdzv_backend=e.get("PETCTL_AGENT_RDZV_BACKEND", ""),
            cloudwatch=e.get("PETCTL_AGENT_NO_CLOUDWATCH", "") != "1",
            log_level=e.get("PETCTL_AGENT_LOG_LEVEL") or "INFO",
            torch_log=e.get("PETCTL_AGENT_TORCH_LOG") or "WARNING",
            workarounds_off=frozenset(n for n in WORKAROUNDS if switched_off(n, e)),
            etcd_cacert=e.get("PETCTL_ETCD_CACERT", ""),
            etcd_cert=e.get("PETCTL_ETCD_CERT", ""),
            etcd_key=e.get("PETCTL_ETCD_KEY", ""),
            launch_hook=e.get("PETCTL_LAUNCH_HOOK", ""),
            power_off=e.get("PETCTL_AGENT_POWER_OFF", ""),
            snapshot_dir=snapshot_dir,
            snapshots=e.get("PETCTL_AGENT_NO_SNAPSHOTS", "") != "1" and snapshot_dir != "",
            snapshot_fetch=e.get("PETCTL_AGENT_NO_SNAPSHOT_FETCH", "") != "1",
        )

    def sync_timeout_for(self, drain_timeout: float) -> float:
        """How long a membership change's coordinated stop waits for the workers' checkpoint:
        ``$PETCTL_AGENT_SYNC_TIMEOUT``, else the drain timeout within [5, 30] s."""
        return min(max(drain_timeout, 5.0), 30.0) if self.sync_timeout is None else self.sync_timeout

    def stop_wait_for(self, drain_timeout: float) -> float:
        """How long the rendezvous leader waits for a node of the previous round to stop its
        workers and join: the sync timeout, plus the membership check that notices the round
        (``membership_interval``) and the join itself (5 s margin)."""
        return self.sync_timeout_for(drain_timeout) + self.membership_interval + 5.0

    def enabled(self, workaround: str) -> bool:
        """Is the torch workaround ``workaround`` on (not switched off)?"""
        if workaround not in WORKAROUNDS:
            raise KeyError(workaround)
        return workaround not in self.workarounds_off

    @property
    def etcd_tls(self) -> EtcdTls | None:
        """Client TLS to etcd when all three paths are set, else None (plain http).

        Raises ValueError when only some are set: half a TLS setup would silently talk http.
        """
        paths = {
            "PETCTL_ETCD_CACERT": self.etcd_cacert,
            "PETCTL_ETCD_CERT": self.etcd_cert,
            "PETCTL_ETCD_KEY": self.etcd_key,
        }
        if not any(paths.values()):
            return None
        missing = [k for k, v in paths.items() if not v]
        if missing:
            raise ValueError(
                f"etcd TLS needs PETCTL_ETCD_CACERT, PETCTL_ETCD_CERT and PETCTL_ETCD_KEY; {', '.join(missing)} unset"
            )
        return EtcdTls(self.etcd_cacert, self.etcd_cert, self.etcd_key)
