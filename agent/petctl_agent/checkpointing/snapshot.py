"""Node-local memory snapshots of a state dict: raw tensor bytes in ``/dev/shm``, outliving the workers.

A snapshot is two files per slot in the store's directory (a tmpfs: ``/dev/shm/petctl/<job>``,
owned by the agent, docs/agent.md "Memory snapshots"):

- ``<name>.<slot>.bin``: every tensor's bytes, 64-byte aligned, one after another. Loading maps
  it, never unpickles: on the CPU the tensors are views of a private (copy-on-write) mapping, the
  file *lent* (a shared ``flock``) while they live, so a writer never rewrites it in place.
- ``<name>.<slot>.json``: the header, written last (temp file + ``os.replace``): its presence is the
  "complete" marker. It holds the step and its epoch (the worker generation that wrote it:
  :mod:`.timeline`), world size and rank, a generation number, the state's
  structure (dicts/lists/tuples/numbers/strings, tensors as references), each tensor's dtype, shape,
  offset and CRC-32C (``crc32c``; :mod:`.crcs`), and a CRC-32C of the header itself.

Two slots (``a``, ``b``) per name: a write goes into the slot that does *not* hold the newest
complete snapshot, after removing that slot's header, so a writer killed at any point leaves the
newest complete snapshot intact. Unless that slot is *pinned*: the persister holds a shared
``flock`` on ``<name>.<slot>.pin`` while it writes the slot to EFS (:meth:`SnapshotStore.pin`), and
the writer, which takes that lock exclusively (non-blocking) while it claims a slot, then writes
into the other one -- it overwrites the newest complete snapshot, and the pinned, older one stays
readable until the persist ends. So a persist slower than two checkpoint intervals still lands
(at most one persist behind), and a writer killed mid-write leaves the pinned snapshot as the
newest complete one (older, but whole; a restore checks the step). A dead persister's pin goes
with it (the kernel drops its ``flock``). The slot's file is reused in place, and stays mapped in the
writer, rather than created anew: at 1 GiB here ``posix_fallocate`` takes 0.29 s, filling a
mapping's page tables 0.15 s (the copy's faults) to 0.5 s (``MAP_POPULATE``), the copy into a
mapped slot 0.05 s (docs/benchmarks.md, "Memory snapshots"). What a write would do beyond the copy
-- a new file (*spare*) for a lent or missing slot, a restarted worker's mapping of its held slots
-- a background thread does beforehand (:meth:`SnapshotStore.prepare_spares`). So a name costs up
to twice its state's bytes in shared memory, three times while a spare stands by.

Never loaded: a slot without its header (torn), a header or tensor whose CRC does not match, a
data file of the wrong size, or a snapshot of another step than the one asked for (stale).
The CRC pass may run before the load, not in it: the agent checks the newest snapshot while the
new workers start (:meth:`SnapshotStore.verify`, ``<name>.verified.json``) and a restore of that
very snapshot, in the same unchanged file, skips its own pass (:meth:`SnapshotStore.prechecked`).
The writer records the same for the bytes it checked itself, sealed with its pid (:meth:`_seal`):
once it is gone, neither the agent's check nor the persister makes that pass again.

Never OOM: before a write, the bytes the slot must grow by are checked against ``MemAvailable``
(``/proc/meminfo``, or the test-only ``$PETCTL_SNAPSHOT_MEMINFO``; less a reserve) and the filesystem's free space (``os.statvfs``), then reserved
with ``posix_fallocate`` (ENOSPC, not a SIGBUS on a full tmpfs). The check counts every
allocation still in flight on the machine's tmpfs, this process's and other processes' (the local
cloud's nodes share one ``MemAvailable``): :class:`_Budget`, its ledger at the tmpfs's root. When
they do not fit, the write returns ``"no-fit: ..."`` and touches nothing: the caller falls back to
the EFS path.

The CRCs are computed after the copy, in a background thread (awscrt releases the GIL): the
blocking part of :meth:`SnapshotStore.write` is the copy. :meth:`SnapshotStore.flush` waits for the
header. A write that is waited for (``wait``: a coordinated stop, the last step) computes them at
once on up to 8 threads instead (``checkpointing/crcs.py``, pieces joined with crc32_combine).
Torch is imported only to write or read.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import json
import mmap
import os
import socket
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl_agent import filelocks
from petctl_agent.checkpointing import crcs
from petctl_agent.checkpointing.timeline import epoch_of

FORMAT = "petctl-snapshot-2"
SLOTS = ("a", "b")
ALIGN = 64
#: kept free of MemAvailable besides the snapshot: at least this, or RESERVE_FRACTION of MemTotal
RESERVE_MIN = 512 << 20
RESERVE_FRACTION = 0.05

OK = "ok"
#: seconds a restore waits for the agent's verification of its snapshot still running (then it
#: checks the bytes itself): that verification is the same pass, started earlier
VERIFY_WAIT = 30.0
#: seconds a writer waits for the verification lock to seal what it wrote (else it does not)
SEAL_WAIT = 1.0


class Unsupported(ValueError):
    """The state holds something a snapshot cannot represent (the caller uses the EFS path)."""


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
        return False, f"{_gib(need)} more needed, {_gib(free)} free in {directory}"
    mi = meminfo()
    avail = mi.get("MemAvailable", 0)
    reserve = max(RESERVE_MIN, int(RESERVE_FRACTION * mi.get("MemTotal", 0)))
    if need + reserve > avail:
        return False, f"{_gib(need)} more needed, {_gib(avail)} available (reserve {_gib(reserve)})"
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


def _started(pid: int) -> str | None:
    """``pid``'s start time (``/proc/<pid>/stat``, field 22): a reused pid has another; None: dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[19].decode() if len(fields) > 19 else None


def _pidns() -> int | None:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), None when unreadable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def node_name(directory: str | os.PathLike) -> str:
    """Which node a store is on, as the ranks compare it: the host and the store's real path (the
    ranks of one node share their store; the local cloud's instances on one machine each have
    their own)."""
    return f"{socket.gethostname()}|{os.path.realpath(directory)}"


def _alive(pid: int, started: str | None, pidns: int | None = None) -> bool:
    """Might process ``pid`` (started at ``started``, :func:`_started`, in pid namespace ``pidns``)
    still be there, and not a zombie (one that exited but is not reaped yet holds no mappings)?
    Only a positive answer that it is gone counts as gone: a pid of another pid namespace (or an
    unknown one), an unknown start time, or a ``/proc`` that cannot be read all count as alive."""
    if started is None or pidns is None or pidns != _pidns():
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


_ids = itertools.count(1)
_me: tuple[int, str | None] | None = None  # (pid, start time) of this process, read once per pid


def _self() -> tuple[int, str | None]:
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:  # a forked child is another process
        _me = (pid, _started(pid))
    return _me


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


class _Budget:
    """The allocations in flight on one directory's tmpfs, so that checking ``fits`` and allocating
    the pages are one step, for every process of the machine.

    Within a process: the writer and the background spare thread each checked ``MemAvailable`` on
    its own, and a check made while the other's ``posix_fallocate`` had not yet taken its pages
    passed for both (review: together they overshot the reserve by a whole state). Across
    processes, the same: the local cloud's nodes share one machine's ``MemAvailable``, and at 4 GiB
    per rank two nodes' writes both passed against the same 5.27 GiB (0.63 GiB left).

    ``reserve`` checks ``need`` plus what the allocations still in flight have yet to take (each
    one's bytes less what its file holds already, ``st_blocks``: the part ``MemAvailable`` does not
    show yet) and, if it fits, records ``need`` as in flight until :meth:`_Reservation.done`. This
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
        self.inflight: list[_Reservation] = []
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
        pid = _self()[0]
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
                opened = _opened(lambda: os.open(self.ledger, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
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
                pid, start = _self()
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
                        alive[p] = _started(p)
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
            _close(token)
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
    ) -> tuple[_Reservation | None, str]:
        """A reservation of ``need`` bytes if they fit with the allocations in flight; else (None, why)."""
        with self.lock:
            r = _Reservation(self, max(0, need))
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
                return None, f"recording {_gib(need)} in {self.ledger}: {e.strerror or e}"
            if out:
                return None, out
            self.inflight.append(r)
            return r, ""

    def _update(self, r: _Reservation, **fields: Any) -> None:
        """Change ``r``'s ledger entry (call with the lock held); best effort (a full tmpfs)."""
        pid = _self()[0]

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


