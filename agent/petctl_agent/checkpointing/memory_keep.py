"""What follows a restore from memory (:mod:`.memory`): a peer's copy kept in this node's own store
(:func:`keep_copy`), a restored step newer than ``latest`` made durable on EFS (:func:`kick_durable`),
and, when every rank falls back to EFS although a rank's node holds a newer step, that step
persisted first (:func:`persist_before_efs`), bounded below the other ranks' wait for it.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import persist
from petctl_agent.checkpointing.memory_save import half_timeout, wait_persisted
from petctl_agent.checkpointing.memory_store import (
    FALLBACK_REPORT,
    PeerRestoreError,
    holds,
    persister_for,
    report,
)
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.checkpointing.writing import OK


def efs_wait_timeout() -> float:
    """The others' bound on :func:`persist_before_efs`'s holder: 2T + 60 s (T:
    ``PETCTL_CHECKPOINT_TIMEOUT``). The holder waits at most T/2 for its agent's persister, then
    writes the step itself (one write, as a checkpoint's own fallback does) and waits at most 5 s
    more: its worst case, T/2 + a write + 5 s, stays under it for any write shorter than 1.5T."""
    return 2 * knobs.checkpoint_timeout() + 60


def persist_before_efs(store: SnapshotStore, key: tuple[int, int], directory: Path, holder: int) -> None:
    """Every rank is about to load EFS although rank ``holder`` holds ``key`` (epoch, step), newer than
    ``latest`` (a drain whose rank 0 left did not wait for EFS: a staying node's memory was the
    copy). The holder persists it first -- its agent's persister, else in this process, as a
    checkpoint's wait does (bounded: :func:`efs_wait_timeout`) -- and every rank waits for it, so
    the fallback loads that step, not an older one (docs/agent.md, "Memory snapshots"). A holder
    whose store lacks a complete copy of the step (its persister would ignore the request) says so
    at once: every rank loads EFS as it is."""
    import torch.distributed as dist

    epoch, step = key
    keep = knobs.checkpoint_keep()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=efs_wait_timeout()))
    try:
        if dist.get_rank() == holder:
            newest = store.newest()
            done = False
            if not holds(store, key) or newest is None or newest.key != key:
                why = "this node's memory no longer holds it complete"
            else:
                why = "could not be persisted"
                try:
                    if persist.served(store.dir):
                        persist.request(store.dir, step, directory, keep, epoch)
                    done = wait_persisted(store, step, directory, keep, timeout=half_timeout(), epoch=epoch)
                except Exception as e:  # noqa: BLE001 - EFS trouble: the ranks load the older step
                    print(f"petctl checkpoint: {type(e).__name__}: {e}", file=sys.stderr)
            print(
                f"petctl checkpoint: the restore from memory failed; step {step} "
                + ("persisted from this node's memory first" if done else why)
                + ": every rank loads EFS",
                file=sys.stderr,
                flush=True,
            )
        dist.barrier(group=group)
    except Exception as e:  # noqa: BLE001 - the holder died meanwhile: as a peer dying mid-transfer
        raise PeerRestoreError(
            f"waiting for step {step} to reach EFS failed ({type(e).__name__}: {e}); exiting"
        ) from e
    finally:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001
            pass


def keep_copy(
    store: SnapshotStore, state: dict[str, Any], key: tuple[int, int], known: list[dict[str, Any]] | None
) -> tuple[bool, float]:
    """Write a peer's snapshot, received and checked, into this node's own store, so that a later
    restart of this node restores from itself (not a second trip over the network, or EFS when the
    source is gone by then). Blocks only for the copy: the CRCs came with the snapshot, so the
    header goes in place at once. (True when kept, the seconds it took.) Kept under the peer's
    ``key`` (epoch, step): it is that history's snapshot, not one of this generation's."""
    epoch, step = key
    t = time.monotonic()
    try:
        why = store.write(state, step, world_size=1, rank=0, known=known, epoch=epoch)
    except Exception as e:  # noqa: BLE001 - never fatal: the state is restored; only the copy is missing
        why = f"{type(e).__name__}: {e}"
    took = round(time.monotonic() - t, 3)
    if why != OK:
        print(
            f"petctl checkpoint: step {step}, restored from a peer, not kept in this node's memory ({why})",
            file=sys.stderr,
        )
    return why == OK, took


def kick_durable(
    store: SnapshotStore,
    directory: Path,
    key: tuple[int, int],
    efs: tuple[int, int],
    state: dict[str, Any],
    *,
    held: bool,
) -> None:
    """Rank 0 restored a snapshot newer than ``latest`` (by ``(epoch, step)``, ``key`` against
    ``efs``): make sure it reaches EFS, the source of truth for a restart of the whole job -- the
    agent's persister (else ours) when this node's store holds it (``held``: its own snapshot, or a
    peer's it kept), else written now, the old way, under the snapshot's epoch."""
    if key <= efs:
        return
    epoch, step = key
    keep = knobs.checkpoint_keep()
    if not held:  # this node's memory could not keep the step (a newcomer whose store is full)
        why = f"step {step} restored from a peer but not held in this node's memory"
        print(f"petctl checkpoint: {why}; writing it to EFS directly", file=sys.stderr)
        report(store.dir, FALLBACK_REPORT, {"step": int(step), "reason": why})
        from petctl_agent.checkpointing.files import write_file

        write_file(state, step, directory, keep, forward_only=True, epoch=epoch)
        return
    if persist.served(store.dir):
        persist.request(store.dir, step, directory, keep, epoch)
    else:
        persister_for(store, directory, keep).kick()
