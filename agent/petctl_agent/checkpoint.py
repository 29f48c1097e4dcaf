"""Checkpoint helper for training scripts run by petctl (or plain ``torchrun``).

Atomic checkpoints on the shared filesystem plus the worker side of the drain
protocol. One call per step::

    from petctl_agent import checkpoint as ckpt

    restored = ckpt.resume({"model": model, "optim": opt})  # loads into both; (state, step) or None
    start = 1 if restored is None else restored[1] + 1
    for step in range(start, total + 1):
        train_one_step()
        ckpt.step(step, lambda: {"model": model, "optim": opt, "per_rank": {"rng": torch.get_rng_state()}},
                  every=50, last=step == total)    # collective: call on every rank

What comes back: the model and optimizer are loaded in place; ``state["per_rank"]`` is this rank's
own entry; everything else is shared, rank 0's (:mod:`petctl_agent.checkpointing.userstate`).

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

:func:`resume` loads the directory at one step on every rank (``load_latest(..., agree=True)``):
the ranks exchange their ``latest`` and listing and fall back together, never each alone.

A writer killed at any point leaves the previous ``latest`` intact. Saves end in a
barrier on a dedicated gloo group whose timeout (``PETCTL_CHECKPOINT_TIMEOUT``,
default 1800 s) is independent of the collective timeout: a long write to EFS must
not trip the 60 s collective timeout or NCCL's watchdog, which aborts any NCCL
collective (barriers included) still pending after the group's timeout.

Made of (``checkpointing/``): the directory's layout and the single-file format (``files.py``),
its loads, alone or agreed by every rank (``loading.py``), the sharded path (``sharded.py``), the checkpoint group (``group.py``), the drain agreement
(``drain.py``), memory snapshots of replicated state when the agent turned them on (``memory.py``:
``$PETCTL_SNAPSHOT_DIR``; docs/agent.md), and of sharded state with a replica on a peer node (``sharded_memory.py``). This module stays import-light: no torch until a checkpoint is written or read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE, knobs
from petctl_agent.checkpointing import collectives, first_snapshot, memory, sharded_memory, userstate
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
    read_pointer,
    write_file,
)
from petctl_agent.checkpointing.group import barrier
from petctl_agent.checkpointing.loading import load_newest
from petctl_agent.checkpointing.sharded import (
    MissingStateError,
    NeedsStateError,
    is_sharded,
    save_sharded,
)
from petctl_agent.checkpointing.userstate import PER_RANK, PerRankStateError
from petctl_agent.distributed import dist_rank, dist_world

__all__ = [
    "DRAIN_EXIT_CODE",
    "PER_RANK",
    "MissingStateError",
    "NeedsStateError",
    "PerRankStateError",
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
    keep = keep if keep is not None else knobs.checkpoint_keep()
    state, sharded = userstate.for_save(state)
    if sharded:
        if sharded_memory.save(state, int(step), d, keep, wait=durable):
            return d / f"ckpt-{int(step):010d}.dcp" if durable and dist_rank() == 0 else None
        return save_sharded(state, int(step), d, keep)
    if memory.save(state, int(step), d, keep, wait=durable, complete=complete, leaving=leaving):
        if durable:
            barrier()
        return d / f"ckpt-{int(step):010d}.pt" if durable and dist_rank() == 0 else None
    out: Path | None = None
    failed, err = "", None
    if dist_rank() == 0:
        try:
            out = write_file(state, step, d, keep)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            failed, err = f"{type(e).__name__}: {e}", e
    # every rank learns whether rank 0's write failed and raises with it: rank 0 raising alone left
    # the others in the barrier (a script that catches the error: until the checkpoint timeout)
    said = collectives.first_said(failed)
    if said:
        if err is not None:
            raise err
        raise OSError(f"checkpoint of step {step} not written to {d}: rank 0 failed ({said})")
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
    *,
    agree: bool = False,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest readable checkpoint: ``(state, step)``, or None when there is none.

    The file named by ``latest`` is verified against its sha256; if it is missing
    or unreadable, older checkpoints are tried newest first.

    ``agree=True`` (what :func:`resume` does; collective then: every rank calls it): under a
    process group of more than one rank, every rank loads the *same* step (:func:`.checkpointing.loading.load_agreed`),
    where each rank's own pointer read and fallback could land on different ones.

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
        agree: every rank loads the same step (above).

    Raises:
        NeedsStateError: (a ``TypeError``) the newest checkpoint is sharded and ``into`` is None
            (with ``agree``: on any rank -- then on every rank).
        UnsafeCheckpointError: (a ``ValueError``) a checkpoint holds a type outside torch's
            ``weights_only`` allow-list and unsafe loading is off; older ones are not tried.
        OSError: (with ``agree``) a rank could not list the checkpoint directory (EFS: ``EIO``,
            ``ESTALE``, ``EACCES``): the same one-line error, naming that rank, on every rank.
    """
    return userstate.own(load_newest(directory, map_location, into, unsafe_load, agree=agree), unsafe_load)


