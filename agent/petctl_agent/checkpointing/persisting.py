"""A memory snapshot written to the checkpoint directory in today's format: one persist, and the
in-process :class:`Persister` that runs it in a thread.

:func:`persist_newest` takes the newest complete snapshot of a name (``checkpointing/snapshot.py``),
checks its CRCs, writes it as ``ckpt-<step:010d>.pt`` (``torch.save`` of ``{"step", "epoch",
"state", "saved_at"}``, what :func:`petctl_agent.checkpointing.files.load_file` reads) into a temp
file, fsyncs it, and only then renames it and replaces ``latest`` (with its sha256, size and the
snapshot's epoch: :mod:`.timeline`) -- today's atomic ``latest`` semantics, ``latest`` moved only to
a newer ``(epoch, step)``. The tensors are read straight out of the snapshot's ``mmap`` (no
copy). The slot is *pinned* for the whole persist (:meth:`SnapshotStore.pin`, a shared ``flock``):
the writer never writes into a pinned slot -- it overwrites the newer one instead -- so a persist
always lands, however slow EFS is next to the checkpoint interval, and the persister then takes
the newest complete snapshot, at most one persist behind. The seqlock check stays (header gone or
generation changed: the temp file is dropped, the newest goes next). Never a torn mix.

Who runs it: the agent's persister process (:mod:`.persist`), or, where no agent serves the store
(plain torchrun, tests), rank 0's own :class:`Persister` thread.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import timeline
from petctl_agent.checkpointing.atomic import fsync_dir
from petctl_agent.checkpointing.files import (
    HashingFile,
    open_temp,
    prune,
    publish_lock,
    read_pointer,
    write_pointer,
)
from petctl_agent.checkpointing.header import Complete, decode_structure, dtype_from_name, same_snapshot
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.checkpointing.verification import crcs_match


def persist_newest(
    store: SnapshotStore, directory: Path, keep: int = 3, pause: Callable[[], Any] | None = None
) -> int | None:
    """Persist the newest complete snapshot if ``latest`` is older; the step persisted, else None.
    ``pause``: called before each write to the file (the persister's yield to a peer's fetch).

    Older by ``(epoch, step)`` (:mod:`.timeline`): a snapshot of an abandoned history never
    replaces the live one's ``latest``, however high its step; the live history's replaces an
    abandoned one's, even at a lower step."""
    c = store.newest()
    if c is None:
        return None
    pointer = read_pointer(directory)
    if timeline.key(pointer) >= c.key:
        return None  # already there (or EFS is ahead: a restart of the whole job restored from it)
    return c.step if _persist(store, c, directory, keep, pause) else None


def _persist(
    store: SnapshotStore, c: Complete, d: Path, keep: int, pause: Callable[[], Any] | None = None
) -> bool:
    pin = store.pin(c)
    if pin is None:
        return False  # the writer took the slot first: the caller picks the newest again
    try:
        return _persist_pinned(store, c, d, keep, pause)
    finally:
        os.close(pin)  # unpinned: the writer may use the slot again


def _persist_pinned(
    store: SnapshotStore, c: Complete, d: Path, keep: int, pause: Callable[[], Any] | None
) -> bool:
    import torch

    h = c.header
    try:
        fd = os.open(store.data_path(c.slot), os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != h["size"]:
            return False
        mm = mmap.mmap(fd, h["size"], access=mmap.ACCESS_COPY) if h["size"] else None
    finally:
        os.close(fd)
    d.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{c.step:010d}.pt"
    tmp: Path | None = None
    tensors: list[Any] = []
    state: Any = None
    try:
        # a torn or overwritten slot is never persisted; a sealed one is not checked again: its
        # writer checked the bytes and is gone (SnapshotStore.covered; a drained step's writer
        # exits while this runs: looked at again every SEAL_LOOK bytes)
        if not crcs_match(h, mm, sealed=lambda: store.covered(h, wait=0)):
            return False
        for m in h["tensors"]:
            dt = dtype_from_name(m["dtype"])
            if m["nbytes"]:
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=m["nbytes"], offset=m["offset"])
                tensors.append(raw.view(dt).reshape(m["shape"]))
                del raw
            else:
                tensors.append(torch.empty(m["shape"], dtype=dt))
        state = decode_structure(h["structure"], tensors)
        tmp, f = open_temp(d, name)
        with f:
            hf = HashingFile(f, pause)
            torch.save({"step": c.step, "epoch": c.epoch, "state": state, "saved_at": time.time()}, hf)
            f.flush()
            os.fsync(f.fileno())
        state = None
        tensors.clear()  # views of the mmap: gone before it closes
        if not same_snapshot(store.read_header(c.slot), c):
            tmp.unlink()  # the slot changed under us after all: the next call takes the newer one
            return False
        with publish_lock(d):
            # the agent's persister and a rank 0 whose wait for it timed out may both get here
            # with the same step: the second drops its copy instead of replacing the file that
            # `latest` already names (with other bytes: another saved_at) or moving `latest` back
            pointer = read_pointer(d)
            if timeline.key(pointer) >= c.key:
                return True
            os.replace(tmp, d / name)
            fsync_dir(d)
            write_pointer(
                d,
                {
                    "file": name,
                    "step": c.step,
                    "format": "torch",
                    "sha256": hf.sha.hexdigest(),
                    "size": hf.size,
                    "epoch": c.epoch,  # the snapshot's history, not this process's
                },
            )
        prune(d, keep, name)
        return True
    finally:
        state = None
        tensors.clear()
        if mm is not None:
            mm.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)


class Persister:
    """Persist ``store``'s newest snapshot into ``directory`` in the background, newest first.

    :meth:`kick` after each snapshot; :meth:`wait` returns once the newest snapshot at the time of
    the call is on disk (the job's last step waits for it).
    """

    def __init__(self, store: SnapshotStore, directory: Path, keep: int = 3, poll: float = 1.0) -> None:
        self.store = store
        self.directory = Path(directory)
        self.keep = keep
        self.poll = poll
        self.errors: list[str] = []
        self._lock = threading.Lock()  # one persist at a time (the thread's, or wait()'s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="petctl-persist", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll)
            self._wake.clear()
            self.once()

    def once(self) -> int | None:
        try:
            with self._lock:
                return persist_newest(self.store, self.directory, self.keep)
        except Exception as e:  # noqa: BLE001 - EFS trouble: retried at the next kick, reported
            self.errors.append(f"{type(e).__name__}: {e}")
            return None

    def wait(self, timeout: float | None = None) -> bool:
        """Persist the newest complete snapshot now, in this thread; True once ``latest`` names it.

        False on timeout (the writer kept replacing the slot mid-persist). An error writing the
        checkpoint directory is raised, as today's synchronous save would.
        """
        self.store.flush()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                c = self.store.newest()
                if c is None or timeline.key(read_pointer(self.directory)) >= c.key:
                    return True
                persist_newest(self.store, self.directory, self.keep)
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.05)  # a snapshot that cannot be persisted (torn, gone) is retried, not spun on

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
