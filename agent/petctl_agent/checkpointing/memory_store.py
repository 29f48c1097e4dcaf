"""This worker's hold on its node's memory snapshots of replicated state (:mod:`.memory`): the
store of ``$PETCTL_SNAPSHOT_DIR`` (one per directory in this process) and its in-process
persisters, the reports to the agent (``restore.json``, ``fallback.json``), what the node holds
(by ``(epoch, step)``: :mod:`.timeline`), and the spares a restore leaves for after the first step.
Shared by the save (:mod:`.memory_save`), the restore (:mod:`.memory_restore`) and what follows a
restore (:mod:`.memory_keep`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import collectives, timeline
from petctl_agent.checkpointing.atomic import atomic_write
from petctl_agent.checkpointing.persisting import Persister
from petctl_agent.checkpointing.snapshot import SnapshotStore, node_name
from petctl_agent.distributed import dist_on

NAME = "replicated"
#: reports to the agent, in the store's directory (node/snapshots.py reads the same names)
RESTORE_REPORT = "restore.json"
FALLBACK_REPORT = "fallback.json"
persisters: dict[tuple[str, str], Persister] = {}
stores: dict[str, SnapshotStore] = {}
# (store, size): the spares a restore left for after the first step (start_due_spares)
due_spares: list[tuple[SnapshotStore, int]] = []


class PeerRestoreError(RuntimeError):
    """A restore from a peer's memory failed mid-transfer: the worker exits, the next round retries."""


def store_of(sdir: Path) -> SnapshotStore:
    """One store per directory in this process: its next write waits for the previous one's header."""
    s = stores.get(str(sdir))
    if s is None:
        s = stores[str(sdir)] = SnapshotStore(sdir, NAME)
    return s


def snapshot_dir() -> Path | None:
    """This node's store (``$PETCTL_SNAPSHOT_DIR``), whatever the other nodes have."""
    d = knobs.snapshot_dir()
    return Path(d) if d else None


_agreed_for: tuple[Any, bool] | None = None  # (default group it was agreed in, every rank has a store)


def agreed_snapshot_dir() -> Path | None:
    """This node's store when every rank's node has one, else None: the same answer on every rank.

    The memory paths' collectives run only where every rank takes them: a node whose agent could not
    make its store (``snapshot_off``: no tmpfs, ``/dev/shm`` unwritable) would otherwise skip them
    while the others gather, and gloo aborts on the mismatch (``op.preamble.length <= op.nbytes``)
    or pairs two unrelated collectives. Collective under a process group: one MIN over the
    checkpoint group, once per default group; call it where every rank does (a save, a restore).
    """
    global _agreed_for
    d = snapshot_dir()
    if not dist_on():
        return d
    import torch.distributed as dist

    world = dist.group.WORLD
    if _agreed_for is None or _agreed_for[0] is not world:
        every = collectives.all_ok(d is not None)
        if d is not None and not every and local_rank() == 0:
            print(
                "petctl checkpoint: a node of this job has no memory snapshot store "
                "(its agent's snapshot_off event says why): every node checkpoints to EFS",
                file=sys.stderr,
                flush=True,
            )
        _agreed_for = (world, every)
    return d if _agreed_for[1] else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def report(sdir: Path, name: str, body: dict[str, Any]) -> None:
    """A report for the agent (local rank 0 only); never fatal."""
    if local_rank() != 0:
        return
    try:
        sdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(sdir / name, json.dumps({**body, "t": time.time()}).encode())
    except OSError:
        pass


def report_restore(source: str, step: int | None, nbytes: int, seconds: float, **extra: Any) -> None:
    """Record which source this node's restore used (``self``/``peer``/``efs``) for the agent.

    ``extra``: more fields for the event (JSON-able): ``kept_seconds`` (a peer's copy written into
    this node's store), the sharded path's ``shards``/``newest``/``back_to``.
    """
    sdir = snapshot_dir()
    if sdir is not None:
        body = {"source": source, "step": step, "bytes": int(nbytes), "seconds": round(seconds, 3), **extra}
        report(sdir, RESTORE_REPORT, body)


def persister_for(store: SnapshotStore, directory: Path, keep: int) -> Persister:
    key = (str(store.dir), str(directory))
    p = persisters.get(key)
    if p is None:
        p = persisters[key] = Persister(store, directory, keep)
    p.keep = keep
    return p


def seen(store: SnapshotStore, pointer: dict[str, Any] | None) -> int:
    """The largest epoch among this node's complete snapshots and ``latest`` (timeline.py)."""
    return max([c.epoch for c in store.complete()] + [timeline.epoch_of(pointer)])


def spares_after_first_step(store: SnapshotStore, size: int) -> None:
    """The spares (``SnapshotStore.prepare_spares``) a restore leaves due, started by
    :func:`start_due_spares` once the first step after it is done (``ckpt.step``), not beside it.

    After a membership change every node restores at once, and each then allocates (and zeroes)
    one or two new files of the state's size: a lent slot's replacement, a newcomer's second slot.
    Started beside the first step, that kernel work competes with it and stalls every rank's
    first collective (the job's slowest rank sets the pace). The next write needs them only at the
    next checkpoint, steps later; one that comes first allocates its own file, as without a spare.
    """
    if size > 0:
        due_spares.append((store, size))


#: set while a start that restored nothing from memory has not made its first snapshot's file
#: (first_snapshot.py)
first_file_due = False


def start_due_spares() -> None:
    """Start the spares a restore left due (:func:`spares_after_first_step`); cheap when none are."""
    while due_spares:
        store, size = due_spares.pop()
        store.prepare_spares(size)


def snapshot_size(store: SnapshotStore, key: tuple[int, int]) -> int:
    c = next((c for c in store.complete() if c.key == key), None)
    return int(c.header["size"]) if c is not None else 0


def held_header(store: SnapshotStore, key: tuple[int, int]) -> dict[str, Any] | None:
    """The header of this node's complete snapshot of ``key`` (epoch, step) (header intact, data
    file of its size), or None. Cheap: its bytes are checked by whoever loads or sends them."""
    for c in store.complete():
        if c.key == key:
            try:
                if os.stat(store.data_path(c.slot)).st_size == int(c.header["size"]):
                    return c.header
            except OSError:
                pass
    return None


def node_key(sdir: Path) -> int:
    """A 56-bit key of this rank's node: the host and its store (the ranks of one node share it).
    (A collision would only make a rank wait for another node's receiver, then get the step in
    the retry: its own store lacks it.)"""
    return int.from_bytes(hashlib.blake2b(node_name(sdir).encode(), digest_size=7).digest(), "big")


def holds(store: SnapshotStore, key: tuple[int, int]) -> bool:
    return held_header(store, key) is not None


def close_persisters() -> None:
    """Stop this process's persister threads and forget its stores (tests; a worker just exits)."""
    global first_file_due
    due_spares.clear()
    first_file_due = False
    timeline.reset()
    while persisters:
        _, p = persisters.popitem()
        p.close()
    while stores:
        stores.popitem()[1].close()
