"""The checkpoint directory: its names, the ``latest`` pointer, pruning, and the single-file format.

A plain checkpoint is one ``ckpt-<step:010d>.pt`` (``torch.save`` bytes written atomically, their
sha256 in the pointer); a sharded one is a ``ckpt-<step:010d>.dcp`` directory
(:mod:`petctl_agent.checkpointing.sharded`). :mod:`petctl_agent.checkpoint` is the API on top; torch is
imported only to write or read a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import iohook, timeline
from petctl_agent.checkpointing.atomic import atomic_write, fsync_dir

LATEST = "latest"
CKPT_RE = re.compile(r"^ckpt-(\d{10})\.(pt|dcp)$")


def checkpoint_dir(directory: str | os.PathLike | None = None) -> Path:
    """Return the checkpoint directory: the argument, else ``$PETCTL_CHECKPOINT_DIR``.

    Raises:
        ValueError: neither is set (under plain torchrun, pass a directory).
    """
    d = directory or knobs.checkpoint_dir()
    if not d:
        raise ValueError("no checkpoint directory: pass directory= or set PETCTL_CHECKPOINT_DIR")
    return Path(d)


def write_pointer(d: Path, pointer: dict[str, Any]) -> None:
    """Replace ``latest`` atomically (only once the checkpoint it names is durable).

    A pointer without an ``epoch`` gets this process's generation's, once agreed
    (:mod:`.timeline`: which history the step is of; a pointer without one counts as epoch 0)."""
    if "epoch" not in pointer and (e := timeline.current()) is not None:
        pointer = {**pointer, "epoch": e}
    atomic_write(d / LATEST, json.dumps(pointer).encode())


def read_pointer(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / LATEST).read_text())
    except (OSError, ValueError):
        return None


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock(d: Path) -> threading.Lock:
    key = os.path.realpath(d)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(key, threading.Lock())


@contextlib.contextmanager
def publish_lock(d: Path) -> Iterator[None]:
    """An exclusive POSIX lock on ``<d>/.persist.lock`` (fcntl byte-range locks work across NFS/EFS
    clients): held while a checkpoint file and ``latest`` are put in place, by the agent's persister
    and by a rank 0 writing directly, so ``latest`` always names the bytes of the file it names.

    A POSIX lock belongs to the process, not the thread: two threads of one process (rank 0's save
    and the persister thread a worker runs when no agent serves its store) would both hold it, and
    closing either's fd drops it for both. A thread lock per directory serializes them first."""
    with _thread_lock(d):
        fd = os.open(d / ".persist.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)


class HashingFile:
    """A write-only file object for ``torch.save`` that also sha256s what goes through it;
    ``pause`` (if given) is called before each write (``torch.save`` writes a tensor's bytes in
    one call): a background writer yields there to work on the job's path."""

    def __init__(self, f: Any, pause: Callable[[], Any] | None = None) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.pause = pause

    def write(self, b: Any) -> int:
        if self.pause is not None:
            self.pause()
        self.sha.update(b)
        n = self.f.write(b)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def open_temp(d: Path, name: str) -> tuple[Path, Any]:
    """A new temp file in ``d`` for ``name``'s bytes (through :mod:`.iohook`), open for writing:
    unique (``mkstemp``), so that two writers of one step -- rank 0's save and a persister thread in
    the same process, or processes with one pid on two hosts sharing EFS -- never write one inode.
    Named ``.<name>.*.tmp``: :func:`prune` removes a dead writer's."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=d)
    return Path(tmp), iohook.wrap(os.fdopen(fd, "wb"), tmp, "wb")


def write_file(
    state: dict[str, Any],
    step: int,
    d: Path,
    keep: int,
    *,
    forward_only: bool = False,
    epoch: int | None = None,
) -> Path:
    """Write the single-file checkpoint of ``step``, point ``latest`` at it, prune (rank 0's job).

    ``torch.save`` streams into a temp file next to it (sha256 and size taken on the way), fsync,
    rename: no copy of the state in memory. This is the path a memory snapshot that does not fit
    falls back to, i.e. when the node's memory is short: it once serialized into a ``BytesIO`` and
    then copied that (``getvalue``), 2 x the state of transient memory (at 4 GiB per rank on 2
    nodes sharing this machine: MemAvailable 2.0 -> 0.9 GiB in 2 s, stopped before the kernel's
    OOM killer; docs/benchmarks.md).

    ``forward_only``: when ``latest`` already names ``step`` or a newer one (the agent's persister
    got there first), write nothing: never replace the file ``latest`` names, never move it back.
    Newer is by ``(epoch, step)`` (:mod:`.timeline`). ``epoch``: the history the state is of (a
    restored memory snapshot's); default this generation's.
    """
    import torch

    if epoch is None:
        epoch = timeline.current() or 0
    mine = (int(epoch), int(step))

    d.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(step):010d}.pt"
    path = d / name
    if forward_only:  # cheap first: a persister that got there already saves a whole write
        p = read_pointer(d)
        if p and timeline.key(p) >= mine:
            return d / str(p.get("file", name))
    tmp, f = open_temp(d, name)
    try:
        with f:
            hf = HashingFile(f)
            torch.save({"step": int(step), "epoch": int(epoch), "state": state, "saved_at": time.time()}, hf)
            f.flush()
            os.fsync(f.fileno())
        with publish_lock(d):
            p = read_pointer(d) if forward_only else None
            if p and timeline.key(p) >= mine:
                return d / str(p.get("file", name))
            os.replace(tmp, path)
            fsync_dir(d)
            write_pointer(
                d,
                {
                    "file": name,
                    "step": int(step),
                    "format": "torch",
                    "sha256": hf.sha.hexdigest(),
                    "size": hf.size,
                    "epoch": int(epoch),
                },
            )
    finally:
        tmp.unlink(missing_ok=True)
    prune(d, keep, name)
    return path


UNSAFE_ENV = "PETCTL_CHECKPOINT_UNSAFE_LOAD"


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds a type that ``torch.load(weights_only=True)`` refuses to rebuild.

    Unpickling it would run whatever code its pickle names, as this job: the checkpoint
    directory may be writable by others. The message names the type and the opt-in.
    """


def unsafe_allowed(unsafe: bool | None) -> bool:
    """The argument if given, else ``$PETCTL_CHECKPOINT_UNSAFE_LOAD`` (``1``/``true``/``yes``)."""
    if unsafe is not None:
        return bool(unsafe)
    return os.environ.get(UNSAFE_ENV, "").strip().lower() in ("1", "true", "yes")


def refused_global(e: BaseException) -> str | None:
    """The global named by a weights_only refusal (``module.Name``), or None for other errors."""
    import pickle

    if not isinstance(e, pickle.UnpicklingError) or "weights only load failed" not in str(e).lower():
        return None
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return m.group(1) if m else "a type outside torch's weights_only allow-list"


def unsafe_message(path: Path, what: str) -> str:
    return (
        f"{path.name} holds {what}, which a safe (weights_only) load refuses: unpickling it could run "
        f"code from whoever can write {path.parent}. If you trust them, load it with "
        f"{UNSAFE_ENV}=1 or resume(..., unsafe_load=True); or save only tensors, numbers, strings, "
        "lists and dicts (e.g. .tolist()), or torch.serialization.add_safe_globals([YourType])"
    )


#: the sha256 pass reads the file in pieces of this size (hashlib releases the GIL on each)
HASH_PIECE = 8 << 20


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes, read in pieces (through :mod:`.iohook`, once)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_PIECE)
    view = memoryview(buf)
    with iohook.open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def load_file(
    path: Path, expect_sha: str | None, map_location: Any, unsafe_load: bool | None = None
) -> tuple[dict[str, Any], int]:
    """Read a single-file checkpoint with ``weights_only=True``; its sha256 checked before return.

    ``torch.load`` reads the file itself while a thread hashes it (:func:`file_sha256`, the pass
    that the emulated EFS paces): one copy of the state in memory and the hash beside the load,
    where it once read the whole file into memory, hashed that and then built the tensors from it
    (2 x the state, and read + hash + copy one after the other: 2.1 s against 0.6 s for a 1 GiB
    ``torch.load`` alone; docs/benchmarks.md). Both read the same file through the same
    page cache; what is loaded is returned only if the hash matches (``weights_only`` makes the
    unpickle of bytes not yet checked safe). A file that fails its hash raises ``ValueError``
    (checksum mismatch) whatever ``torch.load`` made of it.

    Raises:
        UnsafeCheckpointError: it needs a full unpickle and the caller did not opt in.
    """
    import torch

    digest: list[str | BaseException] = []
    hasher = None
    if expect_sha is not None:

        def hash_it() -> None:
            try:
                digest.append(file_sha256(path))
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                digest.append(e)

        hasher = threading.Thread(target=hash_it, name="petctl-ckpt-sha256", daemon=True)
        hasher.start()

    def checked() -> None:
        if hasher is None:
            return
        hasher.join()
        got = digest[0]
        if isinstance(got, BaseException):
            raise got
        if got != expect_sha:
            raise ValueError(f"checksum mismatch for {path}")

    def read(weights_only: bool) -> Any:
        if hasher is not None:  # the hash pass pays the EFS read; this one reads the page cache
            return torch.load(path, map_location=map_location, weights_only=weights_only)
        with iohook.open(path, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=weights_only)

    try:
        obj = read(True)
    except Exception as e:  # noqa: BLE001 - only a weights_only refusal is ours to judge
        checked()  # a damaged file says so, not what the unpickler made of it
        what = refused_global(e)
        if what is None:
            raise
        if not unsafe_allowed(unsafe_load):
            raise UnsafeCheckpointError(unsafe_message(path, what)) from None
        print(
            f"petctl checkpoint: {path.name} holds {what}: full unpickle (unsafe load opted in)",
            file=sys.stderr,
        )
        obj = read(False)
    checked()
    return obj["state"], int(obj["step"])


def list_checkpoints(d: Path) -> list[tuple[int, Path]]:
    """Checkpoints in ``d`` (files and DCP directories), newest first."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), d / n) for n in names if (m := CKPT_RE.match(n))]
    return sorted(found, reverse=True)


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except OSError:
            pass


def prune(d: Path, keep: int, current: str) -> None:
    """Keep the newest ``keep`` checkpoints (and ``current``); remove dead writers' temp files."""
    for _, p in list_checkpoints(d)[max(keep, 1) :]:
        if p.name != current:
            _remove(p)
    # temp files/dirs of writers killed mid-save (older than a minute: not a live writer)
    for n in os.listdir(d):
        if n.startswith(".") and n.endswith(".tmp"):
            p = d / n
            try:
                if time.time() - p.stat().st_mtime > 60:
                    _remove(p)
            except OSError:
                pass
