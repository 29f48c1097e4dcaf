"""``flock`` helpers shared by the worker's side (``checkpointing/persist.py``) and the agent's
(``node/snapshots.py``): the agent's store and its persister each say "alive" by holding an
exclusive ``flock`` on a file for as long as they live (the kernel drops it when they die), and
the other side asks whether anyone holds it. Standard library only (a contracts module).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


def hold(path: str | os.PathLike) -> int:
    """Open (create, mode 0600) ``path`` and take an exclusive ``flock`` on it, waiting for it.

    Returns the fd: the lock lasts until it is closed or the process dies.
    """
    fd = os.open(Path(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_hold(path: str | os.PathLike, create: bool = True) -> int | None:
    """``path``'s exclusive ``flock`` if nobody holds a lock on it (non-blocking), else None.

    Returns the fd (the lock lasts until it is closed). ``create``: make ``path`` (mode 0600) if
    missing; else a missing ``path`` is None too.
    """
    try:
        fd = (
            os.open(Path(path), os.O_RDWR | os.O_CREAT, 0o600) if create else os.open(Path(path), os.O_RDONLY)
        )
    except OSError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def held(path: str | os.PathLike) -> bool:
    """Does some live process hold an exclusive ``flock`` on ``path``? False when it is missing.

    A non-blocking shared probe: a shared lock we took is dropped again at once (closing the fd).
    """
    try:
        fd = os.open(Path(path), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def flock_within(fd: int, op: int, wait: float, poll: float) -> bool:
    """Take ``flock(fd, op)`` (``LOCK_EX`` or ``LOCK_SH``), trying every ``poll`` s for at most
    ``wait`` s: True once held, False if the wait ran out (a holder stopped with it must not hang
    the caller)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll)


def mount_of(path: str | os.PathLike, mounts: str = "/proc/mounts") -> tuple[str, str | None]:
    """The mount point that holds ``path`` (an existing, resolved path) and its filesystem type
    (the longest matching mount in ``mounts``); ("", None) when none is found or it is unreadable."""
    p = str(path)
    best, kind = "", None
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = p == mnt or p.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return "", None
    return best, kind
