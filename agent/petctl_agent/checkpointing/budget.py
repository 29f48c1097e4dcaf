"""The node's memory budget for snapshots: never OOM, across every process of the machine.

Before a snapshot's bytes go into the tmpfs, they are checked against ``MemAvailable``
(``/proc/meminfo``, or the test-only ``$PETCTL_SNAPSHOT_MEMINFO``), less a reserve, and the
filesystem's free space (:func:`fits`), counting every allocation still in flight on the machine's
tmpfs, this process's and other processes' (the local cloud's nodes share one ``MemAvailable``):
:class:`Budget`, its ledger at the tmpfs's root (:func:`ledger_path`). :func:`reserve` checks
and records in one step; the caller allocates, then ends its :class:`Reservation`. What does not
fit is a ``"no-fit: why"`` for the caller, which then uses the EFS path.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import filelocks
from petctl_agent.checkpointing import mapping
from petctl_agent.checkpointing.processes import start_time, this_process

#: kept free of MemAvailable besides the snapshot: at least this, or RESERVE_FRACTION of MemTotal
RESERVE_MIN = 512 << 20
RESERVE_FRACTION = 0.05


#: test-only: a file in ``/proc/meminfo``'s format read instead of it (a node's memory as a test
#: wants it, e.g. too little ``MemAvailable`` for a snapshot). Never set it on a real node.
MEMINFO_ENV = "PETCTL_SNAPSHOT_MEMINFO"


def read_meminfo(path: str | None = None) -> dict[str, int]:
    """``/proc/meminfo`` (or ``$PETCTL_SNAPSHOT_MEMINFO``, test-only) in bytes (``MemAvailable``, ...)."""
    path = path or os.environ.get(MEMINFO_ENV) or "/proc/meminfo"
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            k, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[k.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def fits(
    need: int,
    directory: Path,
    meminfo: Callable[[], dict[str, int]] = read_meminfo,
) -> tuple[bool, str]:
    """Can ``need`` more bytes go into ``directory`` (a tmpfs) without pressing the node's memory?"""
    if need <= 0:
        return True, ""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        return False, f"{gib(need)} more needed, {gib(free)} free in {directory}"
    mi = meminfo()
    avail = mi.get("MemAvailable", 0)
    reserve = max(RESERVE_MIN, int(RESERVE_FRACTION * mi.get("MemTotal", 0)))
    if need + reserve > avail:
        return False, f"{gib(need)} more needed, {gib(avail)} available (reserve {gib(reserve)})"
    return True, ""


#: the machine's ledger of allocations in flight, one per tmpfs (:func:`ledger_path`)
LEDGER = ".petctl-snapshot-ledger"
#: filesystem types whose stores share one ledger at the mount's root (node/snapshots.py's TMPFS_TYPES)
_TMPFS = ("tmpfs",)


#: test-only: the ledger file used instead of the tmpfs's (a test's machine: its memory,
#: ``$PETCTL_SNAPSHOT_MEMINFO``, and its allocations in flight). Never set it on a real node.
LEDGER_ENV = "PETCTL_SNAPSHOT_LEDGER"


def ledger_path(directory: Path, mounts: str = "/proc/mounts") -> Path:
    """The ledger of ``directory``'s allocations in flight: ``.petctl-snapshot-ledger`` at the root
    of the tmpfs it lives on (``/dev/shm`` for the agent's stores: every store there, whatever its
    job or node, so the local cloud's instances and the benches' nodes, which share one machine's
    ``MemAvailable``, share one ledger). A directory not on a tmpfs (tests) keeps its own, in
    itself. ``$PETCTL_SNAPSHOT_LEDGER`` (test-only) names another file."""
    if os.environ.get(LEDGER_ENV):
        return Path(os.environ[LEDGER_ENV])
    p = Path(os.path.realpath(directory))
    best, kind = filelocks.mount_of(p, mounts)
    return Path(best) / LEDGER if best and kind in _TMPFS else p / LEDGER


_ids = itertools.count(1)


def _taken(e: dict[str, Any]) -> int:
    """Bytes the file of another process's ledger entry holds already (0: none attached yet, or
    not that file any more). Its fd through ``/proc`` (the file may be renamed or unlinked), else
    its path; either only while it is still the same inode."""
    if int(e.get("fd", -1)) < 0:
        return 0
    for p in (f"/proc/{e['pid']}/fd/{e['fd']}", e.get("path")):
        if not p:
            continue
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (e.get("dev"), e.get("ino")):
            return st.st_blocks * 512
    return 0


#: seconds a reservation waits for the ledger's ``flock`` (others hold it for a read and a write,
#: a fraction of a ms; a holder stopped with it, SIGSTOP or a debugger, must not hang a checkpoint:
#: past this the write is a no-fit, the step goes to EFS)
LEDGER_WAIT = 10.0


