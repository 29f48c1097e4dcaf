"""The save of replicated state through node memory (:mod:`.memory`, "save"): every node's local
rank 0 copies the state into its store, the ranks agree that every copy fit, and global rank 0
hands the step to its agent's persister (else its own) -- and, at the last step or a drain that no
staying node covers, waits until ``latest`` names it, bounded by ``PETCTL_CHECKPOINT_TIMEOUT``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import persist, persisting, timeline
from petctl_agent.checkpointing.drain import LEAVE, _local_drain_flag
from petctl_agent.checkpointing.files import read_pointer, write_file
from petctl_agent.checkpointing.memory_store import (
    FALLBACK_REPORT,
    agreed_snapshot_dir,
    local_rank,
    persister_for,
    report,
    seen,
    store_of,
)
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.checkpointing.writing import OK
from petctl_agent.distributed import dist_on, dist_rank


def _all_min(values: list[int]) -> list[int]:
    """Element-wise MIN over every rank (the checkpoint's gloo group), or ``values`` alone."""
    if not dist_on():
        return values
    import torch
    import torch.distributed as dist

    from petctl_agent.checkpointing.group import ckpt_group

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ckpt_group())
    return [int(v) for v in t]


def wait_persisted(
    store: SnapshotStore,
    step: int,
    directory: Path,
    keep: int,
    timeout: float | None = None,
    epoch: int = 0,
) -> bool:
    """True once ``latest`` names ``step`` of ``epoch`` (or newer, by ``(epoch, step)``: the
    agent's persister's, else our own write.

    False when neither got it there within ``timeout`` (default ``PETCTL_CHECKPOINT_TIMEOUT``;
    the caller then writes the state it holds the old way: a wait for EFS is never unbounded).
    """
    sdir = store.dir
    want = (int(epoch), int(step))
    deadline = time.monotonic() + (knobs.checkpoint_timeout() if timeout is None else timeout)
    while time.monotonic() < deadline:
        if timeline.key(read_pointer(directory)) >= want:
            return True
        st = persist.state(sdir)
        if not persist.served(sdir) or (st.get("error_step") == step and st.get("dir") == str(directory)):
            break  # nobody serves the store, or its write failed: ours raises what it fails with
        time.sleep(0.02)
    per = persister_for(store, directory, keep)
    with per._lock:
        persisting.persist_newest(store, directory, keep)
    if timeline.key(read_pointer(directory)) < want:
        return per.wait(timeout=max(5.0, deadline - time.monotonic()))
    return True


def half_timeout() -> float:
    """How long rank 0 waits for the persist before it writes the step itself: half of
    ``PETCTL_CHECKPOINT_TIMEOUT``, the other ranks' barrier's timeout, so that its own write still
    ends before they give up on it."""
    return knobs.checkpoint_timeout() / 2


def not_persisted(sdir: Path, state: dict[str, Any], step: int, directory: Path, keep: int) -> bool:
    """Rank 0 only: the snapshot never reached EFS in time: the state is written the old way here,
    and True, as on the other ranks (which are on their way to the caller's barrier: the caller's
    old path would take rank 0 to collectives of its own)."""
    why = f"step {step} not persisted from memory within {half_timeout():g} s"
    print(f"petctl checkpoint: {why}; writing it to EFS directly", file=sys.stderr)
    report(sdir, FALLBACK_REPORT, {"step": int(step), "reason": why})
    write_file(state, step, directory, keep)
    return True


def save(
    state: dict[str, Any],
    step: int,
    directory: Path,
    keep: int,
    *,
    wait: bool,
    complete: bool = False,
    leaving: bool = False,
) -> bool:
    """Snapshot ``state`` on every node; True when it did (persisting), False: use today's path.

    Collective, and the same answer on every rank (when ``wait`` and the step did not reach EFS in
    time, rank 0 writes it the old way itself: :func:`not_persisted`). ``wait``: rank 0 returns only
    once ``latest`` names ``step`` (last step, a node leaving). ``complete``: every node's snapshot is complete (header written) on return (the
    workers stop for a join: their memory stays, but a worker that exits kills the crc thread).
    ``leaving``: the wait is only for a drain where some node leaves (not the last step): the ranks
    then skip it when a node that stays holds the step and has its agent's persister serving its
    store (a survivor is a copy; the persist goes on in the background: rank 0's persister serves
    the request even when its node leaves, and the restarted round's rank 0, on a node that stayed,
    hands a restored step newer than ``latest`` to its own -- :func:`.memory_keep.kick_durable`). Every node leaving,
    or no node that stays having a persister, still waits for EFS.
    """
    sdir = agreed_snapshot_dir()  # collective: every rank takes the memory path, or none
    if sdir is None:
        return False
    store = store_of(sdir)
    # which history this step is of (timeline.py): agreed at the restore, else here, once
    epoch = timeline.ensure(lambda: seen(store, read_pointer(directory)))
    why = ""
    if local_rank() == 0:
        # a stop or the last step waits for the header anyway: its CRCs then on several cores
        try:
            why = store.write(state, step, world_size=1, rank=0, wait=wait or complete, epoch=epoch)
        except Exception as e:  # noqa: BLE001 - EIO, ENOMEM, the previous write's failed header
            # through the vote below like a no-fit: every rank takes the EFS path (raised here, this
            # rank alone would leave the MIN and the others would wait in it for the timeout)
            why = f"failed: {type(e).__name__}: {e}"
    ok = why in ("", OK)
    flags = [int(ok)]
    if wait and leaving:
        # this node's memory outlives the drain and its agent's persister serves it: it holds the
        # step and can put it on EFS (MIN: -1 when some node can; rank 0's node need not be it)
        covers = _local_drain_flag() < LEAVE and persist.served(sdir)
        flags.append(-int(covers))
    agreed = _all_min(flags)
    if wait and leaving and agreed[1] < 0:
        wait, complete = False, True  # a survivor holds the step; a persister writes it (below)
    if not agreed[0]:
        if why and why != OK:
            print(
                f"petctl checkpoint: memory snapshot of step {step} skipped ({why}); writing to EFS",
                file=sys.stderr,
            )
            report(sdir, FALLBACK_REPORT, {"step": int(step), "reason": why})
        return False
    if dist_rank() == 0:
        if persist.served(sdir):
            # the header follows: the persister waits for it
            persist.request(sdir, step, directory, keep, epoch)
            if wait:
                store.flush()
                if not wait_persisted(store, step, directory, keep, timeout=half_timeout(), epoch=epoch):
                    return not_persisted(sdir, state, step, directory, keep)
        else:
            per = persister_for(store, directory, keep)
            per.kick()
            if wait and not per.wait(timeout=half_timeout()):
                return not_persisted(sdir, state, step, directory, keep)
    elif (wait or complete) and local_rank() == 0:
        store.flush()
    if complete and dist_rank() == 0:
        store.flush()
    return True
