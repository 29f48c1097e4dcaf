"""A run's first memory snapshot finds its file made: after the first step of a start that restored
nothing from memory, the node's store makes the file its first write takes, in the background.

The store allocates a slot's file (``posix_fallocate`` on tmpfs, 0.5-1.3 s/GiB here) and fills its
page tables the first time it writes into it; later writes find their slot ready, and a restore
leaves the files its next writes need to be made after its first step
(``memory_store.spares_after_first_step``). A start that restored nothing from memory (a first
start, or a restart from EFS) had neither, so its first snapshot paid for the file: with periodic
checkpoints at the first one (training blocks), and with snapshots only at membership changes
(``every=0``) inside the first drain's or join's stop, while every rank waits (docs/benchmarks.md,
"Through the local cloud").

Sizing the file needs the state: ``state_fn`` is called once more after that first step, on every
rank, and converted as a save converts it (``userstate.for_save``, whose collectives then match on
every rank: whether the start restored from memory is agreed in ``ckpt.resume``, whether the step
saved in ``should_checkpoint``). Only the next write's file is made (the second slot's comes after
that write, as before); it is checked against the node's memory like a write, and costs the
state's bytes in the tmpfs from then on, as the first snapshot would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from petctl_agent.checkpointing import memory_store


def arm() -> None:
    """``ckpt.resume`` restored nothing from the nodes' memory (every rank, agreed): the first step
    makes the store's first file."""
    memory_store.first_file_due = True


def disarm() -> None:
    """A save made the first snapshot itself."""
    memory_store.first_file_due = False


def after_step(state_fn: Callable[[], dict[str, Any]]) -> None:
    """After the first step of a start that restored nothing from memory: make the file the first
    write takes, in the background (collective: every rank calls ``state_fn``)."""
    if not memory_store.first_file_due:
        return
    disarm()
    from petctl_agent.checkpointing import userstate
    from petctl_agent.checkpointing.header import Unsupported, encode_structure
    from petctl_agent.checkpointing.writing import layout

    state, sharded = userstate.for_save(state_fn())
    sdir = memory_store.snapshot_dir()
    if sharded or sdir is None or memory_store.local_rank() != 0:
        return  # the node's store is local rank 0's (memory_save.save); sharded state has its own
    tensors: list[Any] = []
    try:
        encode_structure(state, tensors)
    except Unsupported:
        return  # the write will say so, and take the EFS path
    size = layout(tensors)[1]
    if size > 0:
        memory_store.store_of(sdir).prepare_spares(size, first_only=True)
