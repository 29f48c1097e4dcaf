"""A run's first memory snapshot finds its file made: after the first step of a start that restored
nothing from memory, the node's snapshot store makes its slot files in the background (``ckpt.step``).

The store allocates a slot's file (``posix_fallocate`` on tmpfs) and fills its page tables the
first time it writes into it; later writes find their slot ready, and a restore leaves the files
its next writes need to be made after its first step (``memory._spares_after_first_step``). A start
that restored nothing from memory (a first start, or a restart from EFS) had neither, so its first snapshot paid for the files: with periodic
checkpoints, at the first one (training blocks); with snapshots only at membership changes
(``every=0``), inside the first drain's or join's stop, while every rank waits. Measured at 1 GiB
per rank, 3 nodes, 2 cores, snapshots only at changes: the drain's stop (last step -> the round)
took 2.8-2.9 s, and 1.1-1.7 s with the files made (docs/benchmarks.md, "Through the local cloud").

Sizing the files needs the state: ``state_fn`` is called once more, on every rank, and converted as
a save converts it (``userstate.for_save``: its collectives, and any in ``state_fn``, stay matched,
since whether the start restored from memory is agreed by ``ckpt.resume`` and whether the step saved
is agreed by ``should_checkpoint``). The files cost the state's bytes in the tmpfs from then on,
as they would from the first snapshot; each is checked against the node's memory like a write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_pending = False


def none_from_memory() -> None:
    """``ckpt.resume`` restored nothing from the nodes' memory (every rank, agreed: a first start, or
    a restart from EFS): the first step makes the store's files."""
    global _pending
    from petctl_agent.checkpointing import memory

    _pending = memory.snapshot_dir() is not None


def forget() -> None:
    """A save made the first snapshot itself (its store then makes the other slot's file)."""
    global _pending
    _pending = False


def after_step(state_fn: Callable[[], dict[str, Any]]) -> None:
    """After the first step of a start that restored nothing from memory: the store's files, made in
    the background (none when the store already holds a snapshot)."""
    global _pending
    if not _pending:
        return
    _pending = False
    from petctl_agent.checkpointing import memory, userstate

    state, sharded = userstate.for_save(state_fn())
    sdir = memory.snapshot_dir()
    if sharded or sdir is None or memory._local_rank() != 0:
        return  # the node's store is local rank 0's (memory.save); sharded state has its own
    size = snapshot_size(state)
    store = memory._store(sdir)
    if size > 0 and store.newest() is None:
        store.prepare_spares(size)


def snapshot_size(state: dict[str, Any]) -> int:
    """The bytes ``SnapshotStore.write`` lays ``state`` out in (0: a state it cannot write)."""
    from petctl_agent.checkpointing.snapshot import ALIGN, Unsupported, encode_structure

    tensors: list[Any] = []
    try:
        encode_structure(state, tensors)
    except Unsupported:
        return 0
    return sum((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in tensors)
