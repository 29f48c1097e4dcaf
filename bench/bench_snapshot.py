"""Memory snapshot vs today's EFS path: what a checkpoint blocks, and what a restore costs.

    python bench/bench_snapshot.py --sizes 0.1,1 --reps 3 --out /tmp/bench_snapshot.json

For each size (GiB of fp32 state, one tensor per 64 MiB) it times, medians of ``--reps``:

- ``efs_save``: today's path, ``files.write_file`` (torch.save, fsync, rename, ``latest``) into
  ``--efs`` (a directory standing in for EFS: a local disk here, so a lower bound);
- ``snap_block``: :meth:`SnapshotStore.write`, the part training waits for (the copy into the
  slot; the slot's pages already held, as from the second checkpoint of a job on);
- ``snap_first``: the same on a fresh slot (the job's first checkpoint: tmpfs allocates pages);
- ``snap_second``: the job's second checkpoint, ``--interval`` s after the first (its slot is new
  too; the store prepares it in the background meanwhile);
- ``snap_restart``: the worse of the first two checkpoints after a worker restart, each
  ``--interval`` s after the one before: a new store on the held slots, a restore whose tensors
  the script keeps (its slot lent: the write to it needs a new file), then the two writes;
- ``snap_total``: the copy plus the CRCs and the header (``flush``);
- ``snap_stop_1thr`` / ``snap_stop_nthr``: a coordinated stop's snapshot (``write(wait=True)``:
  the copy, then the CRCs at once, the header), the CRCs on one thread / on
  ``checkpointing.crcs.threads()`` threads;
- ``snap_load`` vs ``efs_load``: restore from the snapshot vs ``files.load_file`` (sha256 + torch.load);
- ``persist``: the background write of the snapshot to ``--efs`` (``persist_newest``).

``--floor``: only the pieces, s/GiB: the memcpy floor (anonymous memory, 1 and all threads),
the checksum on one thread (``crc_zlib_crc32``: zlib's crc32, the memory path's before CRC-32C;
``crc_crc32c``: :func:`checkpointing.crcs.crc`, CRC-32C in hardware),
``posix_fallocate``, ``MAP_POPULATE`` vs ``madvise(MADV_POPULATE_WRITE)`` (the store's, GIL
released) vs the copy's own page faults, and the copy into mapped pages.

``--interval`` stands in for the training between checkpoints (idle here: on a busy node the
background work competes with training for the cores).

Memory: about 5x the largest size at once (the state, two slots, a lent file and its spare);
``--shm`` defaults to /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from petctl_agent.checkpointing import crcs
from petctl_agent.checkpointing.files import load_file, read_pointer, write_file
from petctl_agent.checkpointing.persisting import persist_newest
from petctl_agent.checkpointing.snapshot import SnapshotStore

TARGET = 0.25  # s/GiB a periodic checkpoint may block


def _state(gib: float) -> dict[str, torch.Tensor]:
    n = int(gib * 2**30) // 4
    chunk = 16 << 20  # 64 MiB of fp32
    out, i = {}, 0
    while n > 0:
        k = min(chunk, n)
        out[f"p{i}"] = torch.randn(k)
        n -= k
        i += 1
    return out


def _t(f, *args) -> float:
    t = time.perf_counter()
    f(*args)
    return time.perf_counter() - t


def bench(gib: float, reps: int, shm_root: Path, efs_root: Path, interval: float = 2.0) -> dict[str, float]:
    state = _state(gib)
    shm = Path(tempfile.mkdtemp(prefix="bench-snap-", dir=shm_root))
    efs = Path(tempfile.mkdtemp(prefix="bench-efs-", dir=efs_root))
    r: dict[str, list[float]] = {
        k: []
        for k in (
            "efs_save",
            "efs_load",
            "snap_first",
            "snap_second",
            "snap_restart",
            "snap_block",
            "snap_total",
            "snap_load",
            "persist",
            "snap_stop_1thr",
            "snap_stop_nthr",
        )
    }
    try:
        step = 0
        for _ in range(reps):
            step += 1
            r["efs_save"].append(_t(write_file, state, step, efs, 1))
            p = read_pointer(efs)
            r["efs_load"].append(_t(load_file, efs / p["file"], p["sha256"], "cpu"))
            # a fresh store: the first checkpoint allocates the slot's pages
            first = SnapshotStore(shm, f"first{step}")
            r["snap_first"].append(_t(first.write, state, step))
            time.sleep(interval)
            r["snap_second"].append(_t(first.write, state, step + 1))
            first.remove()
        store = SnapshotStore(shm, "r")
        for s in (1, 2):  # both slots hold their pages, as from the job's 2nd checkpoint on
            store.write(state, s, wait=True)
        step = 2
        for _ in range(reps):
            step += 1
            t0 = time.perf_counter()
            assert store.write(state, step) == "ok"
            r["snap_block"].append(time.perf_counter() - t0)
            store.flush()
            r["snap_total"].append(time.perf_counter() - t0)
            r["snap_load"].append(_t(store.load, step))
            r["persist"].append(_t(persist_newest, store, efs, 1))
            # a coordinated stop's snapshot (waited for: copy, CRCs, header) on one thread and on
            # the default number (crcs.threads(): the CPUs, at most 8), back to back
            for key, n in (("snap_stop_1thr", "1"), ("snap_stop_nthr", "")):
                step += 1
                os.environ["PETCTL_CRC_THREADS"] = n
                r[key].append(_t(lambda s=step: store.write(state, s, wait=True)))
            os.environ.pop("PETCTL_CRC_THREADS", None)
        for _ in range(reps):  # a worker restart: a new store, a restore kept as training state
            store.close()
            store = SnapshotStore(shm, "r")
            kept = store.load(step)
            assert kept is not None
            if hasattr(store, "prepare_spares"):
                store.prepare_spares(store.newest().header["size"])  # what ckpt.resume does
            worst = 0.0
            for _ in range(2):
                time.sleep(interval)
                step += 1
                t0 = time.perf_counter()
                assert store.write(state, step) == "ok"
                worst = max(worst, time.perf_counter() - t0)
                store.flush()
            r["snap_restart"].append(worst)
            del kept
        store.remove()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(efs, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in r.items()}
    med["gib"] = gib
    med["block_s_per_gib"] = med["snap_block"] / gib
    med["restart_s_per_gib"] = med["snap_restart"] / gib
    return med


def floor(gib: float, reps: int, shm_root: Path) -> dict[str, float]:
    """Where a copy into tmpfs spends its time, piece by piece, and the memcpy floor (medians)."""
    import mmap
    import os

    from petctl_agent.checkpointing.mapping import populate

    n = int(gib * 2**30)
    src = torch.randn(n // 4).view(torch.uint8)
    anon = torch.empty(n, dtype=torch.uint8)
    anon.copy_(src)
    r: dict[str, list[float]] = {}
    threads = torch.get_num_threads()
    d = Path(tempfile.mkdtemp(prefix="bench-floor-", dir=shm_root))
    try:
        for _ in range(reps):
            for k in (1, threads):
                torch.set_num_threads(k)
                r.setdefault(f"memcpy_anon_{k}thr", []).append(_t(anon.copy_, src))
            torch.set_num_threads(threads)
            # the checksum, one thread: zlib's crc32 (the former checksum) vs crcs.crc (CRC-32C, awscrt)
            view = memoryview(anon.numpy())
            r.setdefault("crc_zlib_crc32", []).append(_t(zlib.crc32, view))
            r.setdefault("crc_crc32c", []).append(_t(crcs.crc, view))
            view.release()
            for how in ("map_populate", "madvise_populate_ctypes", "copy_faults"):
                fd = os.open(d / how, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, n)
                r.setdefault("fallocate", []).append(_t(os.posix_fallocate, fd, 0, n))
                t0 = time.perf_counter()
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if how == "map_populate" else 0)
                mm = mmap.mmap(fd, n, flags=flags)
                if how == "madvise_populate_ctypes":
                    populate(mm)
                t1 = time.perf_counter()
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=n)
                dst.copy_(src)
                t2 = time.perf_counter()
                r.setdefault(how, []).append(t1 - t0 if how != "copy_faults" else t2 - t1)
                r.setdefault("copy_mapped", []).append(_t(dst.copy_, src))
                del dst
                mm.close()
                os.close(fd)
                os.unlink(d / how)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {k: statistics.median(v) / gib for k, v in r.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.1,1", help="GiB of fp32 state, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--efs", default=tempfile.gettempdir(), help="directory standing in for EFS")
    ap.add_argument("--interval", type=float, default=2.0, help="s of (idle) training between checkpoints")
    ap.add_argument("--out", default="")
    ap.add_argument("--floor", action="store_true", help="only the pieces of a copy into tmpfs, s/GiB")
    a = ap.parse_args()
    if a.floor:
        for g in a.sizes.split(","):
            for k, v in floor(float(g), a.reps, Path(a.shm)).items():
                print(f"{g} GiB  {k:26s} {v:.3f} s/GiB")
        return
    rows = [bench(float(g), a.reps, Path(a.shm), Path(a.efs), a.interval) for g in a.sizes.split(",")]
    cols = [
        "gib",
        "efs_save",
        "snap_first",
        "snap_second",
        "snap_restart",
        "snap_block",
        "snap_total",
        "snap_stop_1thr",
        "snap_stop_nthr",
        "block_s_per_gib",
        "restart_s_per_gib",
        "efs_load",
        "snap_load",
        "persist",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    worst = max(row["block_s_per_gib"] for row in rows)
    print(f"blocking: {worst:.3f} s/GiB worst (target {TARGET}): {'met' if worst <= TARGET else 'MISSED'}")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "target_s_per_gib": TARGET}, indent=1))


if __name__ == "__main__":
    main()
