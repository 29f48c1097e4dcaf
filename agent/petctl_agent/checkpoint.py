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

from petctl_agent import DRAIN_EXIT_CODE, knobs
from petctl_agent.checkpointing import memory, sharded_memory, userstate
from petctl_agent.checkpointing.drain import (
    drain_leaving,
    drain_requested,
    exit_for_drain,
    report_progress,
    should_checkpoint,
)
from petctl_agent.checkpointing.files import (
    CKPT_RE,
    UnsafeCheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_file,
    read_pointer,
    write_file,
)
from petctl_agent.checkpointing.group import barrier, ckpt_group
from petctl_agent.checkpointing.sharded import (
    MissingStateError,
    NeedsStateError,
    is_sharded,
    load_sharded,
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
    *,
    agree: bool = False,
) -> tuple[dict[str, Any], int] | None:
    """Load the newest readable checkpoint: ``(state, step)``, or None when there is none.

    The file named by ``latest`` is verified against its sha256; if it is missing
    or unreadable, older checkpoints are tried newest first.

    ``agree=True`` (what :func:`resume` does; collective then: every rank calls it): under a
    process group of more than one rank, every rank loads the *same* step (:func:`_load_agreed`),
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
    return userstate.own(_load_latest(directory, map_location, into, unsafe_load, agree=agree), unsafe_load)


def _load_latest(
    directory: str | os.PathLike | None,
    map_location: Any,
    into: dict[str, Any] | None,
    unsafe_load: bool | None,
    *,
    agree: bool,
) -> tuple[dict[str, Any], int] | None:
    """:func:`load_latest` with the saved per-rank entry as saved (every rank's)."""
    d = checkpoint_dir(directory)
    if map_location is None:
        from petctl_agent.distributed import rank_device

        map_location = rank_device()
    if agree and dist_world() > 1:
        return _load_agreed(d, map_location, into, unsafe_load)
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


#: rounds of :func:`_load_agreed`: a round whose steps no rank set could all read starts again
#: (once more, twice at most) in case `latest` moved on while its older steps were pruned
_AGREE_ROUNDS = 3


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, over the checkpoint's gloo group (CPU, whatever the
    default group's backend: no CUDA tensor needed under NCCL; bounded by its timeout,
    ``PETCTL_CHECKPOINT_TIMEOUT``). A dead peer raises here on every rank: never a hang."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=ckpt_group())
    return out


def _gather_checked(what: str, fn: Callable[[], Any]) -> list[Any]:
    """:func:`_gather` of ``fn()``: every rank's value, or the same error raised on every rank.

    A rank whose ``fn`` raises (EFS: ``ESTALE``, ``EIO``, ``EACCES`` listing the directory) must
    not raise before the gather: its peers would wait in it until ``PETCTL_CHECKPOINT_TIMEOUT``
    (1800 s) if the script catches the error and goes on. It sends the error instead, and when any
    rank sent one every rank raises the first: an ``OSError`` (that errno) naming the rank, or a
    ``RuntimeError``.
    """
    try:
        mine: tuple[Any, ...] = (None, None, fn())
    except Exception as e:  # noqa: BLE001 - every error reaches every rank, not just this one
        errno = e.errno if isinstance(e, OSError) else None
        mine = (errno, f"rank {dist_rank()} could not {what} ({type(e).__name__}: {e})", None)
    got = _gather(mine)
    for errno, msg, _ in got:
        if msg is not None:
            line = f"petctl checkpoint: {msg}; resume raises this on every rank"
            raise OSError(errno, line) if errno is not None else RuntimeError(line)
    return [v for _, _, v in got]