class _Reservation:
    """Bytes promised to one allocation until :meth:`done` (its pages are then in ``MemAvailable``).

    ``fd``: the file being allocated, once open (its allocated blocks count as taken)."""

    def __init__(self, budget: _Budget, need: int) -> None:
        self.budget, self.need, self.fd = budget, need, None
        self.id = next(_ids)
        self.listed = False  # in the ledger (bytes promised: a reservation of 0 never is)
        self.file: dict[str, Any] = {"fd": -1}

    def entry(self) -> dict[str, Any]:
        """Its ledger entry: whose (pid and start time), how many bytes, which file (once open)."""
        pid, start = _self()
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
                pid = _self()[0]
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
                return False, f"recording {_gib(need)} in {self.budget.ledger}: {e.strerror or e}"
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
) -> tuple[_Reservation | None, str]:
    """Reserve ``need`` bytes about to be written under ``directory`` (a tmpfs) in the machine's
    ledger, if they fit with every allocation in flight; else ``(None, why)``. The caller writes,
    then calls ``done()`` (writers that do not ``attach`` a file are counted at ``need`` until then:
    their own pages too, a conservative over-count for the write's duration)."""
    return _budget(directory).reserve(need, directory, meminfo)


_budgets: dict[str, _Budget] = {}
_budgets_lock = threading.Lock()


def _budget(directory: Path) -> _Budget:
    """The one budget of ``directory`` in this process, shared by all its stores and threads."""
    key = os.path.realpath(directory)
    with _budgets_lock:
        b = _budgets.get(key)
        if b is None:
            b = _budgets[key] = _Budget(ledger_path(Path(key)))
        return b


# ---------------------------------------------------------------- locks, mappings and fork

#: token -> (fd, st_dev, st_ino) of every lock fd of this process that a forked child (a DataLoader
#: worker: ``os.fork``, no exec) must not keep: a file a restore has lent (a shared ``flock`` held
#: while its tensors live), a pin (the persister's shared ``flock`` while it writes a slot to EFS),
#: the writer's claim of a slot, the brief "is it lent?" checks (the writer's and the spare thread's).
#: A ``flock`` belongs to the open file description, which fork shares: the child's copy of the fd
#: kept the lock for as long as the child lived, after the parent had closed its own (a pinned slot
#: blocked the writer for the child's life: deadlock; a lent one made every write a new file).
_child_closes: dict[int, tuple[int, int, int]] = {}
#: held while such an fd is opened (and locked, never waiting) and recorded, or closed and
#: forgotten, and across ``os.fork`` (register_at_fork): a fork never falls between the two
_fork_lock = threading.Lock()
_tokens = itertools.count()


def _record(fd: int) -> int:
    """Record ``fd`` to be closed in any child forked from now on (call with ``_fork_lock`` held)."""
    st = os.fstat(fd)
    for token, (f, dev, ino) in list(_child_closes.items()):  # closed by their owner (a pin: os.close)
        try:
            s = os.fstat(f)
            if (s.st_dev, s.st_ino) == (dev, ino):
                continue
        except OSError:
            pass
        del _child_closes[token]
    token = next(_tokens)
    _child_closes[token] = (fd, st.st_dev, st.st_ino)
    return token


def _opened(open_fd: Callable[[], int | None]) -> tuple[int, int] | None:
    """``open_fd()`` (an open, perhaps a non-blocking ``flock``: never waits), no fork in between,
    its fd closed in every child forked later; ``(fd, token)`` (close with :func:`_close`) or None."""
    with _fork_lock:
        fd = open_fd()
        if fd is None:
            return None
        try:
            return fd, _record(fd)
        except BaseException:
            os.close(fd)
            raise


def _close(token: int) -> None:
    """Close a recorded fd (its lock goes). Once only; in a forked child the fd is closed already
    (:func:`_after_fork_in_child`) and never closed twice (its number may be another file's now)."""
    with _fork_lock:
        entry = _child_closes.pop(token, None)
        if entry is not None:
            try:
                os.close(entry[0])
            except OSError:
                pass


def _unlend(token: int) -> None:
    """A lent file's last tensor is gone: close its fd, the lock goes."""
    _close(token)


def _lock_unlent(path: Path) -> tuple[int, int] | None:
    """``path``'s flock, exclusively, if no restore has the file lent (non-blocking); else None.

    ``(fd, token)``: close with :func:`_close`. A restore lends a slot's file with a shared
    ``flock`` for as long as its tensors are views of it (:meth:`SnapshotStore.load`); the writer
    then makes a new file.
    """
    return _opened(lambda: filelocks.try_hold(path, create=False))


#: every store of this process: a forked child drops their mappings (:func:`_after_fork_in_child`)
_stores: weakref.WeakSet[SnapshotStore] = weakref.WeakSet()


def _before_fork() -> None:
    _fork_lock.acquire()


def _after_fork_in_parent() -> None:
    _fork_lock.release()


def _after_fork_in_child() -> None:
    """After ``os.fork`` (no exec: forked DataLoader workers), in the child: close its copies of
    the recorded lock fds (:data:`_child_closes`). Closing a copy never unlocks the parent's
    (``LOCK_UN`` would: never called here); it ends the child's reference, so the lock goes when
    the parent closes its own. O_CLOEXEC does not help with fork, and OFD ``fcntl`` locks are
    shared across fork the same way. The child's lent mappings, and the restored tensors that
    view them, stay valid.

    The stores' own mappings (slots, spares) are not in the child (``MADV_DONTFORK``); their
    ``mmap`` objects, each holding a ``dup`` of its file's fd, are dropped here: a file the parent
    unlinks later (a spare it frees, a slot it replaces) keeps no pages in ``/dev/shm`` for the
    child's life. Nor does the child ever free the parent's spares on its exit."""
    global _fork_lock, _budgets_lock
    _fork_lock = threading.Lock()  # held by the parent's fork (_before_fork): a new one
    _budgets_lock = threading.Lock()
    _budgets.clear()  # the parent's allocations in flight are not the child's
    entries = list(_child_closes.values())
    _child_closes.clear()
    for fd, dev, ino in entries:
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.close(fd)
        except OSError:
            pass
    _with_spares.clear()  # the parent's spares: its own exit frees them, never the child's
    for store in list(_stores):
        store._forget_in_child()


#: stores that made spares: a worker that exits for good frees those no write took (atexit)
_with_spares: weakref.WeakSet[SnapshotStore] = weakref.WeakSet()


@atexit.register
def _free_spares_at_exit() -> None:
    """A worker's normal exit (the job's end, its last checkpoint taken): no write of this process
    will take its spares, free them now (the agent would only when the node leaves). A worker that
    is killed or ``os._exit``s (a drain) leaves them to the next worker of the store, which takes
    or frees them, or to the agent's removal of the store."""
    for store in list(_with_spares):
        store._cancel.set()
        for slot in list(store._made_spares):
            store.spare_path(slot).unlink(missing_ok=True)
        store._made_spares.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


