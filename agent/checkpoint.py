"""Checkpoint helper for training scripts run by petctl (or plain ``torchrun``).

Atomic checkpoints on the shared filesystem plus the worker side of the drain
protocol. Usage in a training loop::

    from petctl_agent import checkpoint as ckpt

    restored = ckpt.load_latest()
    start = 0 if restored is None else restored[1] + 1
    for step in range(start, total):
        train_one_step()
        ckpt.report_progress(step, world_size)
        if ckpt.should_checkpoint(step, every=50):   # collective: call on all ranks
            ckpt.save({"model": model.state_dict(), ...}, step)   # rank 0 writes
            if ckpt.drain_requested():
                ckpt.exit_for_drain()                # every rank stops at this step

Drain protocol: the agent creates ``$PETCTL_DRAIN_FILE`` on a node that must
stop (leaving, or a scale-up/membership change it wants to absorb without
losing steps). :func:`should_checkpoint` all-reduces the local flag (MAX) on
every call, so *every* rank learns about the drain at the same step, all of
them checkpoint that step, and all of them exit with
:data:`petctl_agent.DRAIN_EXIT_CODE`. The agents then re-rendezvous and the
workers resume at ``step + 1``: no step is lost.

Checkpoint layout in the directory: ``ckpt-<step:010d>.pt`` files, each written
to a temporary file in the same directory, fsync'ed and ``os.replace``d, and a
``latest`` pointer (JSON: file, step, sha256, size) replaced atomically after
the checkpoint itself is durable. A writer killed at any point leaves either the
old ``latest`` or the new one, never a torn file behind it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE

__all__ = [
    "DRAIN_EXIT_CODE",
    "checkpoint_dir",
    "drain_requested",
    "exit_for_drain",
    "latest_step",
    "load_latest",
    "report_progress",
    "save",
    "should_checkpoint",
]

LATEST = "latest"
_CKPT_RE = re.compile(r"^ckpt-(\d{10})\.pt$")
_global_drain = False  # set by should_checkpoint() when any rank saw the drain file


def checkpoint_dir(directory: str | os.PathLike | None = None) -> Path:
    """Return the checkpoint directory: the argument, else ``$PETCTL_CHECKPOINT_DIR``.

    Raises:
        ValueError: neither is set (under plain torchrun, pass a directory).
    """
    d = directory or os.environ.get("PETCTL_CHECKPOINT_DIR")
    if not d:
        raise ValueError("no checkpoint directory: pass directory= or set PETCTL_CHECKPOINT_DIR")
    return Path(d)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency of the agent extra
        pass
    return int(os.environ.get("RANK", "0"))


def _dist_world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same dir, fsync, replace, fsync dir."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def save(
    state: dict[str, Any],
    step: int,
    directory: str | os.PathLike | None = None,
    keep: int | None = None,
) -> Path | None:
    """Save ``state`` as the checkpoint of ``step`` (rank 0 writes; every rank must call it).

    Non-zero ranks do not write; all ranks then meet in a barrier (when a process
    group is initialised) so that nobody moves on, or exits for a drain, before
    the checkpoint is durable.

    Args:
        state: picklable dict (tensors, state dicts, numbers).
        step: the last completed step this state includes.
        directory: defaults to ``$PETCTL_CHECKPOINT_DIR``.
        keep: newest checkpoints to keep (default ``$PETCTL_CHECKPOINT_KEEP`` or 3).

    Returns:
        The checkpoint path on rank 0, else None.
    """
    out: Path | None = None
    if _rank() == 0:
        out = _write_checkpoint(state, step, checkpoint_dir(directory), keep)
    _barrier()
    return out


def _write_checkpoint(state: dict[str, Any], step: int, d: Path, keep: int | None) -> Path:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"step": int(step), "state": state, "saved_at": time.time()}, buf)
    data = buf.getvalue()
    name = f"ckpt-{int(step):010d}.pt"
    path = d / name
    _atomic_write(path, data)
    pointer = {"file": name, "step": int(step), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    _atomic_write(d / LATEST, json.dumps(pointer).encode())
    _prune(d, keep if keep is not None else int(os.environ.get("PETCTL_CHECKPOINT_KEEP", "3")), name)
    return path


def _list_checkpoints(d: Path) -> list[tuple[int, Path]]:
    """Checkpoints in ``d``, newest first."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), d / n) for n in names if (m := _CKPT_RE.match(n))]
    return sorted(found, reverse=True)


