"""Checks at boot, before this node joins anything: the shared filesystem, the etcd TLS files, torch.

Each turns a setup mistake into one ``FAILED`` line now, instead of a node that waits or retries
for ever inside the rendezvous.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from petctl_agent.settings import Settings
from petctl_agent.spec import SpecError


def wait_for_dir(path: Path, timeout: float, what: str) -> None:
    """Wait (bounded) for a directory, e.g. the EFS mount, to exist."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if time.monotonic() > deadline:
            raise SpecError(
                f"{what} {path} did not appear within {timeout:.0f}s (is the filesystem mounted?)"
            )
        time.sleep(1)


def check_etcd_tls(settings: Settings) -> None:
    """Refuse half a TLS setup or a missing file now, before a handler retries TLS errors for ever."""
    tls = settings.etcd_tls
    if tls is None:
        return
    for var, path in (
        ("PETCTL_ETCD_CACERT", tls.cacert),
        ("PETCTL_ETCD_CERT", tls.cert),
        ("PETCTL_ETCD_KEY", tls.key),
    ):
        if not os.path.isfile(path):
            raise ValueError(f"{var}={path} is not a file: the boot script fetches the job's TLS files first")


def check_torch(wanted_version: str, backend: str = "petctl-etcd") -> str | None:
    """One-line reason the installed torch cannot run this job (wrong version, missing internals
    that the agent uses with ``backend``)."""
    from petctl_agent.elastic.torch_compat import check, required_for

    return check(wanted_version, required_for(backend))