def _fallocate(fd: int, size: int) -> None:
    """Allocate the file's pages now (tmpfs: ENOSPC here, not a SIGBUS on the copy)."""
    os.posix_fallocate(fd, 0, size)


#: madvise(2) advice: fault every page of the range in for writing (Linux 5.14); not in Python 3.11
MADV_POPULATE_WRITE = 23
#: madvise(2) advice: the range is not in a child made by fork (Linux 2.6.16)
MADV_DONTFORK = 10


def _madvise(mm: mmap.mmap, advice: int) -> None:
    """``madvise`` over all of ``mm`` through ctypes, the GIL released (``mmap.madvise`` holds it).
    Best effort: an older kernel (EINVAL) ignores it."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        anchor = ctypes.c_char.from_buffer(mm)
    except (OSError, TypeError, ValueError):
        return
    try:
        addr = ctypes.addressof(anchor)
    finally:
        del anchor  # the mapping's buffer export: the mmap could not close while it lived
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), advice)


def _populate(mm: mmap.mmap) -> None:
    """Fill ``mm``'s page tables now (a background thread's work), with the GIL released.

    ``MADV_POPULATE_WRITE`` through ctypes: ``MAP_POPULATE`` and ``mmap.madvise`` hold the GIL for
    the whole call (0.3-0.6 s/GiB here: the training thread would stall), a foreign call does not.
    Best effort: an older kernel (EINVAL) leaves the faults to the copy."""
    _madvise(mm, MADV_POPULATE_WRITE)


#: mmap(2) flags for a placeholder at a given address, failing (EEXIST) if anything is mapped there
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
#: in a forked child: mappings of the parent's store whose range something else took before the
#: at-fork handler ran; never closed (that would unmap the other thing), so never freed
_kept_in_child: list[mmap.mmap] = []


def _drop_in_child(mm: mmap.mmap) -> None:
    """In a forked child: close ``mm`` (one of :func:`_own_map`'s: not in the child) and the
    ``dup`` of its file's fd it holds, which kept the file's pages in ``/dev/shm`` for the child's
    life once the parent unlinked the file. Its range is empty here, and ``mmap.close`` unmaps it:
    a placeholder goes there first (``MAP_FIXED_NOREPLACE``), so a mapping another at-fork
    handler made there meanwhile is never unmapped (that ``mm`` is then kept, never closed)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        anchor = ctypes.c_char.from_buffer(mm)
    except (OSError, TypeError, ValueError):
        return  # closed already, or empty
    try:
        addr = ctypes.addressof(anchor)
    finally:
        del anchor
    libc.mmap.restype = ctypes.c_void_p
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    got = libc.mmap(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), 0, flags, -1, ctypes.c_long(0))
    if got == addr:
        _close_map(mm)  # unmaps the placeholder
        return
    if got is not None and got != ctypes.c_void_p(-1).value:  # a kernel without NOREPLACE: a hint
        libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(len(mm)))
    _kept_in_child.append(mm)


def _own_map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of a slot's or a spare's file for this process's writes, never in a forked
    child (``MADV_DONTFORK``): a DataLoader worker has no use for it, and its copy would keep the
    file's pages (a whole state) in ``/dev/shm`` for the child's life after the parent unlinked it.
    Not for a restore's mapping: restored tensors view that one, and a child may read them."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    _madvise(mm, MADV_DONTFORK)
    return mm


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a fill that raised left a view in its traceback: gc unmaps it
        pass


def _on_cpu(map_location: Any) -> bool:
    """Is ``map_location`` the CPU (a restore there can be views of a mapping, not a copy)?"""
    if map_location is None:
        return True
    return str(map_location).split(":")[0] == "cpu"


def _map_copy(fd: int, size: int, lend: bool) -> mmap.mmap:
    """A private (copy-on-write) mapping of ``fd``'s file. Lent: mapped through a second open file
    description of the same file (``/proc/self/fd``), never through the one that holds the lent
    ``flock``: Python's ``mmap`` keeps a ``dup`` of the fd it maps, which a forked child inherits
    and which would keep the lock (it belongs to the open file description) for as long as the
    child lives -- closing the lock's fd in the child (:func:`_after_fork_in_child`) must end it."""
    if not lend:
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    try:
        mfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:  # no /proc: a child forked meanwhile keeps the slot lent while it lives
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    try:
        return mmap.mmap(mfd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(mfd)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---------------------------------------------------------------- the state's structure (JSON)


def encode_structure(x: Any, tensors: list[Any]) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            raise Unsupported(f"tensor subclass {type(x).__name__} (sharded state: use the EFS path)")
        if x.is_sparse or x.is_quantized or x.device.type == "meta" or x.is_nested:
            raise Unsupported(f"{x.layout} / {x.device.type} tensor")
        tensors.append(x)
        return {"T": len(tensors) - 1}
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return {"F": repr(x)}  # nan/inf survive, JSON stays strict
    if type(x) is list:
        return {"L": [encode_structure(v, tensors) for v in x]}
    if type(x) is tuple:
        return {"U": [encode_structure(v, tensors) for v in x]}
    if type(x) in (dict, OrderedDict):
        out: dict[str, Any] = {
            "D" if type(x) is dict else "O": [
                [encode_structure(k, tensors), encode_structure(v, tensors)] for k, v in x.items()
            ]
        }
        meta = getattr(x, "_metadata", None)  # nn.Module.state_dict()'s per-module versions
        if meta is not None:
            out["M"] = encode_structure(meta, tensors)
        return out
    if isinstance(x, torch.dtype):
        return {"Y": str(x)}
    raise Unsupported(f"{type(x).__name__} value in the state")


def decode_structure(x: Any, tensors: list[Any]) -> Any:
    if not isinstance(x, dict):
        return x
    if "T" in x:
        return tensors[x["T"]]
    if "F" in x:
        return float(x["F"])
    if "L" in x:
        return [decode_structure(v, tensors) for v in x["L"]]
    if "U" in x:
        return tuple(decode_structure(v, tensors) for v in x["U"])
    if "D" in x or "O" in x:
        items = [
            (decode_structure(k, tensors), decode_structure(v, tensors)) for k, v in x.get("D", x.get("O"))
        ]
        d: Any = dict(items) if "D" in x else OrderedDict(items)
        if "M" in x:
            d._metadata = decode_structure(x["M"], tensors)
        return d
    if "Y" in x:
        return dtype_from_name(x["Y"])
    raise ValueError(f"bad structure node {sorted(x)}")


def dtype_from_name(name: str) -> Any:
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name}")
    return dt


def _header_crc(header: dict[str, Any]) -> int:
    body = {k: v for k, v in header.items() if k != "header_crc"}
    return crcs.crc(json.dumps(body, sort_keys=True).encode())


def _crcs_match(header: dict[str, Any], mm: mmap.mmap | None) -> bool:
    """Do the mapped bytes match every tensor's CRC in ``header``?"""
    view = memoryview(mm) if mm is not None else memoryview(b"")
    try:
        return all(
            crcs.crc(view[m["offset"] : m["offset"] + m["nbytes"]]) == m["crc32c"] for m in header["tensors"]
        )
    finally:
        view.release()


