"""Process-group helpers for the local cloud (Linux ``/proc``; standard library only).

An "instance" of the local cloud is a process *tree*: its leader is started with
``start_new_session=True`` (so its process group id equals its pid), and every
process it starts inherits the environment variable ``PETCTL_LOCAL_INSTANCE``
(``<instance-id>@<daemon token>``). A process belongs to the instance if it is in
the leader's process group **or** carries that marker: torch's elastic agent
starts its workers with ``start_new_session=True``, so they leave the group (and
outlive their agent), but they keep the environment. Terminating an instance
signals both; "the tree is gone" means no live (non-zombie) process matches.

Processes are identified by ``(pid, start time)`` rather than pid alone, so a
pid reused by an unrelated program is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name, or None if gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may contain spaces.
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (stable identity with the pid)."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def is_alive(pid: int, ticks: int | None = None) -> bool:
    """True if ``pid`` exists, is not a zombie, and (if given) started at ``ticks``."""
    f = _stat_fields(pid)
    if not f or f[0] in ("Z", "X"):
        return False
    return ticks is None or int(f[19]) == ticks


def cmdline(pid: int) -> list[str]:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _all_stats() -> list[tuple[int, list[str]]]:
    out = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            f = _stat_fields(int(entry.name))
            if f:
                out.append((int(entry.name), f))
    return out


MARKER = "PETCTL_LOCAL_INSTANCE"
_MARKER_B = MARKER.encode() + b"="


def _marker_of(pid: int) -> str | None:
    """The value of ``PETCTL_LOCAL_INSTANCE`` in ``pid``'s environment, if any."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or another user's process
        return None
    if _MARKER_B not in raw:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(_MARKER_B):
            return item[len(_MARKER_B) :].decode(errors="replace")
    return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    return [pid for pid, f in _all_stats() if int(f[2]) == pgid and f[0] not in ("Z", "X")]


def tree_members(pgid: int | None, marker: str | None) -> list[int]:
    """Live processes of an instance: in process group ``pgid``, or carrying ``marker``."""
    me = os.getpid()
    out = []
    for pid, f in _all_stats():
        if f[0] in ("Z", "X") or pid == me:
            continue
        if (pgid and int(f[2]) == pgid) or (marker and _marker_of(pid) == marker):
            out.append(pid)
    return out


def live_trees() -> tuple[set[int], set[str]]:
    """(process groups with a live member, markers carried by a live process) — one /proc scan."""
    groups, markers = set(), set()
    for pid, f in _all_stats():
        if f[0] in ("Z", "X"):
            continue
        groups.add(int(f[2]))
        m = _marker_of(pid)
        if m:
            markers.add(m)
    return groups, markers


def signal_tree(pgid: int | None, marker: str | None, sig: int) -> int:
    """Send ``sig`` to every process of an instance; returns how many were signalled."""
    n = 0
    for pid in tree_members(pgid, marker):
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def wait_tree_gone(pgid: int | None, marker: str | None, timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not tree_members(pgid, marker):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def kill_tree(pgid: int | None, marker: str | None, timeout: float = 10.0) -> bool:
    """SIGKILL every process of an instance (repeatedly: a dying parent may still fork)."""
    deadline = time.monotonic() + timeout
    while signal_tree(pgid, marker, signal.SIGKILL):
        if wait_tree_gone(pgid, marker, min(1.0, max(0.0, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
    return True


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children, grandchildren, … — including orphans it adopted)."""
    children: dict[int, list[int]] = {}
    for p, f in _all_stats():
        if f[0] not in ("Z", "X"):
            children.setdefault(int(f[1]), []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def zombie_children(ppid: int) -> list[int]:
    """Zombie children of ``ppid`` (orphans re-parented to a subreaper)."""
    return [pid for pid, f in _all_stats() if int(f[1]) == ppid and f[0] == "Z"]


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if it no longer exists."""
    if pgid <= 1:  # never signal "every process" or init by accident
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def signal_pid(pid: int, sig: int, ticks: int | None = None) -> bool:
    if pid <= 1 or not is_alive(pid, ticks):
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait_group_gone(pgid: int, timeout: float, poll: float = 0.05) -> bool:
    """Wait until no live process is left in ``pgid``; True if it is gone."""
    deadline = time.monotonic() + timeout
    while True:
        if not group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def kill_group(pgid: int, timeout: float = 10.0) -> bool:
    """SIGKILL every process of ``pgid`` (repeatedly, until none is left)."""
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        signal_group(pgid, signal.SIGKILL)
        if wait_group_gone(pgid, min(1.0, max(0.0, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
    return True


def owned_group_alive(pgid: int, leader_ticks: int | None) -> bool:
    """True if ``pgid`` is (still) a group we started.

    Linux does not reuse a pid while a process group of that id exists, so a
    group whose leader is dead but which still has members is ours. A live
    leader must also have the start time we recorded.
    """
    if _stat_fields(pgid) is not None and is_alive(pgid):
        return start_ticks(pgid) == leader_ticks if leader_ticks is not None else True
    return bool(group_members(pgid))


def set_child_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (so it can reap them)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - best effort; only affects zombie reaping
        return False


def reap_orphans(exclude: set[int]) -> None:
    """Reap zombie children of this process that no Popen object owns."""
    for pid in zombie_children(os.getpid()):
        if pid in exclude:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
