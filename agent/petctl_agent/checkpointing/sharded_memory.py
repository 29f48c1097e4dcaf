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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import crcs, ranges, timeline
from petctl_agent.checkpointing.atomic import fsync_dir
from petctl_agent.checkpointing.budget import read_meminfo, reserve
from petctl_agent.checkpointing.files import CKPT_RE, prune, read_pointer, write_pointer
from petctl_agent.checkpointing.snapshot import node_name
from petctl_agent.distributed import dist_on, dist_rank, dist_world

SUBDIR = "sharded"
MARKER_FMT = "petctl-sharded-2"  # -2: CRC-32C (``crc32c``; -1 held zlib crc32s, never read now)
_MARKER_RE = re.compile(r"^petctl-rank-(\d+)\.json$")
_CHUNK = 8 << 20

#: what the last :func:`resume` did: ``{"source": "memory"|"efs", "step", "newest", ...}`` (or None)
last_restore: dict[str, Any] | None = None
_pending: list[_Persist] = []
_pending_error: list[str] = []
#: where the node's free memory is read (tests point it at a small fake); None: ``/proc/meminfo``,
#: or the test-only ``$PETCTL_SNAPSHOT_MEMINFO`` (``budget.read_meminfo``)
MEMINFO_PATH: str | None = None


#: the opt-in (``run-job --env PETCTL_SHARDED_MEMORY=1``): off by default, because on every timed
#: case of ``bench/bench_sharded_memory.py`` it cost more than DCP straight to EFS (docs/benchmarks.md,
#: "Sharded state"); what it buys is a restore after a hard loss that EFS does not yet hold
OPT_IN = "PETCTL_SHARDED_MEMORY"


def memory_root() -> Path | None:
    """``$PETCTL_SNAPSHOT_DIR/sharded`` when the job opted in (:data:`OPT_IN`), else None."""
    d = os.environ.get("PETCTL_SNAPSHOT_DIR")
    on = os.environ.get(OPT_IN, "").strip().lower() in ("1", "true", "yes")
    return Path(d) / SUBDIR if d and on else None


def _fetch_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("PETCTL_SHARD_FETCH_TIMEOUT", "300")))


def _persist_timeout() -> float:
    return float(os.environ.get("PETCTL_CHECKPOINT_TIMEOUT", "1800"))


def _meminfo() -> dict[str, int]:
    return read_meminfo(MEMINFO_PATH)


def _node_key() -> str:
    return node_name(os.environ.get("PETCTL_SNAPSHOT_DIR", ""))


