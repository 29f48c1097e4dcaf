"""Checkpoints of replicated state through node-local memory snapshots (``$PETCTL_SNAPSHOT_DIR``).

Off unless the agent exports ``PETCTL_SNAPSHOT_DIR`` (``PETCTL_AGENT_SNAPSHOT_DIR`` on the agent;
docs/agent.md, "Memory snapshots"). Then, for plain (not sharded) state:

- save: local rank 0 of every node copies the state into the node's ``replicated`` snapshot
  (``checkpointing/snapshot.py``); the ranks agree (MIN over the checkpoint's gloo group) that
  every node's copy fit; global rank 0 then has the snapshot persisted to the checkpoint directory
  in the background (``checkpointing/persist.py``) and training goes on. At the job's last step
  and on a drain, rank 0 waits for that write first (a node that leaves takes its memory with it;
  a joining node has none). Any node's "no-fit"/"unsupported" makes every rank take today's path
  (:func:`petctl_agent.checkpoint.save`), with a warning.
- resume: every rank offers the step of its node's newest complete snapshot; when all offer the
  same step and ``latest`` on the checkpoint directory is not newer, each rank loads it from
  memory (checked by step and crc32s); otherwise (or if any rank's load fails) every rank loads
  from the checkpoint directory as today.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing.files import read_pointer
from petctl_agent.checkpointing.persist import Persister
from petctl_agent.checkpointing.snapshot import OK, SnapshotStore
from petctl_agent.distributed import dist_on, dist_rank

NAME = "replicated"
_persisters: dict[tuple[str, str], Persister] = {}
_stores: dict[str, SnapshotStore] = {}


def _store(sdir: Path) -> SnapshotStore:
    """One store per directory in this process: its next write waits for the previous one's header."""
    s = _stores.get(str(sdir))
    if s is None:
        s = _stores[str(sdir)] = SnapshotStore(sdir, NAME)
    return s


def snapshot_dir() -> Path | None:
    d = os.environ.get("PETCTL_SNAPSHOT_DIR")
    return Path(d) if d else None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


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


def _persister(store: SnapshotStore, directory: Path, keep: int) -> Persister:
    key = (str(store.dir), str(directory))
    p = _persisters.get(key)
    if p is None:
        p = _persisters[key] = Persister(store, directory, keep)
    p.keep = keep
    return p


def save(state: dict[str, Any], step: int, directory: Path, keep: int, *, wait: bool) -> bool:
    """Snapshot ``state`` on every node; True when it did (persisting), False: use today's path.

    Collective. ``wait``: rank 0 returns only once ``latest`` names ``step`` (last step, drain).
    """
    sdir = snapshot_dir()
    if sdir is None:
        return False
    store = _store(sdir)
    why = ""
    if _local_rank() == 0:
        why = store.write(state, step, world_size=1, rank=0)
    ok = why in ("", OK)
    if not _all_min([int(ok)])[0]:
        if why and why != OK:
            print(
                f"petctl checkpoint: memory snapshot of step {step} skipped ({why}); writing to EFS",
                file=sys.stderr,
            )
        return False
    if dist_rank() == 0:
        per = _persister(store, directory, keep)
        per.kick()
        if wait:
            per.wait()
    elif wait and _local_rank() == 0:
        store.flush()
    return True


def resume(directory: Path, map_location: Any) -> tuple[dict[str, Any], int] | None:
    """This node's snapshot of the step every rank holds, if that is the newest; else None (collective)."""
    sdir = snapshot_dir()
    if sdir is None:
        return None
    store = _store(sdir)
    newest = store.newest()
    mine = newest.step if newest is not None else -1
    lo, neg_hi = _all_min([mine, -mine])
    pointer = read_pointer(directory)
    efs = int(pointer["step"]) if pointer and "step" in pointer else -1
    if lo < 0 or lo != -neg_hi or lo < efs:
        return None
    state = store.load(lo, map_location=map_location)
    if not _all_min([int(state is not None)])[0]:
        return None
    if dist_rank() == 0 and lo > efs:
        _persister(store, directory, int(os.environ.get("PETCTL_CHECKPOINT_KEEP", "3"))).kick()
    return state, lo


def close_persisters() -> None:
    """Stop this process's persister threads and forget its stores (tests; a worker just exits)."""
    while _persisters:
        _, p = _persisters.popitem()
        p.close()
    while _stores:
        _stores.popitem()[1].close()
