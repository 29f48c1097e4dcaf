"""A sharded step's save once every node said it fits (``sharded_memory.save``): written into node
memory (``dcp.save``, after dropping older steps), its replicas exchanged (``replicas.py``), then
each rank's background work: the CRCs and its completion marker, then its own files copied to EFS,
and on rank 0 the rename and ``latest`` once every rank's copy is there.

It owns the work still running (:data:`pending`, each save's :class:`_Persist`) and its errors,
reported at the next save: :func:`flush` waits for all of it, :func:`settle` only for the markers.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import collectives, replicas, shardfiles, timeline
from petctl_agent.checkpointing.atomic import fsync_dir
from petctl_agent.checkpointing.files import prune, read_pointer, write_pointer
from petctl_agent.distributed import dist_on, dist_rank, dist_world

pending: list[_Persist] = []
_pending_error: list[str] = []


def _persist_timeout() -> float:
    return knobs.checkpoint_timeout()


class _Persist:
    """One save's background work: CRCs + marker (``marked`` set after), then maybe the EFS copy."""

    def __init__(self, step: int, copy: bool, run: Any) -> None:
        self.step = step
        self.copy = copy
        self.marked = threading.Event()
        self.thread = threading.Thread(target=run, args=(self,), name="petctl-sharded-persist", daemon=True)


def flush() -> None:
    """Wait for all of this rank's background work (CRCs, markers, EFS copy); report its errors."""
    global pending
    jobs, pending = pending, []
    for j in jobs:
        j.thread.join()
    _report()


def _report() -> None:
    while _pending_error:
        shardfiles.say(f"persisting a sharded checkpoint failed: {_pending_error.pop(0)}")


def settle() -> int | None:
    """Without blocking on EFS: wait for every earlier save's marker, drop finished work, report
    errors. Returns the step whose EFS copy is still running on this rank (None: none)."""
    global pending
    for j in pending:
        j.marked.wait()
    pending = [j for j in pending if j.thread.is_alive()]
    _report()
    busy = [j.step for j in pending if j.copy]
    return busy[0] if busy else None


def save_in_memory(
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
    """``sharded_memory.save`` once every node said the step fits: write, exchange replicas (then
    ``written()``: the node's reservation ends), persist."""
    global pending
    import torch.distributed.checkpoint as dcp

    rank, world = dist_rank(), dist_world()
    save_id = info[0]["id"]
    busy = {int(i["busy"]) for i in info if i["busy"] is not None}
    copy = wait or not busy
    if leader and stepdir.exists():
        shutil.rmtree(stepdir, ignore_errors=True)  # an earlier save of this step (a retry)
    if leader:  # before writing: keep the newest complete step and the one EFS is still copying
        _drop_old(root, step, busy)
    collectives.barrier()
    stepdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    group = collectives.group() if dist_on() else None
    writer = dcp.FileSystemWriter(str(stepdir), sync_files=False, overwrite=True)
    dcp.save(state, storage_writer=writer, process_group=group)
    own = sorted(n for n in os.listdir(stepdir) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    if rank == 0:
        own.append(".metadata")
    sizes = {n: (stepdir / n).stat().st_size for n in own}
    held = {n: rank for n in own}
    counts = {rank: sum(n != ".metadata" for n in own)}
    if world > 1 and len(set(nodes)) > 1:
        everyone = collectives.gather_json(sizes)
        held.update(replicas.exchange(stepdir, rank, nodes, everyone, leader))
        for src in set(held.values()) - {rank}:
            counts[src] = sum(n != ".metadata" for n in everyone[src])
    # the node's files are written: its ranks' own (dcp.save ends collectively) and the replicas
    # it received (each rank's ring target is the next node's lowest rank, its leader, when a
    # node's ranks are numbered together, as torchrun numbers them): its reservation ends
    written()
    ckpt_dir = Path(directory)
    if rank == 0 and not copy:
        shardfiles.say(
            f"step {step}: kept in node memory only; step {min(busy)} is still being copied to {ckpt_dir}"
        )

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
        err = _pending_error.pop(0) if _pending_error else ""
        # agreed before anyone raises: a rank raising alone would leave the others in the barrier
        # (up to PETCTL_CHECKPOINT_TIMEOUT, or a broken group's error that names nothing)
        if not collectives.all_ok(not err):
            raise RuntimeError(
                f"persisting step {step} to {ckpt_dir}: {err or 'another rank failed (its error says why)'}"
            )
        collectives.barrier()
    else:
        pending.append(job)
    return True


def _drop_old(root: Path, step: int, busy: set[int]) -> None:
    """Keep the newest complete step before ``step`` and the steps in ``busy`` (EFS still copies them)."""
    kept = False
    for s, p in shardfiles.steps(root):
        if s == step or s in busy:
            continue
        if s < step and not kept and shardfiles.read_markers(p, s):
            kept = True
            continue
        shutil.rmtree(p, ignore_errors=True)


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
        files[n] = {"owner": owner, "size": p.stat().st_size, "crc32c": shardfiles.crc_file(p)}
    marker = {
        "format": shardfiles.MARKER_FMT,
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
            shutil.copyfileobj(src, f, shardfiles.CHUNK)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(out)  # the files' names first, then the .done that vouches for them
    done = out / f".done-{rank}"
    with open(done, "wb") as f:
        os.fsync(f.fileno())
    fsync_dir(out)
