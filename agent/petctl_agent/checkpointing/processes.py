"""Which process this is, and whether another one is still there, by pid and start time.

The snapshot budget's ledger (:mod:`.budget`) names each allocation's process, and a writer's seal
(:mod:`.verification`) its writer; both count only while that process lives. A pid alone could be
reused: a process is its pid and its start time (``/proc/<pid>/stat``), in its pid namespace.
"""

from __future__ import annotations

import os


def start_time(pid: int) -> str | None:
    """``pid``'s start time (``/proc/<pid>/stat``, field 22): a reused pid has another; None: dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[19].decode() if len(fields) > 19 else None


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), None when unreadable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def alive(pid: int, started: str | None, pidns: int | None = None) -> bool:
    """Might process ``pid`` (started at ``started``, :func:`start_time`, in pid namespace ``pidns``)
    still be there, and not a zombie (one that exited but is not reaped yet holds no mappings)?
    Only a positive answer that it is gone counts as gone: a pid of another pid namespace (or an
    unknown one), an unknown start time, or a ``/proc`` that cannot be read all count as alive."""
    if started is None or pidns is None or pidns != pid_namespace():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return False
    return len(fields) <= 19 or fields[19].decode() == started


_me: tuple[int, str | None] | None = None  # (pid, start time) of this process, read once per pid


def this_process() -> tuple[int, str | None]:
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:  # a forked child is another process
        _me = (pid, start_time(pid))
    return _me


def die_with_parent() -> None:
    """SIGTERM this process when its parent (the agent) dies (Linux ``PR_SET_PDEATHSIG``): a
    store is never served, nor filled, with nobody owning it any more."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