def _file_id(st: os.stat_result) -> list[int]:
    """What a verification record pins of a slot's data file: a write through the filesystem moves
    the mtime, a replacement the inode."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _same_layout(known: list[dict[str, Any]], metas: list[dict[str, Any]]) -> bool:
    keys = ("dtype", "shape", "offset", "nbytes")
    return len(known) == len(metas) and all(
        isinstance(k.get("crc32c"), int) and all(k.get(x) == m[x] for x in keys) for k, m in zip(known, metas)
    )


# ---------------------------------------------------------------- the store


def same_snapshot(header: dict[str, Any] | None, c: Complete) -> bool:
    """Does the slot still hold ``c`` (the seqlock's check after a read)?"""
    return (
        header is not None
        and header.get("gen") == c.header.get("gen")
        and header.get("nonce") == c.header.get("nonce")
    )


@dataclass(frozen=True)
class Complete:
    """A complete snapshot on disk: its slot and header."""

    slot: str
    header: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def gen(self) -> int:
        return int(self.header["gen"])

    @property
    def epoch(self) -> int:
        """The epoch of the generation that wrote it (:mod:`.timeline`; 0: none recorded)."""
        return epoch_of(self.header)

    @property
    def key(self) -> tuple[int, int]:
        """``(epoch, step)``: which history, and where in it (:func:`.timeline.key`)."""
        return (self.epoch, self.step)


class SnapshotStore:
    """The snapshots of one name (e.g. ``rank-3``, or ``replicated``) in a tmpfs directory.

    One writer per name at a time (the worker that owns it); any number of readers (the other
    ranks of the node, the persister), which never see a torn slot: they read a slot's header,
    copy, and check the header's generation again.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        name: str,
        meminfo: Callable[[], dict[str, int]] = read_meminfo,
    ) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad snapshot name {name!r}")
        self.dir = Path(directory)
        self.name = name
        self.meminfo = meminfo
        self._pending: threading.Thread | None = None
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # slot -> (inode, mapping), kept
        self._spare_maps: dict[str, tuple[int, mmap.mmap]] = {}  # slot -> its spare's, populated
        self._maps_lock = threading.Lock()  # the writer's and the spare thread's (pre-mapping)
        self._error: BaseException | None = None
        self._pins_made = False
        self._spares: threading.Thread | None = None
        self._cancel = threading.Event()  # set by close(): the spare thread makes no more
        self._made_spares: set[str] = set()  # slots whose spare this store made (freed on close)
        self._claims: dict[int, int] = {}  # fd -> token of the writer's claims (_claim_fd)
        _stores.add(self)

    def _forget_in_child(self) -> None:
        """In a child forked from this process (:func:`_after_fork_in_child`): drop the mappings
        (not in the child: ``MADV_DONTFORK``; their ``mmap`` objects hold a ``dup`` of the file's
        fd) and the spares, which are the parent's."""
        self._maps_lock = threading.Lock()  # a thread of the parent may have held it at the fork
        maps = list(self._maps.values()) + list(self._spare_maps.values())
        self._maps, self._spare_maps = {}, {}
        for _, mm in maps:
            _drop_in_child(mm)
        self._made_spares = set()
        self._claims = {}

    # -- paths and headers

    def data_path(self, slot: str) -> Path:
        return self.dir / f"{self.name}.{slot}.bin"

    def header_path(self, slot: str) -> Path:
        return self.dir / f"{self.name}.{slot}.json"

    def spare_path(self, slot: str) -> Path:
        return self.dir / f"{self.name}.{slot}.spare"

    def pin_path(self, slot: str) -> Path:
        return self.dir / f"{self.name}.{slot}.pin"

    def pin(self, c: Complete) -> int | None:
        """Pin ``c``'s slot against the writer (a shared ``flock``); the fd to close, or None when
        the slot no longer holds ``c`` (the writer took it first: pick the newest again).

        While pinned, :meth:`write` never writes into the slot; closing the fd (or dying) unpins.
        """
        try:  # closed in a child forked while the persist runs: the pin lasts as long as ours
            fd, token = _opened(lambda: os.open(self.pin_path(c.slot), os.O_RDWR | os.O_CREAT, 0o600))
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a writer holds it exclusively only while it claims the slot
            if same_snapshot(self.read_header(c.slot), c):
                token = -1
                return fd
            return None
        finally:
            if token >= 0:
                _close(token)

    def _claim(self, slot: str) -> int | None:
        """The slot's pin lock, exclusively, if no persister pins it (non-blocking), else None.
        The fd: close it with :meth:`_unclaim` (a child forked meanwhile closes its copy)."""
        got = _opened(lambda: filelocks.try_hold(self.pin_path(slot)))
        if got is None:
            return None
        self._claims[got[0]] = got[1]
        return got[0]

    def _claim_waiting(self, slot: str) -> int:
        """The slot's pin lock, exclusively, waiting for the persister that pins it."""
        fd, token = _opened(lambda: os.open(self.pin_path(slot), os.O_RDWR | os.O_CREAT, 0o600))
        self._claims[fd] = token
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # not under _fork_lock: a fork meanwhile closes the child's copy
        except BaseException:
            self._unclaim(fd)
            raise
        return fd

    def _unclaim(self, fd: int) -> None:
        _close(self._claims.pop(fd))

    def read_header(self, slot: str) -> dict[str, Any] | None:
        """The slot's header if present and intact (its own CRC matches), else None."""
        try:
            h = json.loads(self.header_path(slot).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("slot") != slot:
            return None
        if h.get("header_crc") != _header_crc(h):
            return None
        return h

    def complete(self) -> list[Complete]:
        """Complete snapshots (header present and intact), newest generation first."""
        found = [Complete(s, h) for s in SLOTS if (h := self.read_header(s)) is not None]
        return sorted(found, key=lambda c: c.gen, reverse=True)

    def newest(self) -> Complete | None:
        c = self.complete()
        return c[0] if c else None

    # -- writing

    def write(
        self,
        state: dict[str, Any],
        step: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        wait: bool = False,
        known: list[dict[str, Any]] | None = None,
        epoch: int = 0,
    ) -> str:
        """Copy ``state`` into the older slot; ``"ok"``, or ``"no-fit: why"`` / ``"unsupported: why"``.

        ``epoch``: the epoch of the generation whose state it is (:mod:`.timeline`), in the header.

        Returns once the bytes are copied (training may change the tensors then); the checksums
        and the header follow in a background thread unless ``wait``. Anything but ``"ok"``
        leaves the existing snapshots as they were: use the EFS path.

        ``known``: the ``tensors`` of a header whose CRCs are already known (a peer's snapshot
        of this very state, checked on receipt): when their layout (dtype, shape, offset, bytes)
        is the one this write makes, their CRCs are taken and the header goes in place at once,
        no checksum pass. Otherwise they are ignored. (A wrong CRC would only make the snapshot
        fail its check on load, as a torn one does: never loaded.)
        """
        self.flush()  # the previous write's header first: its slot is the one we keep
        tensors: list[Any] = []
        try:
            structure = encode_structure(state, tensors)
        except Unsupported as e:
            return f"unsupported: {e}"
        metas = []
        off = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            metas.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": nbytes})
            off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        size = off
        if known is not None and _same_layout(known, metas):
            for m, k in zip(metas, known):
                m["crc32c"] = int(k["crc32c"])

        def fill(mm: mmap.mmap | None) -> None:
            import torch

            for t, m in zip(tensors, metas):
                if m["nbytes"]:
                    dst = torch.frombuffer(mm, dtype=torch.uint8, count=m["nbytes"], offset=m["offset"])
                    dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                    del dst  # the mmap cannot close while a tensor exports it

        why = self._write(step, world_size, rank, wait, structure, metas, size, fill, epoch=epoch)
        if why == OK and size and not all(self._ready(s, size) for s in SLOTS):
            # the next write's file, made and mapped in the background now rather than on its path:
            # a job's second checkpoint (no slot b yet), a restarted worker's (slots not mapped)
            self.prepare_spares(size)
        return why

    def receive(
        self,
        header: dict[str, Any],
        fill: Callable[[mmap.mmap | None, Callable[[int, int], None]], None],
        *,
        world_size: int = 1,
        rank: int = 0,
    ) -> str:
        """Write a peer's snapshot straight into the older slot: ``fill(mm, reserve)`` puts its
        bytes into the slot's mapping (e.g. received over the network into views of it), calling
        ``reserve(offset, n)`` before it writes bytes ``[offset, offset + n)``; ``header`` (the
        peer's, its own CRC checked by the caller) gives the step and its epoch, the structure and
        the tensors' layout and CRCs, so the header goes in place at once, without a checksum
        pass: ``fill`` checks the bytes as they arrive and raises when they do not match (no
        header then).

        A new file's pages are not allocated up front (tmpfs allocation costs 0.5-1.3 s/GiB here,
        a peer's whole transfer would wait for it): ``reserve`` allocates each piece just before
        it arrives (``posix_fallocate``: ENOSPC, an ``OSError``, rather than a SIGBUS on a full
        tmpfs), so the allocation overlaps the transfer. The whole size is checked against the
        node's memory first, as for a write (:func:`fits`).

        ``"ok"`` (then :meth:`verified` is the header written); ``"no-fit: why"`` (``fill`` is then
        not called: the caller receives elsewhere) or ``"unsupported: why"`` (a layout that does
        not fit its size). A ``fill`` that raises leaves the slot torn (no header), its file
        removed (its pages go back to the node: a receive that ran out of room must not hold the
        memory that the EFS fallback then needs), and re-raises.
        """
        self.flush()
        size = int(header["size"])
        metas = []
        for m in header["tensors"]:
            meta = {k: m[k] for k in ("dtype", "shape", "offset", "nbytes", "crc32c")}
            if not (0 <= int(meta["offset"]) and int(meta["offset"]) + int(meta["nbytes"]) <= size):
                return f"unsupported: tensor at {meta['offset']}+{meta['nbytes']} outside {size} bytes"
            metas.append(meta)
        self._received = None
        try:
            why = self._write(
                int(header["step"]),
                world_size,
                rank,
                False,
                header["structure"],
                metas,
                size,
                fill,
                lazy=True,
                epoch=epoch_of(header),  # the peer's snapshot, of the peer's history
            )
        except BaseException:
            for s in SLOTS:  # the slot it wrote has no header: never loaded; a lender keeps its inode
                if self.read_header(s) is None:
                    self._unmap(s)
                    self.data_path(s).unlink(missing_ok=True)
            raise
        if why == OK:
            self._received = self.newest()
        return why

    def verified(self) -> Callable[[dict[str, Any], mmap.mmap | None], bool]:
        """A :meth:`load` ``check`` for the snapshot the last :meth:`receive` wrote: its bytes were
        checked against the CRCs as they arrived, so a load of that very snapshot (same
        generation and nonce; this process is the store's one writer) skips the second pass over
        them. Any other snapshot is checked in full."""
        got = self._received

        def check(header: dict[str, Any], mm: mmap.mmap | None) -> bool:
            if got is not None and same_snapshot(header, got):
                return True
            view = memoryview(mm) if mm is not None else memoryview(b"")
            try:
                return all(
                    crcs.crc(view[m["offset"] : m["offset"] + m["nbytes"]]) == m["crc32c"]
                    for m in header["tensors"]
                )
            finally:
                view.release()

        return check

    # -- the agent's verification (off a restore's critical path)

    def verified_path(self) -> Path:
        return self.dir / f"{self.name}.verified.json"

    def verify_lock_path(self) -> Path:
        return self.dir / f"{self.name}.verify.lock"

    def verify(self) -> Complete | None:
        """Check the newest complete snapshot's CRCs now, while nobody waits for it, and record
        that it passed (``<name>.verified.json``: its slot, generation, nonce, header CRC and the
        data file's inode, size, mtime and ctime), so that a restore of that very snapshot
        (:meth:`prechecked`) skips its own pass over the bytes. The agent runs it in a process of
        its own (``persist --verify``) once its old workers are gone, while the new ones start.

        Holds ``<name>.verify.lock`` exclusively meanwhile: a restore that comes while the check
        runs waits for its verdict rather than make a second pass beside it. The record is removed
        first and written only when every CRC matched and the slot's header and file are still
        the ones checked (a writer that started on the slot meanwhile removed its header first).
        Returns the snapshot checked, or None (nothing complete, or it failed: no record)."""
        lock = os.open(self.verify_lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            c = self.newest()
            if c is not None and self._covers(self._record(), c.header):
                return c  # its writer's seal (or an earlier verification) stands: no second pass
            self.verified_path().unlink(missing_ok=True)
            if c is None:
                return None
            try:
                fd = os.open(self.data_path(c.slot), os.O_RDONLY)
            except OSError:
                return None
            try:
                before = os.fstat(fd)
                if before.st_size != c.header["size"]:
                    return None
                mm = (
                    mmap.mmap(fd, before.st_size, mmap.MAP_SHARED, mmap.PROT_READ) if before.st_size else None
                )
                try:
                    ok = _crcs_match(c.header, mm)
                finally:
                    if mm is not None:
                        mm.close()
                after = os.fstat(fd)
            finally:
                os.close(fd)
            if (
                not ok
                or _file_id(before) != _file_id(after)
                or not same_snapshot(self.read_header(c.slot), c)
            ):
                return None
            self._put_record(c.header, after)
            return c
        finally:
            os.close(lock)

    def prechecked(self, wait: float = VERIFY_WAIT) -> Callable[[dict[str, Any], mmap.mmap | None], bool]:
        """A :meth:`load` ``check`` for a restore from this node's own memory: a snapshot that the
        agent's :meth:`verify` passed -- the same header (generation, nonce, header CRC) in the
        same, unchanged file (inode, size, mtime, ctime) -- is not checked again; any other is
        checked in full, as without it. A verification still running is waited for (at most
        ``wait`` s, then the load checks for itself): it is most of the way through the same pass.

        Trusted as far as the store's protocol goes: every write through it removes the slot's
        header before it changes a byte and puts back one of a new generation, and a write into
        the file through the filesystem moves its mtime (tmpfs: to the clock's tick)."""

        def check(header: dict[str, Any], mm: mmap.mmap | None) -> bool:
            return self.covered(header, wait) or _crcs_match(header, mm)

        return check

    def covered(self, header: dict[str, Any], wait: float = VERIFY_WAIT) -> bool:
        """Did the agent's :meth:`verify` pass this very snapshot, or its writer seal it and is gone
        (the rule of :meth:`prechecked`)?"""
        return self._covers(self._verification(wait), header)

    def _covers(self, rec: dict[str, Any] | None, header: dict[str, Any]) -> bool:
        """Does record ``rec`` vouch for ``header``'s snapshot: the same header, the same unchanged
        file, and (a writer's seal) its writer gone?"""
        if rec is None or not all(rec.get(k) == header.get(k) for k in ("gen", "nonce", "header_crc")):
            return False
        writer = rec.get("writer")
        if writer is not None:
            try:
                if _alive(int(writer[0]), writer[1], writer[2]):
                    return False
            except (TypeError, ValueError, IndexError):
                return False
        try:
            st = os.stat(self.data_path(str(rec.get("slot"))))
        except (OSError, ValueError):
            return False
        return _file_id(st) == rec.get("file")

    def sealed(self, c: Complete) -> bool:
        """Is ``c`` covered by its writer's own seal (:meth:`_seal`), not by a verification pass?"""
        rec = self._record()
        return rec is not None and "writer" in rec and self._covers(rec, c.header)

    def _record(self) -> dict[str, Any] | None:
        try:
            rec = json.loads(self.verified_path().read_bytes())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def _verification(self, wait: float) -> dict[str, Any] | None:
        """The agent's verification record, once no verification is running (waited for at most
        ``wait`` s: then None); None when there is none."""
        try:
            fd = os.open(self.verify_lock_path(), os.O_RDONLY)
        except OSError:
            return None  # never verified
        try:
            if not filelocks.flock_within(fd, fcntl.LOCK_SH, wait, 0.01):
                return None
            return self._record()
        finally:
            os.close(fd)

    def _write(
        self,
        step: int,
        world_size: int,
        rank: int,
        wait: bool,
        structure: Any,
        metas: list[dict[str, Any]],
        size: int,
        fill: Callable[..., None],
        *,
        lazy: bool = False,
        epoch: int = 0,
    ) -> str:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # a spare still being made is not waited for (the write then allocates its own file): on a
        # busy node the background allocation may well take longer than a checkpoint interval
        if self._spares is not None and not self._spares.is_alive():
            self._spares = None
        if self._spares is None:
            for s in SLOTS:  # half-made by a writer that died making it (the store's one writer: ours now)
                tmp = self.spare_path(s)
                tmp.with_name(f".{tmp.name}.tmp").unlink(missing_ok=True)
                try:  # a spare no write of this size can take (the state changed size): freed now
                    if tmp.stat().st_size != size:
                        tmp.unlink()
                        self._made_spares.discard(s)
                except FileNotFoundError:
                    pass
        if not self._pins_made:  # both at once: a write that fails later leaves no new file
            for s in SLOTS:
                os.close(os.open(self.pin_path(s), os.O_RDWR | os.O_CREAT, 0o600))
            self._pins_made = True
        done = self.complete()
        newest = done[0] if done else None
        slot = SLOTS[0] if newest is None or newest.slot == SLOTS[1] else SLOTS[1]
        claim = self._claim(slot)
        if claim is None:  # the persister pins the older slot: overwrite the newest instead
            slot = SLOTS[1] if slot == SLOTS[0] else SLOTS[0]
            claim = self._claim(slot)
        if claim is None:  # both pinned (two persisters): wait for the older one's persist to end
            slot = SLOTS[0] if newest is None or newest.slot == SLOTS[1] else SLOTS[1]
            claim = self._claim_waiting(slot)
        held = [claim]

        def release() -> None:
            if held:
                self._unclaim(held.pop())

        try:
            return self._write_slot(
                slot, release, done, step, world_size, rank, wait, structure, fill, metas, size, lazy, epoch
            )
        finally:
            release()  # the header is gone by now (or nothing changed): the slot is free either way

    def _write_slot(
        self,
        slot: str,
        release: Callable[[], None],
        done: list[Complete],
        step: int,
        world_size: int,
        rank: int,
        wait: bool,
        structure: Any,
        fill: Callable[..., None],
        metas: list[dict[str, Any]],
        size: int,
        lazy: bool = False,
        epoch: int = 0,
    ) -> str:
        """``lazy`` (a receive): ``fill(mm, reserve)``, a new file's pages allocated per piece."""
        data = self.data_path(slot)
        lent: tuple[int, int] | None = None  # the data file's flock, exclusive, while nobody has it lent
        res: _Reservation | None = None
        try:
            try:
                st = os.stat(data)
                # reused in place only at the same size: shrinking a file that a reader (the
                # persister, another rank) has mapped would SIGBUS it; a new inode leaves the
                # reader's pages alone. Nor while a restore has it lent (its tensors are views of a
                # private mapping of the file, whose pages a write in place would change under it)
                held = st.st_blocks * 512 if st.st_size == size else 0
                if held:
                    lent = _lock_unlent(data)
                    if lent is None:
                        held = 0
            except FileNotFoundError:
                held = 0
            spare = 0 if held else self._spare_of(slot, size)  # a new file is due: made already?
            # checked and reserved in one step with the spare thread's allocations (_Budget)
            res, why = _budget(self.dir).reserve(size - (held or spare), self.dir, self.meminfo)
            if res is None:
                return f"no-fit: {why}"
            # newer than both slots, including the one overwritten (a reader compares generations)
            gen = max((c.gen for c in done), default=0) + 1
            # from here on the slot is torn until its header is back
            try:
                self.header_path(slot).unlink()
            except FileNotFoundError:
                pass
        except BaseException:
            if res is not None:
                res.done()
            raise
        finally:
            if lent is not None:
                _close(lent[1])  # a restore that lends the file from now on finds no header: never maps it
        release()  # a persister that pins the slot now finds no header: it never reads it
        try:
            placed = self._place(slot, data, size, held, spare, res, lazy)
        except BaseException:
            res.done()
            raise
        if isinstance(placed, str):
            res.done()
            return placed
        mm, rfd = placed  # rfd (lazy): the fd whose pages reserve() allocates, its reservation still open
        try:
            if lazy:
                fill(mm, lambda off, n: os.posix_fallocate(rfd, off, n) if rfd >= 0 else None)
            else:
                fill(mm)
        except BaseException:
            self._unmap(slot)
            raise
        finally:
            res.done()  # every page taken (or the fill failed): before rfd closes
            if rfd >= 0:
                os.close(rfd)
        header = {
            "format": FORMAT,
            "name": self.name,
            "slot": slot,
            "gen": gen,
            "nonce": os.urandom(8).hex(),  # a restarted writer may reuse a generation: never its nonce
            "step": int(step),
            "epoch": int(epoch),
            "world_size": int(world_size),
            "rank": int(rank),
            "size": size,
            "tensors": metas,
            "structure": structure,
        }

        # the bytes are checked against the header's CRCs before it is written -- computed from
        # the slot's own mapping, or checked as they arrived (a receive) -- so the writer seals it
        # (:meth:`_seal`); not a copy of a peer's state whose CRCs were given (``write(known=)``)
        seal = lazy or not any("crc32c" in m for m in metas)

        def finish() -> None:
            try:
                self._finish(mm, header, seal)
            except BaseException as e:  # noqa: BLE001 - reported by flush()
                self._error = e

        if wait or all("crc32c" in m for m in metas):
            # waited for (a coordinated stop, the last step): on every core the node lends it
            self._finish(mm, header, seal, crcs.threads() if wait else 1)
        else:
            self._pending = threading.Thread(target=finish, name="petctl-snapshot-crc", daemon=True)
            self._pending.start()
        return OK

    def _place(
        self, slot: str, data: Path, size: int, held: int, spare: int, res: _Reservation, lazy: bool = False
    ) -> tuple[mmap.mmap | None, int] | str:
        """The slot's file, mapped, its pages allocated (``res`` reserved them): ``(mapping, -1)``
        (None for an empty state), or ``"no-fit: why"`` when the tmpfs refused the allocation.
        ``lazy`` (a receive): a new file's pages are not allocated here but per piece, through the
        returned fd (``(mapping, fd)``; the caller closes it and ends ``res`` after the fill)."""
        self._made_spares.discard(slot)  # taken or removed here
        rfd = -1
        with self._maps_lock:
            spare_map = self._spare_maps.pop(slot, None)
        if spare:
            try:  # the new file, its pages allocated in the background (prepare_spares)
                os.replace(self.spare_path(slot), data)  # a lent file lives on, unlinked, while mapped
                held = spare
                if spare_map is not None and spare_map[0] == os.stat(data).st_ino:
                    self._keep_map(slot, spare_map)  # mapped and populated in the background too
                    spare_map = None
            except OSError:
                if not held:  # the spare is gone (removed meanwhile): a whole file, reserved as a whole
                    ok, why = res.grow(size, self.dir, self.meminfo)
                    if not ok:
                        if spare_map is not None:
                            _close_map(spare_map[1])
                        return f"no-fit: {why}"
        else:  # in place after all (the restore's tensors are gone), or no spare: none kept unused
            self.spare_path(slot).unlink(missing_ok=True)
        if spare_map is not None:
            spare_map[1].close()
        mm = self._mapped(slot, data, size) if held else None
        if mm is None:
            self._unmap(slot)
            if not held:  # held: the file of a previous writer (a restarted worker), pages reused
                try:
                    data.unlink()
                except FileNotFoundError:
                    pass
            fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
            if size and lazy:
                rfd = os.dup(fd)
            if not held:  # its pages are taken by the fallocate below: what is left of them is in flight
                res.attach(rfd if rfd >= 0 else fd)
            try:
                if not held:
                    os.ftruncate(fd, size)
                if size and lazy:  # a receive: pages allocated per piece, as the bytes arrive
                    mm = _own_map(fd, size)
                    self._keep_map(slot, (os.fstat(fd).st_ino, mm))
                elif size:
                    try:
                        _fallocate(fd, size)
                    except OSError as e:
                        os.ftruncate(fd, 0)
                        return f"no-fit: reserving {_gib(size)} in {self.dir}: {e.strerror}"
                    # kept mapped between writes. Not MAP_POPULATE: it fills the page tables
                    # in one thread, holding the GIL (0.45-0.50 s/GiB here), where the copy's own
                    # page faults, taken by torch's copy threads, cost 0.15 (docs/benchmarks.md)
                    mm = _own_map(fd, size)
                    self._keep_map(slot, (os.fstat(fd).st_ino, mm))
            except BaseException:
                if rfd >= 0:
                    res.done()
                    os.close(rfd)
                raise
            finally:
                if rfd < 0:
                    res.done()  # before the fd closes: the budget never fstat()s a closed (reused) fd
                os.close(fd)
        return mm, rfd

    def _keep_map(self, slot: str, held: tuple[int, mmap.mmap]) -> None:
        """Keep ``held`` as the slot's mapping (one made meanwhile by the spare thread goes)."""
        with self._maps_lock:
            old, self._maps[slot] = self._maps.get(slot), held
        if old is not None and old[1] is not held[1]:
            _close_map(old[1])

    def _mapped(self, slot: str, data: Path, size: int) -> mmap.mmap | None:
        """This process's mapping of the slot's file, if it is still that file at that size."""
        with self._maps_lock:
            held = self._maps.get(slot)
        if held is None or not size:
            return None
        ino, mm = held
        try:
            if os.stat(data).st_ino != ino or len(mm) != size:
                return None
        except OSError:
            return None
        return mm

    def _unmap(self, slot: str) -> None:
        with self._maps_lock:
            held = self._maps.pop(slot, None)
        if held is not None:
            _close_map(held[1])

    def _ready(self, slot: str, size: int) -> bool:
        """Will a write of ``size`` bytes to ``slot`` only copy (a mapping or a spare's is ready)?"""
        with self._maps_lock:
            if slot in self._spare_maps:
                return True
        return self._mapped(slot, self.data_path(slot), size) is not None

    def _spare_of(self, slot: str, size: int) -> int:
        """Bytes allocated of the slot's spare file if it is ``size`` bytes, fully allocated; else 0."""
        try:
            st = os.stat(self.spare_path(slot))
        except OSError:
            return 0
        return st.st_blocks * 512 if size and st.st_size == size and st.st_blocks * 512 >= size else 0

    def prepare_spares(self, size: int) -> None:
        """Make, in a background thread, the files the next writes of ``size`` bytes will need new:
        for a slot whose file a restore has lent (its tensors are views of it), is missing, or is of
        another size. A write that finds its slot's spare renames it into place instead of
        allocating fresh tmpfs pages while training waits (0.5-1.3 s/GiB here). Best effort: each
        is checked against the node's memory like a write (no room: none made; the write then
        checks again), and errors are ignored. A spare costs the state's bytes in the tmpfs until
        the write takes it (or the store is removed)."""
        if size <= 0 or (self._spares is not None and self._spares.is_alive()):
            return

        newest = self.newest()
        # the slot the next write goes to first (not the newest one), then the newest (lent) one
        order = sorted(SLOTS, key=lambda sl: newest is not None and sl == newest.slot)

        def make() -> None:
            for slot in order:
                try:
                    self._make_spare(slot, size)
                    self._premap(slot, size)
                except OSError:
                    pass

        self._spares = threading.Thread(target=make, name="petctl-snapshot-spare", daemon=True)
        self._spares.start()

    def _make_spare(self, slot: str, size: int) -> None:
        data = self.data_path(slot)
        try:
            st = os.stat(data)
            due = st.st_size != size
            if not due:
                got = _lock_unlent(data)
                due = got is None
                if got is not None:
                    _close(got[1])
        except FileNotFoundError:
            due = True
        if not due or self._spare_of(slot, size) or self._cancel.is_set():
            return
        # checked and reserved in one step with the writer's own allocations (_Budget)
        res, _ = _budget(self.dir).reserve(size, self.dir, self.meminfo)
        if res is None:
            return
        path = self.spare_path(slot)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            res.attach(fd)
            os.ftruncate(fd, size)
            _fallocate(fd, size)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            res.done()  # before the fd closes: the budget never fstat()s a closed (reused) fd
            if fd >= 0:
                os.close(fd)
        if self._cancel.is_set():  # the store closed meanwhile: nothing will take it
            tmp.unlink(missing_ok=True)
            return
        os.replace(tmp, path)
        self._made_spares.add(slot)
        _with_spares.add(self)
        try:  # mapped and its page tables filled now, off the write's path (the inode stays on rename)
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            held = (os.fstat(fd).st_ino, _own_map(fd, size))
        finally:
            os.close(fd)
        _populate(held[1])
        with self._maps_lock:
            # kept only while it is still the spare: the writer may have taken it (renamed into
            # place: mapped by the write itself) or removed it meanwhile, or the store closed
            try:
                current = os.stat(path).st_ino == held[0] and not self._cancel.is_set()
            except OSError:
                current = False
            old = None
            if current:
                old, self._spare_maps[slot], held = self._spare_maps.get(slot), held, None
        for left in (old, held):
            if left is not None:
                _close_map(left[1])

    def _premap(self, slot: str, size: int) -> None:
        """Map the slot's file and fill its page tables in the background when a write will reuse
        it in place (a restarted worker: the file is held, this process has no mapping of it yet),
        so that write only copies (a mapping made on the write's path costs it 0.15-0.5 s/GiB)."""
        data = self.data_path(slot)
        if self._cancel.is_set() or self._ready(slot, size) or self._spare_of(slot, size):
            return  # ready, or the write takes the spare
        lock = _lock_unlent(data)
        if lock is None:
            return  # lent (or missing): the write makes a new file
        _close(lock[1])
        try:
            fd = os.open(data, os.O_RDWR)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_size != size or st.st_blocks * 512 < size:
                return  # a write makes a new file (a spare, or its own)
            mm = _own_map(fd, size)
        finally:
            os.close(fd)
        _populate(mm)
        with self._maps_lock:
            if slot not in self._maps:
                self._maps[slot], mm = (st.st_ino, mm), None
        if mm is not None:  # the writer mapped it meanwhile: its mapping stays
            _close_map(mm)

    def _finish(
        self, mm: mmap.mmap | None, header: dict[str, Any], seal: bool = False, nthreads: int = 1
    ) -> None:
        """The CRCs not known yet (``nthreads`` threads: a write waited for), then the header."""
        view = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            # known already when the caller gave them (write(known=...)): not computed again
            todo = [m for m in header["tensors"] if "crc32c" not in m]
            for m, c in zip(todo, crcs.tensor_crcs(view, todo, nthreads)):
                m["crc32c"] = c
        finally:
            view.release()
        header["header_crc"] = _header_crc(header)
        path = self.header_path(header["slot"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(json.dumps(header).encode())
        os.replace(tmp, path)  # tmpfs: no fsync; the rename is the commit
        if seal:
            self._seal(header)

    def _seal(self, header: dict[str, Any]) -> None:
        """The writer's own verification record of the snapshot it just wrote (as
        :meth:`verify` writes one, plus the writer's pid and start time): its bytes matched the
        header's CRCs when the header went in place. It covers a load (:meth:`covered`) only
        once the writer is gone -- no live process then holds the writable mapping the bytes were
        written through, and a write through the filesystem moves the file's mtime -- i.e. after
        a stop or a failure, the very restarts the agent's :meth:`verify` is for: that pass (1 GiB:
        0.3-0.8 s of a node's cores while its new workers start) and the persister's are then not
        made. The lock is waited for at most :data:`SEAL_WAIT` (a reader holds it for a record's
        read; a verification for a whole pass, and writes its own record): past it, no seal, and
        the agent's check makes its pass as before."""
        try:
            lock = os.open(self.verify_lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            if not filelocks.flock_within(lock, fcntl.LOCK_EX, SEAL_WAIT, 0.005):
                return
            try:
                st = os.stat(self.data_path(header["slot"]))
            except OSError:
                return
            if st.st_size == header["size"]:
                self._put_record(header, st, writer=[*_self(), _pidns()])
        finally:
            os.close(lock)

    def _put_record(self, h: dict[str, Any], st: os.stat_result, **extra: Any) -> None:
        record = {"slot": h["slot"], "gen": h["gen"], "nonce": h["nonce"], "header_crc": h["header_crc"],
                  "file": _file_id(st), **extra}  # fmt: skip
        path = self.verified_path()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(json.dumps(record).encode())
        os.replace(tmp, path)

    def flush(self) -> None:
        """Wait until the last write's header is in place; raise what it failed with, if anything."""
        t, self._pending = self._pending, None
        if t is not None:
            t.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    # -- reading

    def load(
        self,
        step: int,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        map_location: Any = "cpu",
        check: Callable[[dict[str, Any], mmap.mmap | None], bool] | None = None,
        epoch: int | None = None,
    ) -> dict[str, Any] | None:
        """The state of snapshot ``step`` (checked), or None when there is no valid one.

        ``epoch`` (given): only a snapshot of that epoch, i.e. of that history (:mod:`.timeline`):
        a slot holding the same step from another history is never loaded for it.

        ``check(header, mm)``, if given, replaces the CRC pass over the mapped bytes: True when
        every tensor's bytes match the header's CRCs, computed otherwise (a peer restore's
        source checks them while it sends them, :func:`peer.send`; a receiver while they
        arrive, :meth:`verified`). Called at most once, on the mapping the tensors will view.

        On the CPU the tensors are views of a private (copy-on-write) mapping of the slot's file,
        not a copy: only the pages training then changes are copied, when it changes them. The
        file stays *lent* while any of the tensors lives (a shared ``flock`` on it, dropped with
        the mapping): :meth:`write` never rewrites a lent file in place but makes a new one, so a
        later snapshot never changes the restored tensors. Elsewhere (a GPU): a copy to the device.
        """
        for c in self.complete():
            h = c.header
            if c.step != int(step):
                continue  # stale (or ahead): never loaded
            if epoch is not None and c.epoch != int(epoch):
                continue  # the same step of another history
            if world_size is not None and h["world_size"] != world_size:
                continue
            if rank is not None and h["rank"] != rank:
                continue
            state = self._load_slot(c, map_location, check)
            if state is not None:
                return state
        return None

    def _load_slot(
        self,
        c: Complete,
        map_location: Any,
        check: Callable[[dict[str, Any], mmap.mmap | None], bool] | None = None,
    ) -> dict[str, Any] | None:
        import torch

        h = c.header
        # lent only if a replacement file for this slot fits now: a lent slot is never rewritten
        # in place, so without that room every later write to it would go to EFS the slow way
        # (its no-fit would repeat for the worker's whole life). No room: a copy, as before.
        lend = _on_cpu(map_location) and _budget(self.dir).fits(h["size"], self.dir, self.meminfo)[0]
        path = self.data_path(c.slot)
        try:  # lent: closed in a child forked from now on (its copy would keep the file lent)
            fd, token = (
                _opened(lambda: os.open(path, os.O_RDONLY)) if lend else (os.open(path, os.O_RDONLY), -1)
            )
        except OSError:
            return None
        mm = None
        try:
            if lend:
                # lent before the header is checked: a writer removes the header before it looks
                # for a lender, so either it sees this lock (a new file) or we see no header
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not same_snapshot(self.read_header(c.slot), c):
                    return None
            if os.fstat(fd).st_size != h["size"]:
                return None
            mm = _map_copy(fd, h["size"], lend) if h["size"] else None
        finally:
            if not lend:
                os.close(fd)
            elif mm is None:
                _close(token)
        view = memoryview(mm) if mm is not None else memoryview(b"")
        out: list[Any] = []
        try:
            if check is not None:
                if not check(h, mm):
                    return None
            elif any(
                crcs.crc(view[m["offset"] : m["offset"] + m["nbytes"]]) != m["crc32c"] for m in h["tensors"]
            ):
                return None
            for m in h["tensors"]:
                dt = dtype_from_name(m["dtype"])
                if m["nbytes"]:
                    raw = torch.frombuffer(mm, dtype=torch.uint8, count=m["nbytes"], offset=m["offset"])
                    t = raw.view(dt).reshape(m["shape"])
                    # lent: a view (the mapping lives as long as a tensor does); else a copy to the
                    # device (the slot is rewritten two snapshots from now)
                    out.append(t if lend else t.to(map_location, copy=True))
                    del raw, t  # unlent: the mmap cannot close while a tensor exports it
                else:
                    out.append(torch.empty(m["shape"], dtype=dt, device=map_location))
            # checked again after the read: a writer that started on this slot meanwhile changed it
            if not same_snapshot(self.read_header(c.slot), c):
                return None
            state = decode_structure(h["structure"], out)
            if lend and mm is not None:
                weakref.finalize(mm, _unlend, token)  # the lock goes with the last view
                mm = None
            return state
        finally:
            view.release()
            if mm is not None:
                out.clear()
                try:
                    mm.close()
                except BufferError:  # a view escaped (cannot happen on the paths above): let gc close it
                    pass
                if lend:
                    _close(token)

    def close(self) -> None:
        """Wait for the last write and drop this process's mappings (the snapshots stay); free the
        spares this store made that no write took (the spare thread makes no more, and what it had
        half-made goes): nothing but a write of this store would ever take them."""
        self._cancel.set()
        try:
            self.flush()
        finally:
            spares, self._spares = self._spares, None
            if spares is not None:
                spares.join()
            for slot in list(self._made_spares):
                self.spare_path(slot).unlink(missing_ok=True)
            self._made_spares.clear()
            for slot in list(self._maps):
                self._unmap(slot)
            with self._maps_lock:
                spare_maps, self._spare_maps = self._spare_maps, {}
            for _, mm in spare_maps.values():
                _close_map(mm)
            self._cancel.clear()  # the store may be written again (a test's, a restarted resume's)

    def remove(self) -> None:
        """Remove this name's files (the agent removes the whole directory at job end)."""
        self.close()
        for s in SLOTS:
            spare = self.spare_path(s)
            for p in (
                self.header_path(s),
                self.data_path(s),
                self.pin_path(s),
                spare,
                spare.with_name(f".{spare.name}.tmp"),
            ):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
