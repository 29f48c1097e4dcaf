"""What the machine-wide ledger of snapshot allocations in flight costs a write (checkpointing/budget.py).

    python bench/bench_snapshot_ledger.py --reps 200 --mib 64

Timed, medians (and p90) over ``--reps``, in a private directory on ``--shm`` (a tmpfs) with a
private ledger (``$PETCTL_SNAPSHOT_LEDGER``: the machine's real one and its other writers are
left alone), the machine's real ``/proc/meminfo``:

- ``reserve_done``: one reservation's ledger work (reserve: check + record; attach: the file;
  done: the entry removed), ``--others`` other entries of live processes in the ledger, vs the
  same with no ledger (this process's own accounting only, as before the ledger);
- ``write_new`` / ``write_in_place``: ``SnapshotStore.write`` of ``--mib`` MiB into a new file
  (a reservation: the ledger is on its path) and into its slot in place (nothing reserved, no
  ledger work at all).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_ms": round(statistics.median(xs) * 1e3, 4),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--others", type=int, default=4, help="live entries of other processes in the ledger")
    ap.add_argument("--shm", default="/dev/shm")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.shm, prefix="petctl-ledger-bench-") as tmp:
        root = Path(tmp)
        os.environ["PETCTL_SNAPSHOT_LEDGER"] = str(root / "ledger")
        import torch

        from petctl_agent.checkpointing import budget as snapshot_budget
        from petctl_agent.checkpointing.processes import start_time
        from petctl_agent.checkpointing.snapshot import SnapshotStore

        store_dir = root / "store"
        store_dir.mkdir()
        # other processes' reservations in flight: live pids (sleepers) with open entries
        sleepers = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(a.others)
        ]
        try:
            lines = []
            for i, p in enumerate(sleepers):
                start = start_time(p.pid)
                entry = {"pid": p.pid, "start": start, "id": i + 1, "need": 4096, "fd": -1}
                lines.append(json.dumps(entry, separators=(",", ":")))
            (root / "ledger").write_text("".join(line + "\n" for line in lines))
            out: dict[str, object] = {"reps": a.reps, "others": a.others, "mib": a.mib}
            for label, ledger in (("reserve_done_ledger", root / "ledger"), ("reserve_done_no_ledger", None)):
                budget = snapshot_budget.Budget(ledger)
                fd = os.open(root / "f", os.O_RDWR | os.O_CREAT, 0o600)
                times = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    r, why = budget.reserve(4096, store_dir, snapshot_budget.read_meminfo)
                    assert r is not None, why
                    r.attach(fd)
                    r.done()
                    times.append(time.perf_counter() - t0)
                os.close(fd)
                out[label] = _stats(times)
            n = a.mib << 18  # fp32
            state = {"w": torch.ones(n)}
            new, in_place = [], []
            for rep in range(max(3, a.reps // 20)):
                store = SnapshotStore(store_dir, f"s{rep}")
                t0 = time.perf_counter()
                assert store.write(state, 1, wait=True) == "ok"  # slot a: a new file
                new.append(time.perf_counter() - t0)
                assert store.write(state, 2, wait=True) == "ok"  # slot b: a new file
                t0 = time.perf_counter()
                assert store.write(state, 3, wait=True) == "ok"  # slot a again, in place
                in_place.append(time.perf_counter() - t0)
                store.close()
                for p in store_dir.glob(f"s{rep}.*"):
                    p.unlink()
            out["write_new"] = _stats(new)
            out["write_in_place"] = _stats(in_place)
            print(json.dumps(out))
        finally:
            for p in sleepers:
                p.kill()
                p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
