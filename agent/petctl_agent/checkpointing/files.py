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
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import efsrate
from petctl_agent.checkpointing.atomic import atomic_write, fsync_dir

LATEST = "latest"
CKPT_RE = re.compile(r"^ckpt-(\d{10})\.(pt|dcp)$")


def checkpoint_dir(directory: str | os.PathLike | None = None) -> Path:
    """Return the checkpoint directory: the argument, else ``$PETCTL_CHECKPOINT_DIR``.

    Raises:
        ValueError: neither is set (under plain torchrun, pass a directory).
    """
    d = directory or os.environ.get("PETCTL_CHECKPOINT_DIR")
    if not d:
        raise ValueError("no checkpoint directory: pass directory= or set PETCTL_CHECKPOINT_DIR")
    return Path(d)


def write_pointer(d: Path, pointer: dict[str, Any]) -> None:
    """Replace ``latest`` atomically (only once the checkpoint it names is durable)."""
    atomic_write(d / LATEST, json.dumps(pointer).encode())


def read_pointer(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / LATEST).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def publish_lock(d: Path) -> Iterator[None]:
    """An exclusive POSIX lock on ``<d>/.persist.lock`` (fcntl byte-range locks work across NFS/EFS
    clients): held while a checkpoint file and ``latest`` are put in place, by the agent's persister
    and by a rank 0 writing directly, so ``latest`` always names the bytes of the file it names."""
    fd = os.open(d / ".persist.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


class HashingFile:
    """A write-only file object for ``torch.save`` that also sha256s what goes through it."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b: Any) -> int:
        self.sha.update(b)
        n = self.f.write(b)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def write_file(state: dict[str, Any], step: int, d: Path, keep: int, *, forward_only: bool = False) -> Path:
    """Write the single-file checkpoint of ``step``, point ``latest`` at it, prune (rank 0's job).

    ``torch.save`` streams into a temp file next to it (sha256 and size taken on the way), fsync,
    rename: no copy of the state in memory. This is the path a memory snapshot that does not fit
    falls back to, i.e. when the node's memory is short: it once serialized into a ``BytesIO`` and
    then copied that (``getvalue``), 2 x the state of transient memory (at 4 GiB per rank on 2
    nodes sharing this machine: MemAvailable 2.0 -> 0.9 GiB in 2 s, stopped before the kernel's
    OOM killer; docs/benchmarks.md, "Stop 28").

    ``forward_only``: when ``latest`` already names ``step`` or a newer one (the agent's persister
    got there first), write nothing: never replace the file ``latest`` names, never move it back.
    """
    import torch

    d.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(step):010d}.pt"
    path = d / name
    tmp = d / f".{name}.{os.getpid()}.tmp"
    try:
        with efsrate.open(tmp, "wb") as f:
            hf = HashingFile(f)
            torch.save({"step": int(step), "state": state, "saved_at": time.time()}, hf)
            f.flush()
            os.fsync(f.fileno())
        with publish_lock(d):
            p = read_pointer(d) if forward_only else None
            if p and int(p.get("step", -1)) >= int(step):
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


def load_file(
    path: Path, expect_sha: str | None, map_location: Any, unsafe_load: bool | None = None
) -> tuple[dict[str, Any], int]:
    """Read a single-file checkpoint with ``weights_only=True``.

    Raises:
        UnsafeCheckpointError: it needs a full unpickle and the caller did not opt in.
    """
    import torch

    data = efsrate.read_bytes(path)
    if expect_sha is not None and hashlib.sha256(data).hexdigest() != expect_sha:
        raise ValueError(f"checksum mismatch for {path}")
    try:
        obj = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - only a weights_only refusal is ours to judge
        what = refused_global(e)
        if what is None:
            raise
        if not unsafe_allowed(unsafe_load):
            raise UnsafeCheckpointError(unsafe_message(path, what)) from None
        print(
            f"petctl checkpoint: {path.name} holds {what}: full unpickle (unsafe load opted in)",
            file=sys.stderr,
        )
        obj = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
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
