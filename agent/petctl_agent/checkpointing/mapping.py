"""The snapshot store's file descriptors and mappings, and what ``os.fork`` must not carry over.

It owns the lock fds a forked child (a DataLoader worker: ``os.fork``, no exec) must close -- a
restore's lent file, a persister's pin, a writer's claim -- opened through :func:`opened` and
closed through :func:`release`, with no fork in between (an at-fork handler closes the child's
copies); and the mappings themselves: a slot's or a spare's shared mapping, never in a child
(:func:`own_map`, ``MADV_DONTFORK``), a restore's private copy-on-write one (:func:`map_copy`),
a page allocation that fails with ENOSPC rather than a SIGBUS (:func:`fallocate`), and page
tables filled off the GIL (:func:`populate`). The store (:mod:`.snapshot`) decides which files;
this module only opens, locks, maps and closes them.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import filelocks

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


def opened(open_fd: Callable[[], int | None]) -> tuple[int, int] | None:
    """``open_fd()`` (an open, perhaps a non-blocking ``flock``: never waits), no fork in between,
    its fd closed in every child forked later; ``(fd, token)`` (close with :func:`release`) or None."""
    with _fork_lock:
        fd = open_fd()
        if fd is None:
            return None
        try:
            return fd, _record(fd)
        except BaseException:
            os.close(fd)
            raise


def release(token: int) -> None:
    """Close a recorded fd (its lock goes). Once only; in a forked child the fd is closed already
    (:func:`_after_fork_in_child`) and never closed twice (its number may be another file's now)."""
    with _fork_lock:
        entry = _child_closes.pop(token, None)
        if entry is not None:
            try:
                os.close(entry[0])
            except OSError:
                pass


def unlend(token: int) -> None:
    """A lent file's last tensor is gone: close its fd, the lock goes."""
    release(token)


def lock_unlent(path: Path) -> tuple[int, int] | None:
    """``path``'s flock, exclusively, if no restore has the file lent (non-blocking); else None.

    ``(fd, token)``: close with :func:`release`. A restore lends a slot's file with a shared
    ``flock`` for as long as its tensors are views of it (:meth:`SnapshotStore.load`); the writer
    then makes a new file.
    """
    return opened(lambda: filelocks.try_hold(path, create=False))


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

    Registered first (the stores' modules import this one), so it runs before their own at-fork
    handlers: the budgets' (:mod:`.budget`) and the stores' mappings' (:mod:`.slots`)."""
    global _fork_lock
    _fork_lock = threading.Lock()  # held by the parent's fork (_before_fork): a new one
    entries = list(_child_closes.values())
    _child_closes.clear()
    for fd, dev, ino in entries:
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


def fallocate(fd: int, size: int) -> None:
    """Allocate the file's pages now (tmpfs: ENOSPC here, not a SIGBUS on the copy)."""
    os.posix_fallocate(fd, 0, size)


#: madvise(2) advice: fault every page of the range in for writing (Linux 5.14); not in Python 3.11
MADV_POPULATE_WRITE = 23
#: madvise(2) advice: the range is not in a child made by fork (Linux 2.6.16)
MADV_DONTFORK = 10


def madvise(mm: mmap.mmap, advice: int) -> None:
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


def populate(mm: mmap.mmap) -> None:
    """Fill ``mm``'s page tables now (a background thread's work), with the GIL released.

    ``MADV_POPULATE_WRITE`` through ctypes: ``MAP_POPULATE`` and ``mmap.madvise`` hold the GIL for
    the whole call (0.3-0.6 s/GiB here: the training thread would stall), a foreign call does not.
    Best effort: an older kernel (EINVAL) leaves the faults to the copy."""
    madvise(mm, MADV_POPULATE_WRITE)


#: mmap(2) flags for a placeholder at a given address, failing (EEXIST) if anything is mapped there
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
#: in a forked child: mappings of the parent's store whose range something else took before the
#: at-fork handler ran; never closed (that would unmap the other thing), so never freed
_kept_in_child: list[mmap.mmap] = []


def drop_in_child(mm: mmap.mmap) -> None:
    """In a forked child: close ``mm`` (one of :func:`own_map`'s: not in the child) and the
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
        close_map(mm)  # unmaps the placeholder
        return
    if got is not None and got != ctypes.c_void_p(-1).value:  # a kernel without NOREPLACE: a hint
        libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(len(mm)))
    _kept_in_child.append(mm)


def own_map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of a slot's or a spare's file for this process's writes, never in a forked
    child (``MADV_DONTFORK``): a DataLoader worker has no use for it, and its copy would keep the
    file's pages (a whole state) in ``/dev/shm`` for the child's life after the parent unlinked it.
    Not for a restore's mapping: restored tensors view that one, and a child may read them."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    madvise(mm, MADV_DONTFORK)
    return mm


#: called with a mapping just before :func:`close_map` closes it: :mod:`.device_copy` unregisters
#: one it page-locked for CUDA there, once the copies into it have ended
before_close: list[Callable[[mmap.mmap], None]] = []


def address(mm: mmap.mmap) -> int | None:
    """Where ``mm`` starts in this process (None: closed)."""
    import ctypes

    try:
        anchor = ctypes.c_char.from_buffer(mm)
    except (TypeError, ValueError):
        return None
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the mapping's buffer export: the mmap could not close while it lived


def close_map(mm: mmap.mmap) -> None:
    """Close a slot's or a spare's mapping: every one of the store's own goes through here."""
    for hook in before_close:
        hook(mm)
    try:
        mm.close()
    except BufferError:  # a fill that raised left a view in its traceback: gc unmaps it
        pass


def on_cpu(map_location: Any) -> bool:
    """Is ``map_location`` the CPU (a restore there can be views of a mapping, not a copy)?"""
    if map_location is None:
        return True
    return str(map_location).split(":")[0] == "cpu"


def map_copy(fd: int, size: int, lend: bool) -> mmap.mmap:
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
