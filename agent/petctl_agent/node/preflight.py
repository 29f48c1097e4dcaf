"""Checks at boot, before this node joins anything: the shared filesystem, the etcd TLS files, torch.

Each turns a setup mistake into one ``FAILED`` line now, instead of a node that waits or retries
for ever inside the rendezvous.
"""

from __future__ import annotations

import os
import socket
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


def require_writable_dir(path: Path, what: str) -> None:
    """Make ``path`` (parents included) and create and remove a file in it, now: a directory this
    node cannot write would otherwise surface only at the job's first save (``EACCES``), after
    that much training. The usual cause is a job directory an earlier petctl made as root, which
    the job's access point (its own uid) cannot write: terminal, no restart cures it."""
    probe = path / f".petctl-write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise SpecError(
            f"cannot write the {what} {path} ({e.strerror or e}); most likely a job directory an earlier "
            f"petctl made as root: give it to the job's uid (docs/contracts.md, 'Upgrading') "
            f"or run the job under a new name"
        ) from None


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
