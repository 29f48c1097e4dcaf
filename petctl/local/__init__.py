"""The embedded local cloud: ``petctl --local`` and ``petctl local …``.

One background daemon (``python -m petctl.local.daemon``) hosts an AWS API
emulator (a moto server on 127.0.0.1), a per-instance IMDS emulator, and a
reconciler that keeps one local process tree per running EC2 instance, booted by
running the user data of its launch template (which starts a real etcd on the
rendezvous instance, the real ``petctl-agent`` on workers). See ``docs/local.md``
for what is and is not emulated.

This package's namespace is the client API (:mod:`petctl.local.client`); importing it loads
the standard library only (and click through ``petctl.errors``).
"""

from petctl.local.client import (
    LocalCloudError,
    activate,
    cloud_log,
    ensure_started,
    instance_log,
    kill_instance,
    log_path,
    restart_rdzv,
    spot_interrupt,
    state_dir,
    status,
    stop,
)
from petctl.local.environment import LOCAL_ENV, LOCAL_ENV_UNSET, REGION

__all__ = [
    "LOCAL_ENV",
    "LOCAL_ENV_UNSET",
    "REGION",
    "LocalCloudError",
    "activate",
    "cloud_log",
    "ensure_started",
    "instance_log",
    "kill_instance",
    "log_path",
    "restart_rdzv",
    "spot_interrupt",
    "state_dir",
    "status",
    "stop",
]
