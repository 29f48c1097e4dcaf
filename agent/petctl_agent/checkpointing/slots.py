"""A snapshot store's slot files: which file a write goes into, made and mapped ahead of it.

The slot's file is reused in place, and stays mapped in the writer, rather than created anew: at
1 GiB here ``posix_fallocate`` takes 0.29 s, filling a mapping's page tables 0.15 s (the copy's
faults) to 0.5 s (``MAP_POPULATE``), the copy into a mapped slot 0.05 s (docs/benchmarks.md,
"Memory snapshots"). What a write would do beyond the copy -- a new file (*spare*) for a lent or
missing slot, a restarted worker's mapping of its held slots -- a background thread does
beforehand (:meth:`Slots.prepare_spares`), each file's pages reserved in the node's budget
(:mod:`.budget`) first. So a name costs up to twice its state's bytes in shared memory, three
times while a spare stands by. A worker that exits for good frees the spares no write took.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import weakref
from pathlib import Path

from petctl_agent.checkpointing import budget, mapping
from petctl_agent.checkpointing.header import SLOTS

#: stores that made spares: a worker that exits for good frees those no write took (atexit)
_with_spares: weakref.WeakSet[Slots] = weakref.WeakSet()
#: every store of this process: a forked child drops their mappings (:func:`_after_fork_in_child`)
_stores: weakref.WeakSet[Slots] = weakref.WeakSet()


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


def track(store: Slots) -> None:
    """Count ``store`` among this process's stores (a forked child drops their mappings)."""
    _stores.add(store)