def _lock_ledger(fd: int) -> None:
    """The ledger's exclusive ``flock``, waiting at most :data:`LEDGER_WAIT` s (else OSError)."""
    if not filelocks.flock_within(fd, fcntl.LOCK_EX, LEDGER_WAIT, 0.001):
        raise OSError(errno.EWOULDBLOCK, f"its flock held for over {LEDGER_WAIT:.0f} s")


class Budget:
    """The allocations in flight on one directory's tmpfs, so that checking ``fits`` and allocating
    the pages are one step, for every process of the machine.

    Within a process: the writer and the background spare thread each checked ``MemAvailable`` on
    its own, and a check made while the other's ``posix_fallocate`` had not yet taken its pages
    passed for both (review: together they overshot the reserve by a whole state). Across
    processes, the same: the local cloud's nodes share one machine's ``MemAvailable``, and at 4 GiB
    per rank two nodes' writes both passed against the same 5.27 GiB (0.63 GiB left).

    ``reserve`` checks ``need`` plus what the allocations still in flight have yet to take (each
    one's bytes less what its file holds already, ``st_blocks``: the part ``MemAvailable`` does not
    show yet) and, if it fits, records ``need`` as in flight until :meth:`Reservation.done`. This
    process's reservations are in ``inflight`` (under ``lock``, their files ``fstat``ed); every
    process's are also in the tmpfs's ledger (:func:`ledger_path`; JSON lines: pid and its start
    time, bytes promised, the file being allocated once open), read and written under an exclusive
    ``flock`` that is held for the check and the record only, never across an allocation (a peer
    transfer's receiver allocates piece by piece while its sender waits: a lock held across that
    could deadlock). Entries of dead processes (pid gone, or reused: another start time) are
    dropped. A ledger this process cannot open (another user's) leaves only its own allocations
    counted, as before the ledger.
    """

    def __init__(self, ledger: Path | None = None) -> None:
        self.lock = threading.Lock()
        self.inflight: list[Reservation] = []
        self.ledger = ledger

    def _own(self) -> int:
        """Bytes this process's allocations in flight have yet to take (call with the lock held)."""
        out = 0
        for r in self.inflight:
            held = 0
            if r.fd is not None:
                try:
                    held = os.fstat(r.fd).st_blocks * 512
                except OSError:
                    pass
            out += max(0, r.need - held)
        return out

    def _others(self, entries: list[dict[str, Any]]) -> int:
        """Bytes the ledger's other allocations in flight have yet to take (other processes', and
        this process's on other directories of the tmpfs)."""
        pid = this_process()[0]
        mine = {r.id for r in self.inflight}
        return sum(
            max(0, int(e.get("need", 0)) - _taken(e))
            for e in entries
            if not (e.get("pid") == pid and e.get("id") in mine)
        )

    def _ledger(self, change: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
        """The ledger's live entries, read under its ``flock``; ``change(entries)`` (with the lock
        still held) edits them in place and says whether to write them back. Call with ``lock``
        held. No ledger (none, or it cannot be opened): [] and ``change`` runs on that."""
        entries: list[dict[str, Any]] = []
        opened = None
        if self.ledger is not None:
            try:
                opened = mapping.opened(
                    lambda: os.open(self.ledger, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                )
            except OSError:
                opened = None
        if opened is None:
            if change is not None:
                change(entries)
            return entries
        fd, token = opened
        try:
            _lock_ledger(fd)
            try:
                raw = os.pread(fd, max(os.fstat(fd).st_size, 0), 0)
                pid, start = this_process()
                alive: dict[int, str | None] = {pid: start}
                dropped = False
                for line in raw.splitlines():
                    try:
                        e = json.loads(line)
                        p = int(e["pid"])
                    except (ValueError, KeyError, TypeError):
                        dropped = True  # a line torn by a writer killed mid-write
                        continue
                    if p not in alive:
                        alive[p] = start_time(p)
                    if alive[p] is None or alive[p] != e.get("start"):
                        dropped = True  # its process is gone: so is its allocation's promise
                        continue
                    entries.append(e)
                write = change(entries) if change is not None else False
                if write or dropped:
                    data = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a forked child's copy of the fd keeps no lock
        finally:
            mapping.release(token)
        return entries

    def pending(self) -> int:
        """Bytes the allocations in flight on this tmpfs have yet to take (call with the lock held)."""
        try:
            return self._own() + self._others(self._ledger())
        except OSError:  # the ledger unreadable for now: this process's own, as before the ledger
            return self._own()

    def fits(self, need: int, directory: Path, meminfo: Callable[[], dict[str, int]]) -> tuple[bool, str]:
        """``fits`` counting the allocations in flight, without reserving."""
        with self.lock:
            return fits(need + self.pending() if need > 0 else need, directory, meminfo)

    def reserve(
        self, need: int, directory: Path, meminfo: Callable[[], dict[str, int]]
    ) -> tuple[Reservation | None, str]:
        """A reservation of ``need`` bytes if they fit with the allocations in flight; else (None, why)."""
        with self.lock:
            r = Reservation(self, max(0, need))
            if need <= 0:  # a write in place, the usual one: nothing to check or record
                self.inflight.append(r)
                return r, ""
            out = ""

            def check(entries: list[dict[str, Any]]) -> bool:
                nonlocal out
                ok, why = fits(need + self._own() + self._others(entries), directory, meminfo)
                if not ok:
                    out = why
                    return False
                entries.append(r.entry())
                r.listed = True
                return True

            try:
                self._ledger(check)
            except OSError as e:  # the ledger's tmpfs is full, say: nothing recorded, nothing reserved
                return None, f"recording {gib(need)} in {self.ledger}: {e.strerror or e}"
            if out:
                return None, out
            self.inflight.append(r)
            return r, ""

    def _update(self, r: Reservation, **fields: Any) -> None:
        """Change ``r``'s ledger entry (call with the lock held); best effort (a full tmpfs)."""
        pid = this_process()[0]

        def edit(entries: list[dict[str, Any]]) -> bool:
            for i, e in enumerate(entries):
                if e.get("pid") == pid and e.get("id") == r.id:
                    if fields:
                        e.update(fields)
                    else:
                        del entries[i]
                    return True
            return False

        try:
            self._ledger(edit)
        except OSError:
            pass


class Reservation:
    """Bytes promised to one allocation until :meth:`done` (its pages are then in ``MemAvailable``).

    ``fd``: the file being allocated, once open (its allocated blocks count as taken)."""

    def __init__(self, budget: Budget, need: int) -> None:
        self.budget, self.need, self.fd = budget, need, None
        self.id = next(_ids)
        self.listed = False  # in the ledger (bytes promised: a reservation of 0 never is)
        self.file: dict[str, Any] = {"fd": -1}

    def entry(self) -> dict[str, Any]:
        """Its ledger entry: whose (pid and start time), how many bytes, which file (once open)."""
        pid, start = this_process()
        return {"pid": pid, "start": start, "id": self.id, "need": self.need, **self.file}

    def grow(self, need: int, directory: Path, meminfo: Callable[[], dict[str, int]]) -> tuple[bool, str]:
        """Reserve ``need`` bytes instead, if the bytes added fit with the allocations in flight
        (a spare the reservation counted on is gone: a whole file is due); else (False, why)."""
        with self.budget.lock:
            extra = max(0, need - self.need)
            if not extra:
                return True, ""
            out: tuple[bool, str] = (True, "")

            def check(entries: list[dict[str, Any]]) -> bool:
                nonlocal out
                out = fits(extra + self.budget._own() + self.budget._others(entries), directory, meminfo)
                if not out[0]:
                    return False
                self.need = need
                pid = this_process()[0]
                for e in entries:
                    if e.get("pid") == pid and e.get("id") == self.id:
                        e["need"] = need
                        break
                else:
                    entries.append(self.entry())
                self.listed = True
                return True

            try:
                self.budget._ledger(check)
            except OSError as e:
                return False, f"recording {gib(need)} in {self.budget.ledger}: {e.strerror or e}"
            return out

    def attach(self, fd: int) -> None:
        with self.budget.lock:
            self.fd = fd
            try:
                st = os.fstat(fd)
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return
            self.file = {"fd": fd, "dev": st.st_dev, "ino": st.st_ino, "path": path}
            if self.listed:
                self.budget._update(self, **self.file)

    def done(self) -> None:
        """The allocation ended (its pages taken, or it failed); idempotent. Call before closing ``fd``."""
        with self.budget.lock:
            if self in self.budget.inflight:
                self.budget.inflight.remove(self)
                if self.listed:
                    self.budget._update(self)
                    self.listed = False
            self.fd = None


def reserve(
    need: int, directory: Path, meminfo: Callable[[], dict[str, int]] = read_meminfo
) -> tuple[Reservation | None, str]:
    """Reserve ``need`` bytes about to be written under ``directory`` (a tmpfs) in the machine's
    ledger, if they fit with every allocation in flight; else ``(None, why)``. The caller writes,
    then calls ``done()`` (writers that do not ``attach`` a file are counted at ``need`` until then:
    their own pages too, a conservative over-count for the write's duration)."""
    return of(directory).reserve(need, directory, meminfo)


_budgets: dict[str, Budget] = {}
_budgets_lock = threading.Lock()


def of(directory: Path) -> Budget:
    """The one budget of ``directory`` in this process, shared by all its stores and threads."""
    key = os.path.realpath(directory)
    with _budgets_lock:
        b = _budgets.get(key)
        if b is None:
            b = _budgets[key] = Budget(ledger_path(Path(key)))
        return b


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _after_fork_in_child() -> None:
    """In a child made by ``os.fork``: the parent's allocations in flight are not the child's (and a
    thread of the parent may have held the lock at the fork)."""
    global _budgets_lock
    _budgets_lock = threading.Lock()
    _budgets.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
