"""Which snapshots need no CRC pass on a restore: the agent's verification and the writer's seal.

The CRC pass may run before the load, not in it: the agent checks the newest snapshot while the
new workers start (:meth:`Verification.verify`, ``<name>.verified.json``) and a restore of that
very snapshot, in the same unchanged file, skips its own pass (:meth:`Verification.prechecked`).
The writer records the same for the bytes it checked itself, sealed with its pid
(:meth:`Verification._seal`): once it is gone, neither the agent's check nor the persister makes
that pass again. A record vouches for a header (generation, nonce, header CRC) in one unchanged
file (:func:`file_id`); nothing else.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import filelocks
from petctl_agent.checkpointing import crcs
from petctl_agent.checkpointing.header import Complete, same_snapshot
from petctl_agent.checkpointing.processes import alive, pid_namespace, this_process

#: seconds a restore waits for the agent's verification of its snapshot still running (then it
#: checks the bytes itself): that verification is the same pass, started earlier
VERIFY_WAIT = 30.0
#: seconds a writer waits for the verification lock to seal what it wrote (else it does not)
SEAL_WAIT = 1.0


#: bytes checked between two looks for a seal (a look: a record read, two stats)
SEAL_LOOK = 64 << 20


def crcs_match(
    header: dict[str, Any],
    mm: mmap.mmap | None,
    sealed: Callable[[], bool] | None = None,
    look: int = SEAL_LOOK,
) -> bool:
    """Do the mapped bytes match every tensor's CRC in ``header``? The one pass over a snapshot's
    bytes that a load, a receive's later load, the agent's verification, a peer source and the
    persister make.

    ``sealed``: asked before the first tensor and again once every ``look`` bytes were checked;
    when it says yes, the rest is taken as checked (the writer's seal, :meth:`Verification.covered`:
    the persister's pass of a drained step, whose writer exits while the pass runs)."""
    view = memoryview(mm) if mm is not None else memoryview(b"")
    try:
        unchecked = look  # a look before the first tensor
        for m in header["tensors"]:
            if sealed is not None and unchecked >= look:
                if sealed():
                    return True
                unchecked = 0
            unchecked += int(m["nbytes"])
            if crcs.crc(view[m["offset"] : m["offset"] + m["nbytes"]]) != m["crc32c"]:
                return False
        return True
    finally:
        view.release()


def file_id(st: os.stat_result) -> list[int]:
    """What a verification record pins of a slot's data file: a write through the filesystem moves
    the mtime, a replacement the inode."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Verification:
    """The store's verification records (a mixin of :class:`.snapshot.SnapshotStore`, which gives
    ``dir``, ``name``, ``newest``, ``read_header`` and ``data_path``): the agent's check of the
    newest snapshot (:meth:`verify`), the writer's seal of what it wrote (:meth:`_seal`), and a
    restore's question whether either covers its snapshot (:meth:`prechecked`, :meth:`covered`)."""

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
                    ok = crcs_match(c.header, mm)
                finally:
                    if mm is not None:
                        mm.close()
                after = os.fstat(fd)
            finally:
                os.close(fd)
            if not ok or file_id(before) != file_id(after) or not same_snapshot(self.read_header(c.slot), c):
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
            return self.covered(header, wait) or crcs_match(header, mm)

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
                if alive(int(writer[0]), writer[1], writer[2]):
                    return False
            except (TypeError, ValueError, IndexError):
                return False
        try:
            st = os.stat(self.data_path(str(rec.get("slot"))))
        except (OSError, ValueError):
            return False
        return file_id(st) == rec.get("file")

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
                self._put_record(header, st, writer=[*this_process(), pid_namespace()])
        finally:
            os.close(lock)

    def _put_record(self, h: dict[str, Any], st: os.stat_result, **extra: Any) -> None:
        record = {"slot": h["slot"], "gen": h["gen"], "nonce": h["nonce"], "header_crc": h["header_crc"],
                  "file": file_id(st), **extra}  # fmt: skip
        path = self.verified_path()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(json.dumps(record).encode())
        os.replace(tmp, path)
