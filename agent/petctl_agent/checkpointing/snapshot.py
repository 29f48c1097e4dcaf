"""Node-local memory snapshots of a state dict: raw tensor bytes in ``/dev/shm``, outliving the workers.

A snapshot is two files per slot in the store's directory (a tmpfs: ``/dev/shm/petctl/<job>``,
owned by the agent, docs/agent.md "Memory snapshots"):

- ``<name>.<slot>.bin``: every tensor's bytes, 64-byte aligned, one after another. Loading maps
  it, never unpickles: on the CPU the tensors are views of a private (copy-on-write) mapping, the
  file *lent* (a shared ``flock``) while they live, so a writer never rewrites it in place.
- ``<name>.<slot>.json``: the header, written last (temp file + ``os.replace``): its presence is the
  "complete" marker. What it holds: :mod:`.header`.

Two slots (``a``, ``b``) per name: a write goes into the slot that does *not* hold the newest
complete snapshot, after removing that slot's header, so a writer killed at any point leaves the
newest complete snapshot intact. Unless that slot is *pinned*: the persister holds a shared
``flock`` on ``<name>.<slot>.pin`` while it writes the slot to EFS (:meth:`SnapshotStore.pin`), and
the writer, which takes that lock exclusively (non-blocking) while it claims a slot, then writes
into the other one -- it overwrites the newest complete snapshot, and the pinned, older one stays
readable until the persist ends. So a persist slower than two checkpoint intervals still lands
(at most one persist behind), and a writer killed mid-write leaves the pinned snapshot as the
newest complete one (older, but whole; a restore checks the step). A dead persister's pin goes
with it (the kernel drops its ``flock``).

Never loaded: a slot without its header (torn), a header or tensor whose CRC does not match, a
data file of the wrong size, or a snapshot of another step than the one asked for (stale). The
CRC pass may run before the load, not in it (:mod:`.verification`).

The store is :class:`SnapshotStore`; this module holds its files' names, the claims and pins of a
slot, its headers and its reads. The rest has rooms of its own: the writes (:mod:`.writing`), the
slot files made and mapped ahead of a write (:mod:`.slots`), the verification records
(:mod:`.verification`), the node's memory budget that keeps a write from an OOM (:mod:`.budget`),
the lock fds and mappings a forked child must not keep (:mod:`.mapping`). Torch is imported only
to write or read.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import filelocks
from petctl_agent.checkpointing import budget, mapping
from petctl_agent.checkpointing.budget import read_meminfo
from petctl_agent.checkpointing.header import (
    FORMAT,
    SLOTS,
    Complete,
    decode_structure,
    dtype_from_name,
    header_crc,
    same_snapshot,
)
from petctl_agent.checkpointing.slots import Slots, track
from petctl_agent.checkpointing.verification import Verification, crcs_match
from petctl_agent.checkpointing.writing import Writing


def node_name(directory: str | os.PathLike) -> str:
    """Which node a store is on, as the ranks compare it: the host and the store's real path (the
    ranks of one node share their store; the local cloud's instances on one machine each have
    their own)."""
    return f"{socket.gethostname()}|{os.path.realpath(directory)}"


class SnapshotStore(Writing, Slots, Verification):
    """The snapshots of one name (e.g. ``rank-3``, or ``replicated``) in a tmpfs directory.

    One writer per name at a time (the worker that owns it); any number of readers (the other
    ranks of the node, the persister), which never see a torn slot: they read a slot's header,
    copy, and check the header's generation again.

    Here: the names of its files, the claims and pins of a slot, the headers, reading. Its writes
    are :class:`.writing.Writing`'s, its slot files and mappings :class:`.slots.Slots`'s, its
    verification records :class:`.verification.Verification`'s.
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
        track(self)

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
            fd, token = mapping.opened(lambda: os.open(self.pin_path(c.slot), os.O_RDWR | os.O_CREAT, 0o600))
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
                mapping.release(token)

    def _claim(self, slot: str) -> int | None:
        """The slot's pin lock, exclusively, if no persister pins it (non-blocking), else None.
        The fd: close it with :meth:`_unclaim` (a child forked meanwhile closes its copy)."""
        got = mapping.opened(lambda: filelocks.try_hold(self.pin_path(slot)))
        if got is None:
            return None
        self._claims[got[0]] = got[1]
        return got[0]

    def _claim_waiting(self, slot: str) -> int:
        """The slot's pin lock, exclusively, waiting for the persister that pins it."""
        fd, token = mapping.opened(lambda: os.open(self.pin_path(slot), os.O_RDWR | os.O_CREAT, 0o600))
        self._claims[fd] = token
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # not under _fork_lock: a fork meanwhile closes the child's copy
        except BaseException:
            self._unclaim(fd)
            raise
        return fd

    def _unclaim(self, fd: int) -> None:
        mapping.release(self._claims.pop(fd))

    def read_header(self, slot: str) -> dict[str, Any] | None:
        """The slot's header if present and intact (its own CRC matches), else None."""
        try:
            h = json.loads(self.header_path(slot).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("slot") != slot:
            return None
        if h.get("header_crc") != header_crc(h):
            return None
        return h

    def complete(self) -> list[Complete]:
        """Complete snapshots (header present and intact), newest generation first."""
        found = [Complete(s, h) for s in SLOTS if (h := self.read_header(s)) is not None]
        return sorted(found, key=lambda c: c.gen, reverse=True)

    def newest(self) -> Complete | None:
        c = self.complete()
        return c[0] if c else None

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
        lend = mapping.on_cpu(map_location) and budget.of(self.dir).fits(h["size"], self.dir, self.meminfo)[0]
        path = self.data_path(c.slot)
        try:  # lent: closed in a child forked from now on (its copy would keep the file lent)
            fd, token = (
                mapping.opened(lambda: os.open(path, os.O_RDONLY))
                if lend
                else (os.open(path, os.O_RDONLY), -1)
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
            mm = mapping.map_copy(fd, h["size"], lend) if h["size"] else None
        finally:
            if not lend:
                os.close(fd)
            elif mm is None:
                mapping.release(token)
        out: list[Any] = []
        try:
            if not (check(h, mm) if check is not None else crcs_match(h, mm)):
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
                weakref.finalize(mm, mapping.unlend, token)  # the lock goes with the last view
                mm = None
            return state
        finally:
            if mm is not None:
                out.clear()
                try:
                    mm.close()
                except BufferError:  # a view escaped (cannot happen on the paths above): let gc close it
                    pass
                if lend:
                    mapping.release(token)

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
                mapping.close_map(mm)
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