def resume(
    state: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    directory: str | os.PathLike | None = None,
    unsafe_load: bool | None = None,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest checkpoint onto this rank's device: ``(state, step)``, or None.

    Call it on every rank. ``state`` (a dict or a function returning one) names what to restore
    into: a top-level ``torch.nn.Module`` or ``torch.optim.Optimizer`` is loaded in place (for a
    sharded model, e.g. FSDP2, through ``torch.distributed.checkpoint.state_dict``, which gives a
    fresh optimizer its moments before they are filled); for sharded checkpoints a dict of DTensors
    is filled in place. ``state["per_rank"]`` in the result is this rank's own entry
    (:data:`PER_RANK`; None when this rank had none). Loads are ``weights_only`` (see
    :func:`load_latest` for ``unsafe_load``). Under a process group every rank gets the same step:
    a load from the checkpoint directory is agreed (``load_latest(..., agree=True)``), as the
    restore from memory is.

    Raises:
        MissingStateError: (a :class:`NeedsStateError`) the sharded checkpoint holds entries that
            ``state`` lacks (they would be dropped without an error); on every rank.
    """
    fill, finish = userstate.for_load(state() if callable(state) else state, unsafe_load)
    if fill is not None and is_sharded(fill):
        got = sharded_memory.resume(fill, checkpoint_dir(directory), unsafe_load)
        if got is not None:
            return finish(got)
        t0 = time.monotonic()
        out = load_newest(directory, None, fill, unsafe_load, agree=True)
        if out is not None:  # every shard from EFS: the agent's event says so (and the step gone back to)
            pointer = read_pointer(checkpoint_dir(directory)) or {}
            ws = pointer.get("world_size")
            sharded_memory.report_efs_restore(out[1], int(ws) if ws else None, time.monotonic() - t0)
        return finish(out)
    if memory.agreed_snapshot_dir() is None:  # collective: every rank's node has a store, or none
        return finish(load_newest(directory, None, fill, unsafe_load, agree=True))
    from petctl_agent.distributed import rank_device

    got = memory.resume(checkpoint_dir(directory), rank_device())
    if got is not None:
        return finish(got)
    first_snapshot.arm()  # nothing from memory (agreed): the store's first file after the first step
    t0 = time.monotonic()
    out = load_newest(directory, None, fill, unsafe_load, agree=True)
    if out is not None:  # (a first start restores nothing: no report)
        memory.report_restore(
            "efs", out[1], _file_size(checkpoint_dir(directory), out[1]), time.monotonic() - t0
        )
    return finish(out)


def _file_size(d: Path, step: int) -> int:
    """Bytes of the single-file checkpoint of ``step`` (the agreed one: ``latest`` may name another)."""
    try:
        return (d / f"ckpt-{int(step):010d}.pt").stat().st_size
    except OSError:
        return 0


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
        state_fn: returns the state to save; called when saving, and once after the first step
            of a start that restored nothing from the nodes' memory (to size its first
            snapshot's file: every rank calls it then, as at a save).
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
        first_snapshot.disarm()
    if drain_requested() and not last:
        exit_for_drain()
    first_snapshot.after_step(state_fn)  # a start that restored nothing: its first snapshot's file
    # a restore's spares: after its first step and any save it made (not beside them), and never
    # on a node that drains (it just left)
    memory.start_due_spares()
    return saved
