"""Writing a snapshot: a state's bytes copied into the older slot, then its CRCs and header.

Two slots (``a``, ``b``) per name: a write goes into the slot that does *not* hold the newest
complete snapshot, after removing that slot's header, so a writer killed at any point leaves the
newest complete snapshot intact. Unless that slot is *pinned* (the persister writes it to EFS):
the writer then overwrites the newest complete snapshot, and the pinned, older one stays readable
until the persist ends (:mod:`.snapshot` says more). Before a write, the bytes the slot must grow
by are reserved in the node's budget (:mod:`.budget`): what does not fit is ``"no-fit: ..."`` and
touches nothing.

The CRCs are computed after the copy, in a background thread (awscrt releases the GIL): the
blocking part of :meth:`Writing.write` is the copy -- of CUDA tensors only its enqueue
(:mod:`.device_copy`), the thread waits for its end first. :meth:`Writing.flush` waits for the header.
A write that is waited for (``wait``: a coordinated stop, the last step) computes them at once on
up to 8 threads instead (:mod:`.crcs`, pieces joined with crc32_combine). Torch is imported only
to copy.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from petctl_agent.checkpointing import budget, crcs, device_copy, mapping
from petctl_agent.checkpointing.header import (
    ALIGN,
    FORMAT,
    SLOTS,
    Complete,
    Unsupported,
    encode_structure,
    header_crc,
    same_layout,
    same_snapshot,
)
from petctl_agent.checkpointing.timeline import epoch_of
from petctl_agent.checkpointing.verification import crcs_match

OK = "ok"


def layout(tensors: list[Any]) -> tuple[list[dict[str, Any]], int]:
    """Where a write puts each of ``tensors`` in its slot's file (each at an ``ALIGN`` boundary),
    and the file's size."""
    metas = []
    off = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": nbytes})
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return metas, off


class Writing:
    """A store's writes (a mixin of :class:`.snapshot.SnapshotStore`, which gives the paths, the
    claims of a slot, ``read_header``/``complete``/``newest``, the slot files (:class:`.slots.Slots`)
    and the writer's seal (:class:`.verification.Verification`)): a state copied into the older
    slot (:meth:`write`), a peer's snapshot received into it (:meth:`receive`), the CRCs and the
    header after the copy (:meth:`flush`)."""

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

        Returns once the bytes are copied (training may change the tensors then; a CUDA tensor's
        copy is enqueued only, and the current stream's next kernels wait for it: :mod:`.device_copy`);
        the checksums and the header follow in a background thread unless ``wait``. Anything but ``"ok"``
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
        metas, size = layout(tensors)
        if known is not None and same_layout(known, metas):
            for m, k in zip(metas, known):
                m["crc32c"] = int(k["crc32c"])

        def fill(mm: mmap.mmap | None) -> Callable[[], None] | None:
            return device_copy.copy_into(mm, tensors, metas)  # a device's copy: ready() waits for it

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
        node's memory first, as for a write (:func:`.budget.fits`).

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
            return (got is not None and same_snapshot(header, got)) or crcs_match(header, mm)

        return check

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
        res: budget.Reservation | None = None
        try:
            try:
                st = os.stat(data)
                # reused in place only at the same size: shrinking a file that a reader (the
                # persister, another rank) has mapped would SIGBUS it; a new inode leaves the
                # reader's pages alone. Nor while a restore has it lent (its tensors are views of a
                # private mapping of the file, whose pages a write in place would change under it)
                held = st.st_blocks * 512 if st.st_size == size else 0
                if held:
                    lent = mapping.lock_unlent(data)
                    if lent is None:
                        held = 0
            except FileNotFoundError:
                held = 0
            spare = 0 if held else self._spare_of(slot, size)  # a new file is due: made already?
            # checked and reserved in one step with the spare thread's allocations (budget.Budget)
            res, why = budget.of(self.dir).reserve(size - (held or spare), self.dir, self.meminfo)
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
                mapping.release(
                    lent[1]
                )  # a restore that lends the file from now on finds no header: never maps it
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
        ready = None  # a copy from a device still in flight: waited for before the CRCs and header
        try:
            if lazy:
                fill(mm, lambda off, n: os.posix_fallocate(rfd, off, n) if rfd >= 0 else None)
            else:
                ready = fill(mm)
        except BaseException:
            self._unmap(slot)  # close_map waits for a device's copies into it first
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
                self._finish(mm, header, seal, ready=ready)
            except BaseException as e:  # noqa: BLE001 - reported by flush()
                self._error = e

        if wait or all("crc32c" in m for m in metas):
            # waited for (a coordinated stop, the last step): on every core the node lends it
            self._finish(mm, header, seal, crcs.threads() if wait else 1, ready)
        else:
            self._pending = threading.Thread(target=finish, name="petctl-snapshot-crc", daemon=True)
            self._pending.start()
        return OK

    def _finish(
        self,
        mm: mmap.mmap | None,
        header: dict[str, Any],
        seal: bool = False,
        nthreads: int = 1,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """The end of the copy (``ready``), the CRCs not known yet (``nthreads`` threads: a write
        waited for), then the header."""
        if ready is not None:
            ready()
        view = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            # known already when the caller gave them (write(known=...)): not computed again
            todo = [m for m in header["tensors"] if "crc32c" not in m]
            for m, c in zip(todo, crcs.tensor_crcs(view, todo, nthreads)):
                m["crc32c"] = c
        finally:
            view.release()
        header["header_crc"] = header_crc(header)
        path = self.header_path(header["slot"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(json.dumps(header).encode())
        os.replace(tmp, path)  # tmpfs: no fsync; the rename is the commit
        if seal:
            self._seal(header)

    def flush(self) -> None:
        """Wait until the last write's copy has ended and its header is in place; raise what it
        failed with, if anything."""
        t, self._pending = self._pending, None
        if t is not None:
            t.join()
        err, self._error = self._error, None
        if err is not None:
            raise err