def _load_agreed(
    d: Path, map_location: Any, into: dict[str, Any] | None, unsafe_load: bool | None
) -> tuple[dict[str, Any], int] | None:
    """:func:`load_latest` with every rank loading the same step (collective).

    Each rank reading ``latest`` and falling back on its own can land on different steps: the
    agent's persister moves ``latest`` at any time, and one rank's unreadable copy sends that rank
    alone to an older step -- the replicas then silently diverge. So the ranks exchange what they
    see (pointer, listing); the newest pointer's step bounds the candidates (``latest`` only moves
    forward: every step up to it was durable and in ``latest`` once), and they try the candidates
    newest first *together*: each rank loads the step (the sha256 any rank's pointer gave for its
    file; else the file's own checks), they exchange the outcome, and any rank's failure sends every
    rank to the next older step. An unsafe load or a sharded step without ``into`` on any rank
    raises on every rank. When every candidate failed, one more round in case ``latest`` moved on
    meanwhile (the older files pruned behind it); else None on every rank.
    """
    rank = dist_rank()
    tried: set[int] = set()
    prev_bound: int | None = None
    for _ in range(_AGREE_ROUNDS):
        seen = _gather_checked(
            f"list {d}", lambda: (read_pointer(d), [(s, p.name) for s, p in list_checkpoints(d)])
        )
        pointers = [p for p, _ in seen if isinstance(p, dict) and "step" in p]
        bound = max((int(p["step"]) for p in pointers), default=None)
        if prev_bound is not None and (bound is None or bound <= prev_bound):
            return None  # nothing newer appeared: the retry would try nothing new
        names: dict[int, str] = {}
        for _, listing in seen:
            for s, name in listing:
                names.setdefault(int(s), name)
        for p in pointers:
            if p.get("file") and CKPT_RE.match(str(p["file"])):
                names.setdefault(int(p["step"]), str(p["file"]))
        shas = {str(p["file"]): p["sha256"] for p in reversed(pointers) if p.get("file") and p.get("sha256")}
        candidates = sorted(
            (s for s in names if s not in tried and (bound is None or s <= bound)), reverse=True
        )
        if not candidates:
            return None
        for s in candidates:
            tried.add(s)
            path = d / names[s]
            out, code, msg = None, 1, ""
            if path.name.endswith(".dcp"):
                # DCP's load is collective: every rank enters it or none does
                ready = _gather_checked(f"stat {path}", lambda p=path: (p.is_dir(), into is None))
                if any(needs for _, needs in ready):
                    load_sharded(path, None, unsafe_load)  # raises NeedsStateError, before any collective
                if not all(there for there, _ in ready):
                    if rank == 0:
                        missing = [r for r, (there, _) in enumerate(ready) if not there]
                        print(
                            f"petctl checkpoint: {path.name} missing on rank(s) {missing}; every rank tries older",
                            file=sys.stderr,
                        )
                    continue
            try:
                if path.name.endswith(".dcp"):
                    out = load_sharded(path, into, unsafe_load)
                else:
                    out = load_file(path, shas.get(path.name), map_location, unsafe_load)
                code = 0
            except UnsafeCheckpointError as e:
                code, msg = 2, str(e)
            except MissingStateError as e:
                code, msg = 3, str(e)
            except Exception as e:  # noqa: BLE001 - any unreadable copy sends every rank to an older one
                msg = f"{type(e).__name__}: {e}"
                print(f"petctl checkpoint: rank {rank}: {path.name} unreadable ({msg})", file=sys.stderr)
            outcomes = _gather((code, msg))
            for c, m in outcomes:  # a refusal, or state missing, on any rank: the same line everywhere
                if c == 2:
                    raise UnsafeCheckpointError(m)
                if c == 3:
                    raise MissingStateError(m)
            bad = [r for r, (c, _) in enumerate(outcomes) if c]
            if not bad:
                return out
            if rank == 0:
                print(
                    f"petctl checkpoint: {path.name} unreadable on rank(s) {bad}; every rank tries older",
                    file=sys.stderr,
                )
        prev_bound = bound if bound is not None else -1
    return None


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
        out = _load_latest(directory, None, fill, unsafe_load, agree=True)
        if out is not None:  # every shard from EFS: the agent's event says so (and the step gone back to)
            pointer = read_pointer(checkpoint_dir(directory)) or {}
            ws = pointer.get("world_size")
            sharded_memory.report_efs_restore(out[1], int(ws) if ws else None, time.monotonic() - t0)
        return finish(out)
    if memory.snapshot_dir() is None:
        return finish(_load_latest(directory, None, fill, unsafe_load, agree=True))
    from petctl_agent.distributed import rank_device

    got = memory.resume(checkpoint_dir(directory), rank_device())
    if got is not None:
        return finish(got)
    t0 = time.monotonic()
    out = _load_latest(directory, None, fill, unsafe_load, agree=True)
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
    # a restore's spares: after its first step and any save it made (not beside them), and never
    # on a node that drains (it just left)
    memory.start_due_spares()
    return saved
