"""Sharded state (DCP / FSDP2) through node-local memory, with a replica of every shard on a peer node.

On when the job opts in (``PETCTL_SHARDED_MEMORY=1``; :data:`OPT_IN`) and the workers have
``$PETCTL_SNAPSHOT_DIR`` (the agent's node-local tmpfs, one per node). The
node's memory holds DCP step directories ``<snapshot dir>/sharded/ckpt-<step:010d>.dcp`` -- the same
format as on EFS, so a restore is DCP's own load, resharding included. Save (collective, agreed step):

1. each node decides once, on its lowest rank, whether the step fits in its memory
   (``budget.reserve``): the bytes of all its ranks' shards plus the replicas it will receive (the
   node's ranks share one MemAvailable, so no rank decides alone), checked against the allocations
   in flight in the machine's ledger and recorded there until the node's writes of the step are
   done (the replicated path's writers, other jobs' nodes on one machine, see them); any node's
   "no" and every rank
   takes the EFS path (``sharded.save_sharded``) with a warning. Older steps are dropped before the
   write (keeping the newest complete one and the one EFS is still copying);
2. ``dcp.save`` into the node's step directory (no fsync: tmpfs) -- each rank writes its own
   ``__<rank>_*.distcp``, rank 0 the ``.metadata``;
3. with two nodes or more: rank 0 broadcasts ``.metadata`` to every node, and rank ``r`` sends its
   files to the next rank after ``r`` (cyclically) on another node, over the checkpoint's gloo group
   -- the ring replica: every shard lives in two nodes' memory;
4. training goes on; a thread per rank then computes the CRC of every file the rank holds and
   writes ``petctl-rank-<r>.json`` last (step, save id, world size, each file's owner, size, CRC):
   the completion marker. It then copies the rank's own files to ``<checkpoint dir>/.ckpt-<step>.dcp.
   <save id>.tmp/`` with fsync and drops a ``.done-<r>`` file there; rank 0's thread waits until all
   ranks' ``.done`` files are there, renames the directory to ``ckpt-<step>.dcp`` and replaces
   ``latest`` -- today's atomic semantics, ``latest`` only once every shard of the step is on EFS.
   A rank whose copy fails drops ``.failed-<r>`` instead: rank 0 gives the step up at once (no
   ``latest`` for it, an error line naming the rank and step at the next save). A periodic save
   never waits for EFS: while any rank still copies the previous step, this step is kept in memory
   only (persisted steps thin out). The job's last step and a drain wait for EFS (as the
   replicated path does).

Resume (collective, :func:`resume`): every rank reports what its node's memory holds (steps, save
ids, files whose CRC matches its marker: a torn or stale file is never offered); every rank then
computes the same plan: the newest step, not older than EFS's ``latest``, whose files the survivors
together hold. Each node then receives, over the gloo group, only the byte ranges of the files it
lacks that its ranks' load at the new layout reads (``ranges.py``: from DCP's ``.metadata`` and each
rank's load plan; after the node's memory said they fit, else every rank uses EFS and says why;
bounded by ``PETCTL_SHARD_FETCH_TIMEOUT``, default 300 s; a closed connection fails at once), each
range checked against its sender's CRC; then DCP loads at the new world size from the node's directory.
When memory does not cover the newest step, the job goes back to EFS's ``latest`` and rank 0
says which step (stderr: ``petctl checkpoint: ... going back to step N``); :data:`last_restore`
holds the same for the caller. Any rank's failure makes every rank use EFS; a peer lost mid-transfer
fails the worker within the timeout (the agent restarts the group, which then finds that node's
memory gone and plans without it).

Memory: up to two steps per node (the newest complete one is kept while the next is written), three
while EFS still copies an older one, each holding the node's own shards plus one replica: about 4x
(6x while EFS lags) the node's shard bytes at the peak; each save checks that its own step fits.

This module is the path's face (``checkpoint.py`` calls :func:`save`, :func:`flush`, :func:`resume`,
:func:`report_efs_restore`): whether it is on, the two collective decisions -- does a step fit
every node's memory, which step the survivors restore and how -- and what the last restore did
(:data:`last_restore`). The parts: ``shardsave.py`` (the save once it fits: the write, the
replicas, the background CRCs, markers and EFS copy, :func:`flush`), ``replicas.py`` (the ring,
each node's need, the replica exchange), ``shardplan.py`` (each node's inventory, what covers a
step, what is missing), ``shardfiles.py`` (a step directory's files and markers),
``collectives.py`` (the small JSON collectives), ``ranges.py`` (the restore's byte-range receive).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import (
    collectives,
    ranges,
    replicas,
    shardfiles,
    shardplan,
    shardsave,
    timeline,
)
from petctl_agent.checkpointing.budget import read_meminfo, reserve
from petctl_agent.checkpointing.files import read_pointer
from petctl_agent.checkpointing.memory_store import agreed_snapshot_dir
from petctl_agent.checkpointing.shardsave import flush
from petctl_agent.checkpointing.snapshot import node_name
from petctl_agent.distributed import dist_rank, dist_world

SUBDIR = "sharded"

#: what the last :func:`resume` did: ``{"source": "memory"|"efs", "step", "newest", ...}`` (or None)
last_restore: dict[str, Any] | None = None
#: where the node's free memory is read (tests point it at a small fake); None: ``/proc/meminfo``,
#: or the test-only ``$PETCTL_SNAPSHOT_MEMINFO`` (``budget.read_meminfo``)
MEMINFO_PATH: str | None = None


#: the opt-in (``run-job --env PETCTL_SHARDED_MEMORY=1``): off by default, because on every timed
#: case of ``bench/bench_sharded_memory.py`` it cost more than DCP straight to EFS (docs/benchmarks.md,
#: "Sharded state"); what it buys is a restore after a hard loss that EFS does not yet hold
OPT_IN = "PETCTL_SHARDED_MEMORY"


def memory_root() -> Path | None:
    """``$PETCTL_SNAPSHOT_DIR/sharded`` when the job opted in (:data:`OPT_IN`), else None."""
    d = knobs.snapshot_dir()
    return Path(d) / SUBDIR if d and _opted_in() else None


def _opted_in() -> bool:
    return os.environ.get(OPT_IN, "").strip().lower() in ("1", "true", "yes")


def _agreed_root() -> Path | None:
    """:func:`memory_root` when every rank's node has a store, else None on every rank (collective
    when the job opted in: ``memory_store.agreed_snapshot_dir``)."""
    d = agreed_snapshot_dir() if _opted_in() else None
    return d / SUBDIR if d is not None else None


def _meminfo() -> dict[str, int]:
    return read_meminfo(MEMINFO_PATH)


def _node_key() -> str:
    return node_name(knobs.snapshot_dir() or "")


def save(state: dict[str, Any], step: int, directory: Path, keep: int, *, wait: bool) -> bool:
    """Checkpoint sharded ``state`` into node memory (+ a peer replica, + EFS in the background).

    Collective. True when it did; False: memory is off or some node's memory cannot hold it (the
    caller writes to EFS as before). ``wait``: return only once ``latest`` names ``step``. A periodic
    save while the previous step's EFS copy is still running skips this step's EFS copy (memory only).
    """
    root = _agreed_root()
    if root is None:
        return False
    if wait:
        flush()
    inflight = shardsave.settle()
    rank = dist_rank()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    stepdir = root / f"ckpt-{step:010d}.dcp"
    node = _node_key()
    # which history this step is of (timeline.py): the restore agreed on it; a generation that
    # saves before any restore agrees here, in this gather
    epoch = timeline.current()
    agree = {} if epoch is not None else {"clock": time.time_ns(), "seen": shardplan.seen(root, directory)}
    info = collectives.gather_json(
        {
            "node": node,
            "bytes": replicas.local_bytes(state),
            "busy": inflight,
            "id": uuid.uuid4().hex if rank == 0 else "",
            "epoch": epoch,
            **agree,
        }
    )
    if info[0]["epoch"] is not None:
        epoch = timeline.adopt(int(info[0]["epoch"]))
    else:
        epoch = timeline.begin(
            max(int(i.get("seen", 0)) for i in info), max(int(i.get("clock", 0)) for i in info)
        )
    nodes = [i["node"] for i in info]
    leader = replicas.leader(rank, nodes) == rank
    # one decision per node (its lowest rank), on the node's whole need: the ranks share its memory;
    # reserved in the machine's ledger (at the snapshot dir: the tmpfs's root, or the dir itself)
    # until this rank's writes and exchange are done (not across the EFS copy)
    held_res, why = (
        reserve(replicas.node_needs(info, nodes)[node], root.parent, _meminfo) if leader else (None, "")
    )
    ok = held_res is not None or not leader
    try:
        verdicts = collectives.gather_json({"ok": ok, "why": why})
        if not all(v["ok"] for v in verdicts):
            if rank == 0:
                bad = "; ".join(
                    f"node of rank {r}: {v['why']}" for r, v in enumerate(verdicts) if not v["ok"]
                )
                shardfiles.say(
                    f"sharded snapshot of step {step} does not fit in memory ({bad}); writing to EFS"
                )
            if held_res is not None:
                held_res.done()  # before the flush's wait: nothing of ours is in flight
            if shardsave.pending:
                flush()  # the EFS path writes the directory this rank's copy may be writing to
            return False
        return shardsave.save_in_memory(
            state, step, directory, keep, wait, root, stepdir, info, nodes, leader, inflight,
            written=held_res.done if held_res is not None else lambda: None, epoch=int(epoch),
        )  # fmt: skip
    finally:
        if held_res is not None:
            held_res.done()


def resume(
    into: dict[str, Any], directory: Path, unsafe_load: bool | None = None
) -> tuple[dict[str, Any], int] | None:
    """Restore the newest step the survivors' memories cover (not older than EFS); else None (collective)."""
    global last_restore
    root = _agreed_root()
    if root is None:
        return None
    from petctl_agent.checkpointing.files import UnsafeCheckpointError
    from petctl_agent.checkpointing.sharded import MissingStateError, load_sharded

    flush()
    rank = dist_rank()
    t0 = time.monotonic()
    inv = shardplan.inventory(root) if root.is_dir() else {}
    pointer = read_pointer(Path(directory))
    mine = timeline.key(pointer)  # an old pointer, without an epoch: epoch 0
    # every rank's read of EFS's `latest` is gathered, not only its memory's inventory: a persister
    # may move `latest` between the ranks' reads, and a rank that alone saw the newer step would
    # give memory up (a plan of None) while the others entered the collective load of an older one.
    # With them, what this generation's epoch needs (timeline.py): each rank's clock and the
    # largest epoch it sees
    seen_here = max([timeline.epoch_of(pointer)] + [int(v.get("epoch", 0)) for v in inv.values()])
    entries = collectives.gather_json(
        {"node": _node_key(), "inv": inv, "efs": mine[1], "efs_epoch": mine[0], "clock": time.time_ns(),
         "seen": seen_here}
    )  # fmt: skip
    timeline.begin(max(int(e["seen"]) for e in entries), max(int(e["clock"]) for e in entries))
    nodes = [e["node"] for e in entries]
    invs = [e["inv"] for e in entries]
    efs_key = max((int(e["efs_epoch"]), int(e["efs"])) for e in entries)  # the newest durable any rank saw
    efs = efs_key[1]
    # a step is known by (epoch, step) and its save id, not its number alone: after a fallback to
    # EFS two nodes may hold "step N" of two histories, and an abandoned one's steps may be higher
    # than the live one's. Newest first: the newest history's newest step
    cands = sorted(
        {(int(i[s].get("epoch", 0)), int(s), str(i[s]["id"])) for i in invs for s in i}, reverse=True
    )
    top = cands[0][:2] if cands else timeline.NONE
    newest = max(top, efs_key)[1]
    plan = None
    step = -1
    for e, s, sid in cands:
        if (e, s) < efs_key:
            break
        plan = shardplan.covered(str(s), invs, sid)
        if plan is not None:
            step, plan_key = s, (e, s)
            break
    if plan is None:
        last_restore = {"source": "efs", "step": efs, "newest": newest}
        if cands and top > efs_key:
            last_restore["back_to"] = efs
        if rank == 0 and cands and top > efs_key:
            missing = shardplan.missing(str(top[1]), invs, cands[0][2])
            shardfiles.say(
                f"step {top[1]} is not in the survivors' memory (no intact copy of {missing}); "
                f"going back to step {efs} from {directory}"
                if efs >= 0
                else f"step {top[1]} is not in the survivors' memory (no intact copy of {missing}) "
                "and nothing is persisted: starting over"
            )
        return None
    stepdir = root / f"ckpt-{step:010d}.dcp"
    recv = ranges.Received()
    ok = True
    try:
        recv = _fetch(stepdir, rank, nodes, invs, str(step), plan, into, unsafe_load)
    except Exception as e:  # noqa: BLE001 - any fetch trouble: every rank goes to EFS together
        shardfiles.say(f"fetching step {step}'s shards from peers' memory failed ({type(e).__name__}: {e})")
        ok = False
    if recv.refused:  # the same on every rank: nothing was received
        why = f"step {step}'s bytes to receive from peers do not fit in node memory ({recv.refused})"
        last_restore = {"source": "efs", "step": efs, "newest": newest, "reason": why}
        if rank == 0:
            shardfiles.say(f"{why}; going back to step {efs} from {directory}")
        return None
    fetched = recv.node
    if not collectives.all_ok(ok):
        last_restore = {"source": "efs", "step": efs, "newest": newest}
        if rank == 0:
            shardfiles.say(
                f"restoring step {step} from memory failed on some rank; going back to step {efs} from {directory}"
            )
        return None
    try:
        got = load_sharded(stepdir, into, unsafe_load)
    except (UnsafeCheckpointError, MissingStateError):
        raise
    except Exception as e:  # noqa: BLE001 - DCP fails on every rank together: EFS then
        last_restore = {"source": "efs", "step": efs, "newest": newest}
        if rank == 0:
            shardfiles.say(
                f"loading step {step} from memory failed ({e}); going back to step {efs} from {directory}"
            )
        return None
    secs = time.monotonic() - t0
    shards = shardplan.shard_sources(rank, nodes, invs, str(step), plan, recv.peers)
    last_restore = {
        "source": "memory",
        "step": step,
        "newest": newest,
        "world_size": plan["world"],
        "fetched_bytes": fetched,
        "seconds": round(secs, 3),
        "shards": shards,
    }
    if plan_key < top:
        last_restore["back_to"] = step
    _report_restore(
        "peer" if shards.get("peer") else "self",
        step,
        sum(f[1] for f in plan["files"].values()),
        secs,
        shards=shards,
        newest=newest,
        back_to=last_restore.get("back_to"),
        received=fetched,
    )
    if rank == 0 and plan_key < top:
        shardfiles.say(
            f"step {top[1]} is not in the survivors' memory (no intact copy of "
            f"{shardplan.missing(str(top[1]), invs, cands[0][2])}); going back to step {step}, the newest they hold"
        )
    if rank == 0:
        shardfiles.say(
            f"restored step {step} from node memory at world size {dist_world()} (saved at "
            f"{plan['world']}; {fetched / 2**20:.1f} MiB fetched from peers by this node, {secs:.2f} s)"
        )
    return got


