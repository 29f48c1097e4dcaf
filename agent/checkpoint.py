"""Checkpoint helper for training scripts run by petctl (or plain ``torchrun``).

Atomic checkpoints on the shared filesystem plus the worker side of the drain
protocol. One call per step::

    from petctl_agent import checkpoint as ckpt

    restored = ckpt.resume()                      # (state, step) on this rank's device, or None
    start = 1 if restored is None else restored[1] + 1
    for step in range(start, total + 1):
        train_one_step()
        ckpt.step(step, lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                  every=50, last=step == total)    # collective: call on every rank

:func:`step` reports progress, agrees with the other ranks on "checkpoint now"
and "drain now", saves when they agreed, and on an agreed drain exits with
:data:`petctl_agent.DRAIN_EXIT_CODE` after the save. The finer calls it is made
of stay available: :func:`report_progress`, :func:`should_checkpoint`,
:func:`save`, :func:`drain_requested`, :func:`exit_for_drain`, :func:`load_latest`.

Drain agreement: the agent creates ``$PETCTL_DRAIN_FILE`` on a node that must
stop (leaving, or a scale-up it absorbs without losing steps). Each call of
:func:`should_checkpoint` starts an all-reduce (MAX) of the local flag on the
process group's device (a CUDA tensor under NCCL, CPU under gloo) *without
waiting for it* and reads the result of the previous call's all-reduce: a flag
raised at step ``s`` is decided at step ``s + 1``, by every rank, at the same
step. Reading it does not synchronise the GPU with the current step (the result
is copied to pinned memory behind a CUDA event recorded one step earlier).
``PETCTL_AGREEMENT=sync`` decides at the same step instead (an all-reduce and a
host read every step). Without ``$PETCTL_DRAIN_FILE`` (plain torchrun) nothing is
exchanged and only ``step % every`` counts.

Layouts in the directory, both with a ``latest`` pointer (JSON: ``file``, ``step``,
``format``; plus ``sha256``/``size`` for single files) replaced atomically after
the checkpoint itself is durable:

- plain state (DDP): rank 0 writes ``ckpt-<step:010d>.pt`` -- ``torch.save`` into a
  temp file in the same directory, fsync, ``os.replace``, fsync dir;
- sharded state (any ``DTensor``/``ShardedTensor`` in it, e.g. FSDP2 state dicts): every
  rank writes its own shard with ``torch.distributed.checkpoint`` into a hidden temp
  directory, which rank 0 renames to ``ckpt-<step:010d>.dcp`` once all are written.
  It loads at any world size (DCP reshards), into the state dict you pass.

A writer killed at any point leaves the previous ``latest`` intact. Saves end in a
barrier on a dedicated gloo group whose timeout (``PETCTL_CHECKPOINT_TIMEOUT``,
default 1800 s) is independent of the collective timeout: a long write to EFS must
not trip the 60 s collective timeout or NCCL's watchdog, which aborts any NCCL
collective (barriers included) still pending after the group's timeout.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.atomic import atomic_write, fsync_dir
from petctl_agent.distributed import dist_on, dist_rank, dist_world
from petctl_agent.drain import drain_requested, exit_for_drain, report_progress, should_checkpoint

__all__ = [
    "DRAIN_EXIT_CODE",
    "NeedsStateError",
    "checkpoint_dir",
    "drain_requested",
    "exit_for_drain",
    "latest_step",
    "load_latest",
    "report_progress",
    "resume",
    "save",
    "should_checkpoint",
    "step",
]

LATEST = "latest"
_CKPT_RE = re.compile(r"^ckpt-(\d{10})\.(pt|dcp)$")


def checkpoint_dir(directory: str | os.PathLike | None = None) -> Path:
    """Return the checkpoint directory: the argument, else ``$PETCTL_CHECKPOINT_DIR``.

    Raises:
        ValueError: neither is set (under plain torchrun, pass a directory).
    """
    d = directory or os.environ.get("PETCTL_CHECKPOINT_DIR")
    if not d:
        raise ValueError("no checkpoint directory: pass directory= or set PETCTL_CHECKPOINT_DIR")
    return Path(d)


# ---- the checkpoint process group (its own timeout) ----------------------------------
_ckpt_group_for: tuple[Any, Any] | None = None  # (default group it was made for, gloo group)


def _barrier_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("PETCTL_CHECKPOINT_TIMEOUT", "1800")))


def _ckpt_group() -> Any:
    """A gloo group over all ranks with the checkpoint timeout (created on first use; collective).

    Why a separate gloo group rather than ``barrier()`` on the default group: under
    NCCL a barrier is an NCCL collective, and the watchdog aborts the process when it
    is still pending after the group's timeout (60 s here) -- while rank 0 is writing
    a large checkpoint to EFS. Gloo has no watchdog; its timeout is per operation.
    """
    global _ckpt_group_for
    import torch.distributed as dist

    world = dist.group.WORLD
    if _ckpt_group_for is None or _ckpt_group_for[0] is not world:
        _ckpt_group_for = (world, dist.new_group(backend="gloo", timeout=_barrier_timeout()))
    return _ckpt_group_for[1]


def _barrier() -> None:
    """Every rank waits here until all arrived (no-op without a process group).

    ``monitored_barrier`` on the checkpoint group: CPU-only, its own timeout, and on
    timeout rank 0 names the ranks that never arrived.
    """
    if not dist_on():
        return
    import torch.distributed as dist

    dist.monitored_barrier(group=_ckpt_group(), timeout=_barrier_timeout(), wait_all_ranks=True)


# ---- save -------------------------------------------------------------------------------
def _is_sharded(obj: Any, _depth: int = 0) -> bool:
    """Does ``obj`` (nested dicts/lists) hold a DTensor or ShardedTensor?

    Only looks for the classes when their modules are loaded: no sharded tensor can
    exist otherwise, and plain scripts do not pay for importing them.
    """
    kinds = []
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and hasattr(dt, "DTensor"):
        kinds.append(dt.DTensor)
    st = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st is not None and hasattr(st, "ShardedTensor"):
        kinds.append(st.ShardedTensor)
    if not kinds:
        return False
    kinds_t = tuple(kinds)

    def walk(o: Any, depth: int) -> bool:
        if isinstance(o, kinds_t):
            return True
        if depth > 32:
            return False
        if isinstance(o, dict):
            return any(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return any(walk(v, depth + 1) for v in o)
        return False

    return walk(obj, _depth)


def save(
    state: dict[str, Any],
    step: int,
    directory: str | os.PathLike | None = None,
    keep: int | None = None,
) -> Path | None:
    """Save ``state`` as the checkpoint of ``step``. Collective: every rank must call it.

    Plain state: rank 0 writes one file. Sharded state (DTensor/ShardedTensor values,
    e.g. FSDP2): every rank writes its shard through ``torch.distributed.checkpoint``.
    All ranks then meet in a barrier so nobody moves on, or exits for a drain,
    before the checkpoint and ``latest`` are durable.

    Args:
        state: picklable dict (tensors on any device, state dicts, numbers).
        step: the last completed step this state includes.
        directory: defaults to ``$PETCTL_CHECKPOINT_DIR``.
        keep: newest checkpoints to keep (default ``$PETCTL_CHECKPOINT_KEEP`` or 3).

    Returns:
        The checkpoint path on rank 0, else None.
    """
    d = checkpoint_dir(directory)
    keep = keep if keep is not None else int(os.environ.get("PETCTL_CHECKPOINT_KEEP", "3"))
    if _is_sharded(state):
        return _save_sharded(state, int(step), d, keep)
    out: Path | None = None
    if dist_rank() == 0:
        out = _write_checkpoint(state, step, d, keep)
    _barrier()
    return out


def _write_checkpoint(state: dict[str, Any], step: int, d: Path, keep: int) -> Path:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"step": int(step), "state": state, "saved_at": time.time()}, buf)
    data = buf.getvalue()
    name = f"ckpt-{int(step):010d}.pt"
    path = d / name
    atomic_write(path, data)
    pointer = {
        "file": name,
        "step": int(step),
        "format": "torch",
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    atomic_write(d / LATEST, json.dumps(pointer).encode())
    _prune(d, keep, name)
    return path


def _save_sharded(state: dict[str, Any], step: int, d: Path, keep: int) -> Path | None:
    import torch.distributed.checkpoint as dcp

    name = f"ckpt-{step:010d}.dcp"
    tmp = d / f".{name}.tmp"
    group = _ckpt_group() if dist_on() else None
    rank0 = dist_rank() == 0
    if rank0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a writer killed earlier at this step
        tmp.mkdir()
    _barrier()
    # The coordination (plans, metadata) runs on the gloo checkpoint group: same timeout.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), process_group=group)
    out: Path | None = None
    if rank0:
        fsync_dir(tmp)
        final = d / name
        if final.exists():  # saved this step before (a retry): replace it
            trash = d / f".{name}.old.tmp"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(d)
        pointer = {"file": name, "step": step, "format": "dcp", "world_size": dist_world()}
        atomic_write(d / LATEST, json.dumps(pointer).encode())
        _prune(d, keep, name)
        out = final
    _barrier()
    return out


def _list_checkpoints(d: Path) -> list[tuple[int, Path]]:
    """Checkpoints in ``d`` (files and DCP directories), newest first."""
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), d / n) for n in names if (m := _CKPT_RE.match(n))]
    return sorted(found, reverse=True)


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except OSError:
            pass


def _prune(d: Path, keep: int, current: str) -> None:
    for _, p in _list_checkpoints(d)[max(keep, 1) :]:
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


# ---- load -------------------------------------------------------------------------------
def _read_pointer(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / LATEST).read_text())
    except (OSError, ValueError):
        return None


def latest_step(directory: str | os.PathLike | None = None) -> int | None:
    """Step recorded in the ``latest`` pointer (cheap: no checkpoint is read), or None."""
    p = _read_pointer(checkpoint_dir(directory))
    return int(p["step"]) if p and "step" in p else None


def _load_file(path: Path, expect_sha: str | None, map_location: Any) -> tuple[dict[str, Any], int]:
    import torch

    data = path.read_bytes()
    if expect_sha is not None and hashlib.sha256(data).hexdigest() != expect_sha:
        raise ValueError(f"checksum mismatch for {path}")
    obj = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    return obj["state"], int(obj["step"])


class NeedsStateError(TypeError):
    """The checkpoint is sharded: loading it needs the state dict to load into."""


def _load_dcp(path: Path, into: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
    import torch.distributed.checkpoint as dcp

    if into is None:
        raise NeedsStateError(
            f"{path.name} is a sharded (torch.distributed.checkpoint) checkpoint: pass the state "
            "dict to load into, e.g. resume({'model': model.state_dict(), ...})"
        )
    group = _ckpt_group() if dist_on() else None
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)
    return into, int(_CKPT_RE.match(path.name).group(1))


def load_latest(
    directory: str | os.PathLike | None = None,
    map_location: Any = None,
    into: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest readable checkpoint: ``(state, step)``, or None when there is none.

    The file named by ``latest`` is verified against its sha256; if it is missing
    or unreadable, older checkpoints are tried newest first.

    Args:
        directory: defaults to ``$PETCTL_CHECKPOINT_DIR``.
        map_location: for single-file checkpoints; default this rank's device
            (:func:`petctl_agent.distributed.rank_device`).
        into: for sharded checkpoints (collective then: every rank calls it): the state
            dict, with DTensors laid out as now, that ``torch.distributed.checkpoint``
            loads in place. Returned as the state.

    Raises:
        NeedsStateError: (a ``TypeError``) the newest checkpoint is sharded and ``into`` is None.
    """
    d = checkpoint_dir(directory)
    if map_location is None:
        from petctl_agent.distributed import rank_device

        map_location = rank_device()
    pointer = _read_pointer(d)
    candidates: list[tuple[Path, str | None]] = []
    if pointer and pointer.get("file"):
        candidates.append((d / pointer["file"], pointer.get("sha256")))
    for s, path in _list_checkpoints(d):
        if any(path == c for c, _ in candidates):
            continue
        if pointer and "step" in pointer and s > int(pointer["step"]):
            continue  # written after the pointer we trust: never made it to 'latest'
        candidates.append((path, None))
    for i, (path, sha) in enumerate(candidates):
        try:
            if path.name.endswith(".dcp"):
                return _load_dcp(path, into)
            return _load_file(path, sha, map_location)
        except NeedsStateError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable newest falls back
            what = "newest " if i == 0 else ""
            print(f"petctl checkpoint: {what}{path.name} unreadable ({e}); trying older", file=sys.stderr)
    return None


