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

Loading is safe by default: single files with ``torch.load(weights_only=True)``, sharded
ones with DCP's ``.metadata`` unpickled against DCP's own record types and each non-tensor
value ``weights_only``. A checkpoint holding any other type (a numpy array, your own class)
is refused with :class:`UnsafeCheckpointError` naming the type; opt in with
``PETCTL_CHECKPOINT_UNSAFE_LOAD=1`` or ``resume(..., unsafe_load=True)`` only when everyone
who can write the directory is trusted (or allow the type with
``torch.serialization.add_safe_globals``).

A writer killed at any point leaves the previous ``latest`` intact. Saves end in a
barrier on a dedicated gloo group whose timeout (``PETCTL_CHECKPOINT_TIMEOUT``,
default 1800 s) is independent of the collective timeout: a long write to EFS must
not trip the 60 s collective timeout or NCCL's watchdog, which aborts any NCCL
collective (barriers included) still pending after the group's timeout.

Made of (``checkpointing/``): the directory's layout and the single-file format (``files.py``),
the sharded path (``sharded.py``), the checkpoint group (``group.py``), the drain agreement
(``drain.py``), memory snapshots of replicated state when the agent turned them on (``memory.py``:
``$PETCTL_SNAPSHOT_DIR``; docs/agent.md), and of sharded state with a replica on a peer node (``sharded_memory.py``). This module stays import-light: no torch until a checkpoint is written or read.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.checkpointing import memory, sharded_memory
from petctl_agent.checkpointing.drain import (
    drain_leaving,
    drain_requested,
    exit_for_drain,
    report_progress,
    should_checkpoint,
)
from petctl_agent.checkpointing.files import (
    UnsafeCheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_file,
    read_pointer,
    write_file,
)
from petctl_agent.checkpointing.group import barrier
from petctl_agent.checkpointing.sharded import NeedsStateError, is_sharded, load_sharded, save_sharded
from petctl_agent.distributed import dist_rank, dist_world

__all__ = [
    "DRAIN_EXIT_CODE",
    "NeedsStateError",
    "UnsafeCheckpointError",
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
    return _save(state, step, directory, keep, durable=True)


def _save(
    state: dict[str, Any],
    step: int,
    directory: str | os.PathLike | None,
    keep: int | None,
    *,
    durable: bool,
    complete: bool = False,
    leaving: bool = False,
) -> Path | None:
    d = checkpoint_dir(directory)
    keep = keep if keep is not None else int(os.environ.get("PETCTL_CHECKPOINT_KEEP", "3"))
    if is_sharded(state):
        if sharded_memory.save(state, int(step), d, keep, wait=durable):
            return d / f"ckpt-{int(step):010d}.dcp" if durable and dist_rank() == 0 else None
        return save_sharded(state, int(step), d, keep)
    if memory.save(state, int(step), d, keep, wait=durable, complete=complete, leaving=leaving):
        if durable:
            barrier()
        return d / f"ckpt-{int(step):010d}.pt" if durable and dist_rank() == 0 else None
    out: Path | None = None
    if dist_rank() == 0:
        out = write_file(state, step, d, keep)
    barrier()
    return out


def latest_step(directory: str | os.PathLike | None = None) -> int | None:
    """Step recorded in the ``latest`` pointer (cheap: no checkpoint is read), or None."""
    p = read_pointer(checkpoint_dir(directory))
    return int(p["step"]) if p and "step" in p else None


def load_latest(
    directory: str | os.PathLike | None = None,
    map_location: Any = None,
    into: dict[str, Any] | None = None,
    unsafe_load: bool | None = None,
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
        unsafe_load: allow a full unpickle (``torch.load(weights_only=False)``) of a checkpoint
            that a safe load refuses; default ``$PETCTL_CHECKPOINT_UNSAFE_LOAD=1``. Only for
            checkpoints from people you trust: unpickling runs code the file names.

    Raises:
        NeedsStateError: (a ``TypeError``) the newest checkpoint is sharded and ``into`` is None.
        UnsafeCheckpointError: (a ``ValueError``) a checkpoint holds a type outside torch's
            ``weights_only`` allow-list and unsafe loading is off; older ones are not tried.
    """
    d = checkpoint_dir(directory)
    if map_location is None:
        from petctl_agent.distributed import rank_device

        map_location = rank_device()
    pointer = read_pointer(d)
    candidates: list[tuple[Path, str | None]] = []
    if pointer and pointer.get("file"):
        candidates.append((d / pointer["file"], pointer.get("sha256")))
    for s, path in list_checkpoints(d):
        if any(path == c for c, _ in candidates):
            continue
        if pointer and "step" in pointer and s > int(pointer["step"]):
            continue  # written after the pointer we trust: never made it to 'latest'
        candidates.append((path, None))
    for i, (path, sha) in enumerate(candidates):
        try:
            if path.name.endswith(".dcp"):
                return load_sharded(path, into, unsafe_load)
            return load_file(path, sha, map_location, unsafe_load)
        except (NeedsStateError, UnsafeCheckpointError):
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable newest falls back
            what = "newest " if i == 0 else ""
            print(f"petctl checkpoint: {what}{path.name} unreadable ({e}); trying older", file=sys.stderr)
    return None


def resume(
    state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    directory: str | os.PathLike | None = None,
    unsafe_load: bool | None = None,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest checkpoint onto this rank's device: ``(state, step)``, or None.

    Call it on every rank. ``state`` (a dict or a function returning one) is only
    needed for sharded checkpoints: the DTensors in it are filled in place. Loads are
    ``weights_only`` (see :func:`load_latest` for ``unsafe_load``).
    """
    into = state() if callable(state) else state
    if into is not None and is_sharded(into):
        got = sharded_memory.resume(into, checkpoint_dir(directory), unsafe_load)
        if got is not None:
            return got
        t0 = time.monotonic()
        out = load_latest(directory, into=into, unsafe_load=unsafe_load)
        if out is not None:  # every shard from EFS: the agent's event says so (and the step gone back to)
            pointer = read_pointer(checkpoint_dir(directory)) or {}
            ws = pointer.get("world_size")
            sharded_memory.report_efs_restore(out[1], int(ws) if ws else None, time.monotonic() - t0)
        return out
    if memory.snapshot_dir() is None:
        return load_latest(directory, into=into, unsafe_load=unsafe_load)
    from petctl_agent.distributed import rank_device

    got = memory.resume(checkpoint_dir(directory), rank_device())
    if got is not None:
        return got
    t0 = time.monotonic()
    out = load_latest(directory, into=into, unsafe_load=unsafe_load)
    if out is not None:  # (a first start restores nothing: no report)
        pointer = read_pointer(checkpoint_dir(directory)) or {}
        memory.report_restore("efs", out[1], int(pointer.get("size", 0)), time.monotonic() - t0)
    return out


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
        # with memory snapshots on, training goes on while EFS is written, except at the last step
        # and when no node that stays (with its agent's persister) holds the step; a join's stop,
        # or a leave that a survivor's memory covers, only waits for the snapshots to be complete
        stopping = drain_requested()
        leaving = drain_leaving() and not last
        _save(state_fn(), step, directory, None, durable=last or leaving, complete=stopping, leaving=leaving)
        saved = True
    if drain_requested() and not last:
        exit_for_drain()
    return saved