def _prune(d: Path, keep: int, current: str) -> None:
    for _, p in _list_checkpoints(d)[max(keep, 1) :]:
        if p.name != current:
            try:
                p.unlink()
            except OSError:
                pass
    # temp files of writers killed mid-save (older than a minute: not a live writer)
    for n in os.listdir(d):
        if n.startswith(".") and n.endswith(".tmp"):
            p = d / n
            try:
                if time.time() - p.stat().st_mtime > 60:
                    p.unlink()
            except OSError:
                pass


def _read_pointer(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / LATEST).read_text())
    except (OSError, ValueError):
        return None


def latest_step(directory: str | os.PathLike | None = None) -> int | None:
    """Step recorded in the ``latest`` pointer (cheap: no checkpoint is read), or None."""
    p = _read_pointer(checkpoint_dir(directory))
    return int(p["step"]) if p and "step" in p else None


def _load_file(path: Path, expect_sha: str | None) -> tuple[dict[str, Any], int]:
    import torch

    data = path.read_bytes()
    if expect_sha is not None and hashlib.sha256(data).hexdigest() != expect_sha:
        raise ValueError(f"checksum mismatch for {path}")
    obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    return obj["state"], int(obj["step"])


def load_latest(directory: str | os.PathLike | None = None) -> tuple[dict[str, Any], int] | None:
    """Load the newest readable checkpoint: ``(state, step)``, or None when there is none.

    The file named by ``latest`` is verified against its sha256; if it is missing
    or unreadable, older ``ckpt-*.pt`` files are tried newest first.
    """
    d = checkpoint_dir(directory)
    pointer = _read_pointer(d)
    tried: set[Path] = set()
    if pointer:
        path = d / pointer.get("file", "")
        tried.add(path)
        try:
            return _load_file(path, pointer.get("sha256"))
        except Exception as e:  # noqa: BLE001 - any unreadable newest falls back
            print(f"petctl checkpoint: newest {path.name} unreadable ({e}); trying older", file=sys.stderr)
    for _, path in _list_checkpoints(d):
        if path in tried:
            continue
        if pointer and "step" in pointer and int(_CKPT_RE.match(path.name).group(1)) > int(pointer["step"]):
            continue  # written after the pointer we trust: never made it to 'latest'
        try:
            return _load_file(path, None)
        except Exception as e:  # noqa: BLE001
            print(f"petctl checkpoint: {path.name} unreadable ({e}); trying older", file=sys.stderr)
    return None


def _local_drain_flag() -> bool:
    f = os.environ.get("PETCTL_DRAIN_FILE")
    return bool(f) and os.path.exists(f)


def drain_requested() -> bool:
    """True when this node's drain file exists, or the last :func:`should_checkpoint`
    learnt (via all-reduce) that some rank's node is draining."""
    return _global_drain or _local_drain_flag()


def should_checkpoint(step: int, every: int) -> bool:
    """Return True when this step must be checkpointed: every ``every`` steps, or on drain.

    This is a collective when a process group with more than one rank is
    initialised (a one-element all-reduce MAX of the local drain flag): call it
    on every rank at every step, so all ranks agree on the step.
    """
    global _global_drain
    flag = _local_drain_flag()
    if _dist_world() > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = bool(t.item())
    _global_drain = flag
    return flag or (every > 0 and step % every == 0)


def exit_for_drain() -> None:
    """Stop this worker at once after a drain checkpoint, with :data:`DRAIN_EXIT_CODE`.

    ``os._exit``: the checkpoint is durable (``save`` ended in a barrier), and a
    clean ``destroy_process_group`` + interpreter shutdown took ~10 s with gloo
    here while peers tear down -- time every rank would spend not training.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(DRAIN_EXIT_CODE)


def report_progress(step: int, world_size: int) -> None:
    """Record the last completed step in ``$PETCTL_PROGRESS_FILE`` (local rank 0 only; atomic)."""
    f = os.environ.get("PETCTL_PROGRESS_FILE")
    if not f or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    body = json.dumps({"step": int(step), "world_size": int(world_size), "t": time.time()}).encode()
    try:
        _atomic_write(Path(f), body)
    except OSError:
        pass  # progress is advisory


def _barrier() -> None:
    if _dist_world() > 1:
        import torch.distributed as dist

        dist.barrier()