def resume(
    state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    directory: str | os.PathLike | None = None,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest checkpoint onto this rank's device: ``(state, step)``, or None.

    Call it on every rank. ``state`` (a dict or a function returning one) is only
    needed for sharded checkpoints: the DTensors in it are filled in place.
    """
    into = state() if callable(state) else state
    return load_latest(directory, into=into)


def step(
    step: int,
    state_fn: Callable[[], dict[str, Any]],
    every: int = 50,
    directory: str | os.PathLike | None = None,
    *,
    last: bool = False,
    world_size: int | None = None,
) -> bool:
    """Everything a training loop needs after step ``step``, in one collective call.

    Reports progress, agrees with every rank on checkpoint/drain (:func:`should_checkpoint`),
    saves ``state_fn()`` when they agreed (or ``last``), and on an agreed drain exits
    with :data:`DRAIN_EXIT_CODE` once the checkpoint is durable.

    Args:
        step: the step just completed (steps count from 1).
        state_fn: returns the state to save; only called when saving.
        every: periodic checkpoint interval in steps (0: only on drain / ``last``).
        directory: defaults to ``$PETCTL_CHECKPOINT_DIR``.
        last: the final step: always save, and finish normally even if a drain was agreed.
        world_size: reported with the progress (default: the process group's size).

    Returns:
        True if a checkpoint was saved.
    """
    report_progress(step, world_size if world_size is not None else dist_world())
    saved = False
    if should_checkpoint(step, every) or last:
        save(state_fn(), step, directory)
        saved = True
    if drain_requested() and not last:
        exit_for_drain()
    return saved