def _report_restore(source: str, step: int, nbytes: int, seconds: float, **extra: Any) -> None:
    """This node's restore for the agent's ``snapshot_restored`` event (local rank 0 writes it)."""
    from petctl_agent.checkpointing.memory_store import report_restore

    report_restore(source, step, nbytes, seconds, **extra)


def report_efs_restore(step: int, world: int | None, seconds: float) -> None:
    """After :func:`resume` said EFS: every shard of ``step`` came from EFS (the event says which step
    the job went back to when memory had a newer one). Called by ``checkpoint.resume``."""
    if memory_root() is None or last_restore is None or last_restore.get("source") != "efs":
        return
    shards = {"efs": list(range(world))} if world else {"efs": []}
    newest = last_restore.get("newest")
    back = step if newest is not None and newest > step else None
    why = {"reason": last_restore["reason"]} if last_restore.get("reason") else {}
    _report_restore("efs", step, 0, seconds, shards=shards, newest=newest, back_to=back, **why)


def _fetch(
    stepdir: Path,
    rank: int,
    nodes: list[str],
    invs: list[dict[str, Any]],
    step: str,
    plan: dict[str, Any],
    into: dict[str, Any],
    unsafe_load: bool | None,
) -> ranges.Received:
    """Give each node the byte ranges of the plan's files that its ranks' load reads and its memory
    lacks (``ranges.receive``: each node's lowest rank receives them, after its memory said they fit)."""
    world = len(nodes)
    has: dict[int, set[str]] = {}
    for d in sorted({replicas.leader(r, nodes) for r in range(world)}):
        mine = invs[d].get(step)
        has[d] = set(mine["files"]) if mine and mine["id"] == plan["id"] else set()
    root = stepdir.parent
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = ""
    except OSError as e:
        made = f"{type(e).__name__}: {e}"
    # agreed before the receive's collectives: a rank raising here alone would meet the others'
    # gathers with the caller's all_ok (a mismatched pair)
    said = collectives.first_said(made)
    if said:
        raise OSError(f"a node could not make its sharded store ({said})")
    return ranges.receive(
        ranges.Step(nodes, has, plan["files"]),
        stepdir,
        rank,
        into,
        unsafe_load,
        gather=collectives.gather_json,
        reserve=lambda n: reserve(n, root.parent, _meminfo),
        group=collectives.group,
        read=lambda p, n: shardfiles.read_tensor(p, n),  # looked up at the call: a test may replace it
        timeout=replicas.fetch_timeout(),
    )