def _say(msg: str) -> None:
    print(f"petctl checkpoint: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- small collectives (gloo, JSON)


def _group() -> Any:
    from petctl_agent.checkpointing.group import ckpt_group

    return ckpt_group()


def _gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, over the checkpoint group. No pickle."""
    if not dist_on():
        return [obj]
    import torch
    import torch.distributed as dist

    g = _group()
    raw = json.dumps(obj).encode()
    n = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist_world())]
    dist.all_gather(sizes, n, group=g)
    top = max(int(s) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.zeros(top, dtype=torch.uint8) for _ in range(dist_world())]
    dist.all_gather(outs, buf, group=g)
    return [json.loads(bytes(o[: int(s)].numpy())) for o, s in zip(outs, sizes)]


def _all_ok(ok: bool) -> bool:
    if not dist_on():
        return ok
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group())
    return bool(int(t[0]))


# ---------------------------------------------------------------- files


def _crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = crcs.crc(chunk, crc)
    return crc


def _read_tensor(path: Path, size: int) -> Any:
    """The file's bytes as a uint8 tensor to send: its tmpfs pages mapped, not copied."""
    import torch

    if os.stat(path).st_size != size:
        raise OSError(f"{path.name}: not {size} bytes")
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def _write_atomic(path: Path, t: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", buffering=0) as f:
        f.write(memoryview(t.numpy()))
    os.replace(tmp, path)


def _local_bytes(obj: Any, depth: int = 0) -> int:
    """Upper bound of the bytes this rank's DCP files hold: every tensor's local part."""
    import torch

    if depth > 32:
        return 0
    if hasattr(obj, "to_local") and hasattr(obj, "device_mesh"):  # DTensor
        t = obj.to_local()
        return t.numel() * t.element_size()
    if hasattr(obj, "local_shards"):  # ShardedTensor
        return sum(s.tensor.numel() * s.tensor.element_size() for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_local_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_bytes(v, depth + 1) for v in obj)
    return 0


def _ring_target(rank: int, nodes: list[str]) -> int | None:
    """The first rank after ``rank`` (cyclically) on another node; None on a single node."""
    w = len(nodes)
    for k in range(1, w):
        s = (rank + k) % w
        if nodes[s] != nodes[rank]:
            return s
    return None


def _leader(rank: int, nodes: list[str]) -> int:
    return min(r for r, n in enumerate(nodes) if n == nodes[rank])


def _read_markers(stepdir: Path, step: int) -> list[dict[str, Any]]:
    out = []
    try:
        names = os.listdir(stepdir)
    except OSError:
        return out
    for n in names:
        if not _MARKER_RE.match(n):
            continue
        try:
            m = json.loads((stepdir / n).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("format") == MARKER_FMT and m.get("step") == step:
            out.append(m)
    return out


def _steps(root: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), root / n) for n in names if (m := CKPT_RE.match(n)) and n.endswith(".dcp")]
    return sorted(found, reverse=True)


# ---------------------------------------------------------------- save


class _Persist:
    """One save's background work: CRCs + marker (``marked`` set after), then maybe the EFS copy."""

    def __init__(self, step: int, copy: bool, run: Any) -> None:
        self.step = step
        self.copy = copy
        self.marked = threading.Event()
        self.thread = threading.Thread(target=run, args=(self,), name="petctl-sharded-persist", daemon=True)


def flush() -> None:
    """Wait for all of this rank's background work (CRCs, markers, EFS copy); report its errors."""
    global _pending
    jobs, _pending = _pending, []
    for j in jobs:
        j.thread.join()
    _report()


def _report() -> None:
    while _pending_error:
        _say(f"persisting a sharded checkpoint failed: {_pending_error.pop(0)}")


def _settle() -> int | None:
    """Without blocking on EFS: wait for every earlier save's marker, drop finished work, report
    errors. Returns the step whose EFS copy is still running on this rank (None: none)."""
    global _pending
    for j in _pending:
        j.marked.wait()
    _pending = [j for j in _pending if j.thread.is_alive()]
    _report()
    busy = [j.step for j in _pending if j.copy]
    return busy[0] if busy else None


def _node_needs(info: list[dict[str, Any]], nodes: list[str]) -> dict[str, int]:
    """Bytes each node's memory takes for one step: its ranks' shards plus the replicas it receives."""
    need: dict[str, int] = {}
    multi = len(set(nodes)) > 1
    for r, i in enumerate(info):
        need[nodes[r]] = need.get(nodes[r], 0) + int(i["bytes"])
        t = _ring_target(r, nodes) if multi else None
        if t is not None:
            need[nodes[t]] = need.get(nodes[t], 0) + int(i["bytes"])
    return need


def save(state: dict[str, Any], step: int, directory: Path, keep: int, *, wait: bool) -> bool:
    """Checkpoint sharded ``state`` into node memory (+ a peer replica, + EFS in the background).

    Collective. True when it did; False: memory is off or some node's memory cannot hold it (the
    caller writes to EFS as before). ``wait``: return only once ``latest`` names ``step``. A periodic
    save while the previous step's EFS copy is still running skips this step's EFS copy (memory only).
    """
    root = memory_root()
    if root is None:
        return False
    if wait:
        flush()
    inflight = _settle()
    rank = dist_rank()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    stepdir = root / f"ckpt-{step:010d}.dcp"
    node = _node_key()
    # which history this step is of (timeline.py): the restore agreed on it; a generation that
    # saves before any restore agrees here, in this gather
    epoch = timeline.current()
    agree = {} if epoch is not None else {"clock": time.time_ns(), "seen": _seen(root, directory)}
    info = _gather_json(
        {
            "node": node,
            "bytes": _local_bytes(state),
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
    leader = _leader(rank, nodes) == rank
    # one decision per node (its lowest rank), on the node's whole need: the ranks share its memory;
    # reserved in the machine's ledger (at the snapshot dir: the tmpfs's root, or the dir itself)
    # until this rank's writes and exchange are done (not across the EFS copy)
    held_res, why = reserve(_node_needs(info, nodes)[node], root.parent, _meminfo) if leader else (None, "")
    ok = held_res is not None or not leader
    try:
        verdicts = _gather_json({"ok": ok, "why": why})
        if not all(v["ok"] for v in verdicts):
            if rank == 0:
                bad = "; ".join(
                    f"node of rank {r}: {v['why']}" for r, v in enumerate(verdicts) if not v["ok"]
                )
                _say(f"sharded snapshot of step {step} does not fit in memory ({bad}); writing to EFS")
            if held_res is not None:
                held_res.done()  # before the flush's wait: nothing of ours is in flight
            if _pending:
                flush()  # the EFS path writes the directory this rank's copy may be writing to
            return False
        return _save_in_memory(
            state, step, directory, keep, wait, root, stepdir, info, nodes, leader, inflight,
            written=held_res.done if held_res is not None else lambda: None, epoch=int(epoch),
        )  # fmt: skip
    finally:
        if held_res is not None:
            held_res.done()


def _save_in_memory(
    state: dict[str, Any],
    step: int,
    directory: Path,
    keep: int,
    wait: bool,
    root: Path,
    stepdir: Path,
    info: list[dict[str, Any]],
    nodes: list[str],
    leader: bool,
    inflight: int | None,
    written: Callable[[], None],
    epoch: int = 0,
) -> bool:
    """:func:`save` once every node said the step fits: write, exchange replicas (then
    ``written()``: the node's reservation ends), persist."""
    global _pending
    import torch.distributed.checkpoint as dcp

    rank, world = dist_rank(), dist_world()
    save_id = info[0]["id"]
    busy = {int(i["busy"]) for i in info if i["busy"] is not None}
    copy = wait or not busy
    if leader and stepdir.exists():
        shutil.rmtree(stepdir, ignore_errors=True)  # an earlier save of this step (a retry)
    if leader:  # before writing: keep the newest complete step and the one EFS is still copying
        _drop_old(root, step, busy)
    _barrier()
    stepdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    group = _group() if dist_on() else None
    writer = dcp.FileSystemWriter(str(stepdir), sync_files=False, overwrite=True)
    dcp.save(state, storage_writer=writer, process_group=group)
    own = sorted(n for n in os.listdir(stepdir) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    if rank == 0:
        own.append(".metadata")
    sizes = {n: (stepdir / n).stat().st_size for n in own}
    held = {n: rank for n in own}
    counts = {rank: sum(n != ".metadata" for n in own)}
    if world > 1 and len(set(nodes)) > 1:
        everyone = _gather_json(sizes)
        held.update(_exchange(stepdir, rank, nodes, everyone, leader))
        for src in set(held.values()) - {rank}:
            counts[src] = sum(n != ".metadata" for n in everyone[src])
    # the node's files are written: its ranks' own (dcp.save ends collectively) and the replicas
    # it received (each rank's ring target is the next node's lowest rank, its leader, when a
    # node's ranks are numbered together, as torchrun numbers them): its reservation ends
    written()
    ckpt_dir = Path(directory)
    if rank == 0 and not copy:
        _say(f"step {step}: kept in node memory only; step {min(busy)} is still being copied to {ckpt_dir}")

    def work(job: _Persist) -> None:
        try:
            _finish(stepdir, step, save_id, rank, world, held, counts, ckpt_dir, keep, job, epoch)
        except Exception as e:  # noqa: BLE001 - reported at the next save (or raised by a wait)
            _pending_error.append(f"step {step}: {type(e).__name__}: {e}")
        finally:
            job.marked.set()

    job = _Persist(step, copy, work)
    job.thread.start()
    if wait:
        job.thread.join()
        if _pending_error:
            raise RuntimeError(f"persisting step {step} to {ckpt_dir}: {_pending_error.pop(0)}")
        _barrier()
    else:
        _pending.append(job)
    return True


def _barrier() -> None:
    from petctl_agent.checkpointing.group import barrier

    barrier()


def _drop_old(root: Path, step: int, busy: set[int]) -> None:
    """Keep the newest complete step before ``step`` and the steps in ``busy`` (EFS still copies them)."""
    kept = False
    for s, p in _steps(root):
        if s == step or s in busy:
            continue
        if s < step and not kept and _read_markers(p, s):
            kept = True
            continue
        shutil.rmtree(p, ignore_errors=True)


def _exchange(
    stepdir: Path, rank: int, nodes: list[str], sizes: list[dict[str, int]], leader: bool
) -> dict[str, int]:
    """``.metadata`` to every node, each rank's files to its ring target. Returns what we received."""
    import torch
    import torch.distributed as dist

    g = _group()
    got: dict[str, int] = {}
    msize = sizes[0][".metadata"]
    meta = _read_tensor(stepdir / ".metadata", msize) if rank == 0 else torch.empty(msize, dtype=torch.uint8)
    dist.broadcast(meta, src=0, group=g)
    if rank != 0 and leader and nodes[rank] != nodes[0]:
        _write_atomic(stepdir / ".metadata", meta)
        got[".metadata"] = 0
    works = []
    recvs: list[tuple[str, int, Any]] = []
    target = _ring_target(rank, nodes)
    if target is not None:
        for i, n in enumerate(sorted(k for k in sizes[rank] if k != ".metadata")):
            works.append(dist.isend(_read_tensor(stepdir / n, sizes[rank][n]), dst=target, group=g, tag=i))
    for src in range(len(nodes)):
        if src != rank and _ring_target(src, nodes) == rank:
            for i, n in enumerate(sorted(k for k in sizes[src] if k != ".metadata")):
                buf = torch.empty(sizes[src][n], dtype=torch.uint8)
                works.append(dist.irecv(buf, src=src, group=g, tag=i))
                recvs.append((n, src, buf))
    for w in works:
        w.wait(_fetch_timeout())
    for n, src, buf in recvs:
        _write_atomic(stepdir / n, buf)
        got[n] = src
    return got


def _finish(
    stepdir: Path,
    step: int,
    save_id: str,
    rank: int,
    world: int,
    held: dict[str, int],
    counts: dict[int, int],
    ckpt_dir: Path,
    keep: int,
    job: _Persist,
    epoch: int = 0,
) -> None:
    """The background part: CRCs and the marker (memory complete), then this rank's files to EFS."""
    files = {}
    for n, owner in sorted(held.items()):
        p = stepdir / n
        files[n] = {"owner": owner, "size": p.stat().st_size, "crc32c": _crc_file(p)}
    marker = {
        "format": MARKER_FMT,
        "step": step,
        "epoch": int(epoch),  # the history it is of (timeline.py)
        "id": save_id,
        "world_size": world,
        "rank": rank,
        "counts": {str(o): c for o, c in counts.items()},  # each owner's number of data files
        "files": files,
    }
    path = stepdir / f"petctl-rank-{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, path)  # the marker last: the files it names are complete
    job.marked.set()
    if not job.copy:
        return
    name = f"ckpt-{step:010d}.dcp"
    if timeline.key(read_pointer(ckpt_dir)) >= (int(epoch), step):
        return  # EFS is already there (or ahead: by epoch, then step)
    out = ckpt_dir / f".{name}.{save_id}.tmp"
    try:
        _copy_own(stepdir, rank, held, out)
    except Exception:
        try:  # tell rank 0 at once, so that it gives this step up instead of waiting for us
            with open(out / f".failed-{rank}", "wb") as f:
                os.fsync(f.fileno())
        except OSError:
            pass
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
        raise
    if rank != 0:
        return
    end = time.monotonic() + _persist_timeout()
    while not all((out / f".done-{r}").exists() for r in range(world)):
        failed = sorted(int(n[8:]) for n in _listdir(out) if n.startswith(".failed-") and n[8:].isdigit())
        if failed:
            shutil.rmtree(out, ignore_errors=True)
            who = ", ".join(f"rank {r}" for r in failed)
            raise OSError(
                f"{who} could not copy its shard of step {step} to {ckpt_dir}; step {step} not persisted"
            )
        if time.monotonic() > end:
            raise TimeoutError(f"not every rank's shard of step {step} reached {ckpt_dir}")
        time.sleep(0.05)
    for r in range(world):
        (out / f".done-{r}").unlink()
    fsync_dir(out)
    final = ckpt_dir / name
    if final.exists():
        trash = ckpt_dir / f".{name}.old.tmp"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(out, final)
    fsync_dir(ckpt_dir)
    write_pointer(
        ckpt_dir, {"file": name, "step": step, "format": "dcp", "world_size": world, "epoch": int(epoch)}
    )
    prune(ckpt_dir, keep, name)


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _copy_own(stepdir: Path, rank: int, held: dict[str, int], out: Path) -> None:
    """This rank's own files into the step's EFS temp directory (fsync), then its ``.done-<rank>``."""
    out.mkdir(parents=True, exist_ok=True)
    for n, owner in held.items():
        if owner != rank:
            continue
        dst = out / n
        with open(stepdir / n, "rb", buffering=0) as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f, _CHUNK)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(out)  # the files' names first, then the .done that vouches for them
    done = out / f".done-{rank}"
    with open(done, "wb") as f:
        os.fsync(f.fileno())
    fsync_dir(out)


# ---------------------------------------------------------------- resume


def _seen(root: Path, directory: Path) -> int:
    """The largest epoch among this node's markers and ``latest`` (timeline.py; no CRC pass)."""
    out = timeline.epoch_of(read_pointer(Path(directory)))
    for s, p in _steps(root):
        for m in _read_markers(p, s):
            out = max(out, timeline.epoch_of(m))
    return out


def _inventory(root: Path) -> dict[str, Any]:
    """What this node's memory holds, checked: ``{step: {"id", "epoch", "world", "files": {name:
    [owner, size, crc]}}}`` (``epoch``: the history the step is of, timeline.py).

    A file is offered only when a marker names it and its size and CRC match (torn or rewritten:
    left out); markers of one step with different save ids: the step is left out (stale mix).
    """
    out: dict[str, Any] = {}
    for s, p in _steps(root):
        markers = _read_markers(p, s)
        ids = {m.get("id") for m in markers}
        if len(ids) != 1:
            continue
        files: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for m in markers:
            counts.update(m.get("counts", {}))
            for n, f in m.get("files", {}).items():
                fp = p / n
                if not isinstance(f.get("crc32c"), int):  # a malformed marker: not offered
                    continue
                try:
                    if fp.stat().st_size != f["size"] or _crc_file(fp) != f["crc32c"]:
                        continue
                except OSError:
                    continue
                files[n] = [int(f["owner"]), int(f["size"]), int(f["crc32c"])]
        if files:
            out[str(s)] = {
                "id": ids.pop(),
                "epoch": min(timeline.epoch_of(m) for m in markers),
                "world": int(markers[0]["world_size"]),
                "counts": counts,
                "files": files,
            }
    return out


def _covered(step: str, entries: list[dict[str, Any]], sid: str | None = None) -> dict[str, Any] | None:
    """Every file of ``step`` (one save id: ``sid``, given) and who holds it, if the nodes'
    memories cover it."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if step in e and (sid is None or e[step]["id"] == sid):
            by_id.setdefault(e[step]["id"], []).append(e[step])
    for sid, parts in sorted(by_id.items()):
        world = parts[0]["world"]
        files: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for part in parts:
            counts.update(part["counts"])
            for n, f in part["files"].items():
                files.setdefault(n, f)
        if ".metadata" in files and not _lost(world, counts, files):
            return {"id": sid, "world": world, "files": files}
    return None


def _lost(world: int, counts: dict[str, int], files: dict[str, list[int]]) -> list[int]:
    """The ranks (of the saving world) whose files are not all among ``files``."""
    have: dict[int, int] = {}
    for n, f in files.items():
        if n != ".metadata":
            have[f[0]] = have.get(f[0], 0) + 1
    return [r for r in range(world) if str(r) not in counts or have.get(r, 0) < counts[str(r)]]


def resume(
    into: dict[str, Any], directory: Path, unsafe_load: bool | None = None
) -> tuple[dict[str, Any], int] | None:
    """Restore the newest step the survivors' memories cover (not older than EFS); else None (collective)."""
    global last_restore
    root = memory_root()
    if root is None:
        return None
    from petctl_agent.checkpointing.files import UnsafeCheckpointError
    from petctl_agent.checkpointing.sharded import MissingStateError, load_sharded

    flush()
    rank = dist_rank()
    t0 = time.monotonic()
    inv = _inventory(root) if root.is_dir() else {}
    pointer = read_pointer(Path(directory))
    mine = timeline.key(pointer)  # an old pointer, without an epoch: epoch 0
    # every rank's read of EFS's `latest` is gathered, not only its memory's inventory: a persister
    # may move `latest` between the ranks' reads, and a rank that alone saw the newer step would
    # give memory up (a plan of None) while the others entered the collective load of an older one.
    # With them, what this generation's epoch needs (timeline.py): each rank's clock and the
    # largest epoch it sees
    seen_here = max([timeline.epoch_of(pointer)] + [int(v.get("epoch", 0)) for v in inv.values()])
    entries = _gather_json(
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
        plan = _covered(str(s), invs, sid)
        if plan is not None:
            step, plan_key = s, (e, s)
            break
    if plan is None:
        last_restore = {"source": "efs", "step": efs, "newest": newest}
        if cands and top > efs_key:
            last_restore["back_to"] = efs
        if rank == 0 and cands and top > efs_key:
            missing = _missing(str(top[1]), invs, cands[0][2])
            _say(
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
        _say(f"fetching step {step}'s shards from peers' memory failed ({type(e).__name__}: {e})")
        ok = False
    if recv.refused:  # the same on every rank: nothing was received
        why = f"step {step}'s bytes to receive from peers do not fit in node memory ({recv.refused})"
        last_restore = {"source": "efs", "step": efs, "newest": newest, "reason": why}
        if rank == 0:
            _say(f"{why}; going back to step {efs} from {directory}")
        return None
    fetched = recv.node
    if not _all_ok(ok):
        last_restore = {"source": "efs", "step": efs, "newest": newest}
        if rank == 0:
            _say(
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
            _say(f"loading step {step} from memory failed ({e}); going back to step {efs} from {directory}")
        return None
    secs = time.monotonic() - t0
    shards = _shard_sources(rank, nodes, invs, str(step), plan, recv.peers)
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
        _say(
            f"step {top[1]} is not in the survivors' memory (no intact copy of "
            f"{_missing(str(top[1]), invs, cands[0][2])}); going back to step {step}, the newest they hold"
        )
    if rank == 0:
        _say(
            f"restored step {step} from node memory at world size {dist_world()} (saved at "
            f"{plan['world']}; {fetched / 2**20:.1f} MiB fetched from peers by this node, {secs:.2f} s)"
        )
    return got


def _report_restore(source: str, step: int, nbytes: int, seconds: float, **extra: Any) -> None:
    """This node's restore for the agent's ``snapshot_restored`` event (local rank 0 writes it)."""
    from petctl_agent.checkpointing.memory import report_restore

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


def _shard_sources(
    rank: int, nodes: list[str], invs: list[dict[str, Any]], step: str, plan: dict[str, Any], peers: list[int]
) -> dict[str, list[int]]:
    """Where this node's shards of the plan came from (by the saving rank that owns them): ``self``
    (files its memory held: its own shards and the replicas it kept) and ``peer`` (``peers``: the
    owners of the files it received ranges of; a file it neither held nor read is in neither)."""
    mine = invs[_leader(rank, nodes)].get(step)
    has = set(mine["files"]) if mine and mine["id"] == plan["id"] else set()
    held = {owner for n, (owner, _, _) in plan["files"].items() if n != ".metadata" and n in has}
    out = {"self": sorted(held), "peer": sorted(peers)}
    return {k: v for k, v in out.items() if v}


def _missing(step: str, invs: list[dict[str, Any]], sid: str | None = None) -> str:
    parts = [i[step] for i in invs if step in i and (sid is None or i[step]["id"] == sid)]
    world = max((p["world"] for p in parts), default=0)
    files: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for p in parts:
        counts.update(p["counts"])
        for n, f in p["files"].items():
            files.setdefault(n, f)
    lost = [f"rank {r}'s shard" for r in _lost(world, counts, files)]
    lost += [] if ".metadata" in files else [".metadata"]
    return ", ".join(lost) or "a consistent set"


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
    for d in sorted({_leader(r, nodes) for r in range(world)}):
        mine = invs[d].get(step)
        has[d] = set(mine["files"]) if mine and mine["id"] == plan["id"] else set()
    root = stepdir.parent
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return ranges.receive(
        ranges.Step(nodes, has, plan["files"]),
        stepdir,
        rank,
        into,
        unsafe_load,
        gather=_gather_json,
        reserve=lambda n: reserve(n, root.parent, _meminfo),
        group=_group,
        read=lambda p, n: _read_tensor(p, n),  # looked up at the call: a test may replace it
        timeout=_fetch_timeout(),
    )
