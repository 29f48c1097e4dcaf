"""The local cloud's state directory, as the client sees it: where things are, whether a daemon
owns it (``daemon.lock``, ``cloud.json``), and cleaning up after a daemon that died. Standard
library only."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import petctl
from petctl.local import procs

DAEMON_MODULE = "petctl.local.daemon"


# ---------------------------------------------------------------------------- paths


def state_dir() -> Path:
    """``$PETCTL_LOCAL_DIR``, else ``$PETCTL_HOME/local``, else ``~/.petctl/local``."""
    d = os.environ.get("PETCTL_LOCAL_DIR")
    return Path(d).expanduser().absolute() if d else petctl.home() / "local"


def cloud_log(d: Path | None = None) -> Path:
    return (d or state_dir()) / "cloud.log"


def instance_log(instance_id: str, d: Path | None = None) -> Path:
    return (d or state_dir()) / "logs" / f"{instance_id}.log"


@contextlib.contextmanager
def file_lock(path: Path, timeout: float, error: type[Exception] = TimeoutError) -> Iterator[None]:
    """An exclusive advisory lock (serialises concurrent ``ensure_started`` calls)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise error(f"another process holds {path} for more than {timeout:.0f}s") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def daemon_lock_held(d: Path) -> bool:
    """True while a daemon holds ``daemon.lock`` (it does for its whole life)."""
    path = d / "daemon.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if we got it
    return False


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_our_daemon(pid: int, d: Path) -> bool:
    cmd = procs.cmdline(pid)
    return procs.is_alive(pid) and DAEMON_MODULE in cmd and str(d) in cmd


def starting_pid(d: Path) -> int | None:
    """Pid of a daemon that holds the lock but has not written cloud.json yet."""
    if not daemon_lock_held(d):
        return None
    try:
        pid = int((d / "daemon.lock").read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid > 1 and is_our_daemon(pid, d) else None


def running_info(d: Path) -> dict[str, Any] | None:
    """cloud.json of a live daemon for ``d``, or None."""
    info = read_json(d / "cloud.json")
    if not info or not isinstance(info.get("pid"), int):
        return None
    if not is_our_daemon(info["pid"], d):
        return None
    return info


def reap(pid: int) -> None:
    """Collect our own child's exit status (a zombie still looks like a pid)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        reap(pid)
        if not procs.is_alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def cleanup_leftovers(d: Path) -> list[dict[str, Any]]:
    """Kill the instance process trees a dead daemon recorded in procs.json.

    Only processes that are provably ours are signalled: a process group whose
    leader has the recorded start time (see :func:`procs.owned_group_alive`), or a
    process carrying that daemon's random instance marker. Nothing the daemon did
    not start is touched.
    """
    data = read_json(d / "procs.json") or {}
    killed = []
    for iid, entry in (data.get("groups") or {}).items():
        pgid, ticks, marker = entry.get("pgid"), entry.get("start_ticks"), entry.get("marker")
        pgid = pgid if isinstance(pgid, int) and pgid > 1 else None
        if pgid and not procs.owned_group_alive(pgid, ticks):
            pgid = None
        marker = marker if isinstance(marker, str) and "@" in marker else None
        if (pgid or marker) and procs.tree_members(pgid, marker):
            procs.kill_tree(pgid, marker)
            killed.append({"instance_id": iid, "pgid": entry.get("pgid")})
    with contextlib.suppress(FileNotFoundError):
        (d / "procs.json").unlink()
    return killed