def _after_fork_in_child() -> None:
    """After ``os.fork``, in the child (after :mod:`.mapping`'s handler closed the lock fds): the
    stores' own mappings (slots, spares) are not in the child (``MADV_DONTFORK``); their ``mmap``
    objects, each holding a ``dup`` of its file's fd, are dropped here: a file the parent unlinks
    later (a spare it frees, a slot it replaces) keeps no pages in ``/dev/shm`` for the child's
    life. Nor does the child ever free the parent's spares on its exit."""
    _with_spares.clear()  # the parent's spares: its own exit frees them, never the child's
    for store in list(_stores):
        store._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Slots:
    """A store's slot files and its mappings of them (a mixin of :class:`.snapshot.SnapshotStore`,
    which gives the paths, ``dir``, ``meminfo``, ``newest`` and the state set in its ``__init__``):
    the file a write goes into (:meth:`_place`: reused in place, a spare renamed into place, or a
    new one), the spares made ahead of it and the mappings kept between writes
    (:meth:`prepare_spares`)."""

    def _forget_in_child(self) -> None:
        """In a child forked from this process (:func:`_after_fork_in_child`): drop the mappings
        (not in the child: ``MADV_DONTFORK``; their ``mmap`` objects hold a ``dup`` of the file's
        fd) and the spares, which are the parent's."""
        self._maps_lock = threading.Lock()  # a thread of the parent may have held it at the fork
        maps = list(self._maps.values()) + list(self._spare_maps.values())
        self._maps, self._spare_maps = {}, {}
        for _, mm in maps:
            mapping.drop_in_child(mm)
        self._made_spares = set()
        self._claims = {}

    def _place(
        self,
        slot: str,
        data: Path,
        size: int,
        held: int,
        spare: int,
        res: budget.Reservation,
        lazy: bool = False,
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
                            mapping.close_map(spare_map[1])
                        return f"no-fit: {why}"
        else:  # in place after all (the restore's tensors are gone), or no spare: none kept unused
            self.spare_path(slot).unlink(missing_ok=True)
        if spare_map is not None:
            mapping.close_map(spare_map[1])
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
                    mm = mapping.own_map(fd, size)
                    self._keep_map(slot, (os.fstat(fd).st_ino, mm))
                elif size:
                    try:
                        mapping.fallocate(fd, size)
                    except OSError as e:
                        os.ftruncate(fd, 0)
                        return f"no-fit: reserving {budget.gib(size)} in {self.dir}: {e.strerror}"
                    # kept mapped between writes. Not MAP_POPULATE: it fills the page tables
                    # in one thread, holding the GIL (0.45-0.50 s/GiB here), where the copy's own
                    # page faults, taken by torch's copy threads, cost 0.15 (docs/benchmarks.md)
                    mm = mapping.own_map(fd, size)
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
            mapping.close_map(old[1])

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
            mapping.close_map(held[1])

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

    def prepare_spares(self, size: int, first_only: bool = False) -> None:
        """Make, in a background thread, the files the next writes of ``size`` bytes will need new:
        for a slot whose file a restore has lent (its tensors are views of it), is missing, or is of
        another size. A write that finds its slot's spare renames it into place instead of
        allocating fresh tmpfs pages while training waits (0.5-1.3 s/GiB here). Best effort: each
        is checked against the node's memory like a write (no room: none made; the write then
        checks again), and errors are ignored. A spare costs the state's bytes in the tmpfs until
        the write takes it (or the store is removed). ``first_only``: only the next write's file."""
        if size <= 0 or (self._spares is not None and self._spares.is_alive()):
            return

        newest = self.newest()
        # the slot the next write goes to first (not the newest one), then the newest (lent) one
        order = sorted(SLOTS, key=lambda sl: newest is not None and sl == newest.slot)
        if first_only:
            order = order[:1]

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
                got = mapping.lock_unlent(data)
                due = got is None
                if got is not None:
                    mapping.release(got[1])
        except FileNotFoundError:
            due = True
        if not due or self._cancel.is_set():
            return
        if self._spare_of(slot, size):
            # made by an earlier worker of the store (one that exited, a drain's os._exit, after
            # its thread made it): this process has no mapping of it, and a write that found it
            # unmapped would map and populate it on its path (2.7-6.9 s at 1 GiB under a join's
            # load in bench_state.py --tools petctl-local --checkpoint-every 0): map it here
            with self._maps_lock:
                if slot in self._spare_maps:
                    return
            self._map_spare(slot, size)
            return
        # checked and reserved in one step with the writer's own allocations (budget.Budget)
        res, _ = budget.of(self.dir).reserve(size, self.dir, self.meminfo)
        if res is None:
            return
        path = self.spare_path(slot)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            res.attach(fd)
            os.ftruncate(fd, size)
            mapping.fallocate(fd, size)
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
        self._map_spare(slot, size)

    def _map_spare(self, slot: str, size: int) -> None:
        """Register the slot's spare as this process's (freed at its exit unless a write took it),
        map it and fill its page tables now, off the write's path (the inode stays when the write
        renames it into place)."""
        self._made_spares.add(slot)
        _with_spares.add(self)
        path = self.spare_path(slot)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            held = (os.fstat(fd).st_ino, mapping.own_map(fd, size))
        finally:
            os.close(fd)
        mapping.populate(held[1])
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
                mapping.close_map(left[1])

    def _premap(self, slot: str, size: int) -> None:
        """Map the slot's file and fill its page tables in the background when a write will reuse
        it in place (a restarted worker: the file is held, this process has no mapping of it yet),
        so that write only copies (a mapping made on the write's path costs it 0.15-0.5 s/GiB)."""
        data = self.data_path(slot)
        if self._cancel.is_set() or self._ready(slot, size) or self._spare_of(slot, size):
            return  # ready, or the write takes the spare
        lock = mapping.lock_unlent(data)
        if lock is None:
            return  # lent (or missing): the write makes a new file
        mapping.release(lock[1])
        try:
            fd = os.open(data, os.O_RDWR)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if st.st_size != size or st.st_blocks * 512 < size:
                return  # a write makes a new file (a spare, or its own)
            mm = mapping.own_map(fd, size)
        finally:
            os.close(fd)
        mapping.populate(mm)
        with self._maps_lock:
            if slot not in self._maps:
                self._maps[slot], mm = (st.st_ino, mm), None
        if mm is not None:  # the writer mapped it meanwhile: its mapping stays
            mapping.close_map(mm)
