#!/usr/bin/env python
"""Rendezvous at scale: N participants of ``petctl_agent.rendezvous`` against one real etcd.

No torch workers: every participant is a handler instance driven from a thread of one
process (the handler's own threads included: refresher, control, watches). For each N:

* ``cold``: all N call ``next_rendezvous`` at once (MIN=N/2, MAX=N, expected-size hint N):
  from the last participant's join write to the round returned on every participant;
* ``leave``: a participant (the middle rank) leaves; the others wait on the handler for
  the change, re-join, and the round returns on every survivor: leave() -> all returned;
* ``join``: a newcomer joins the N-1: its ``next_rendezvous`` call -> all N returned;

and the etcd requests of each round, counted inside the handler (refreshes excluded: they are
per second, not per round, N/refresh writes/s). Prints a table and JSON; fits a line to
predict N=1000.

    python scripts/bench_rdzv_scale.py                       # N = 16, 64, 256 (~2 min here)
    python scripts/bench_rdzv_scale.py --sizes 16,64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Etcd  # noqa: E402 - scripts/harness.py, next to this script

# a checkout without the package installed: the agent's import name is its path under agent/
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "agent"))
from petctl_agent.rendezvous import Config, PetctlRendezvousHandler, RequestCounter  # noqa: E402


def _joined_at(h: PetctlRendezvousHandler, target: int) -> float:
    for t, what in reversed(h.events):
        if what == f"joined round {target}":
            return t
    return float("nan")


def _rendezvous(hs: list[PetctlRendezvousHandler], wait_change: bool, timeout: float) -> dict[Any, float]:
    """next_rendezvous on each (optionally after waiting for the change); returns handler -> return time."""
    done: dict[Any, float] = {}
    errors: list[BaseException] = []

    def run(h: PetctlRendezvousHandler) -> None:
        try:
            if wait_change and h.wait_for_change(timeout) is None:
                raise TimeoutError(f"{h.node_id} saw no change")
            h.next_rendezvous()
            done[h] = time.time()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(h,), daemon=True) for h in hs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if errors or len(done) != len(hs):
        raise RuntimeError(f"{len(done)}/{len(hs)} returned; errors: {errors[:3]}")
    return done


def _requests(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        k: after.get(k, 0) - before.get(k, 0)
        for k in after
        if k != "refresh" and after[k] != before.get(k, 0)
    }


def _worker(
    endpoint: str, run_id: str, n: int, count: int, proc: int, procs: int, barrier: Any, q: Any
) -> None:
    """One process of the benchmark: ``count`` of the N participants, phases in lockstep (barrier)."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("etcd.client").setLevel(logging.CRITICAL)
    counter = RequestCounter()
    expected = {"n": n}
    cfg = Config(join_timeout=TIMEOUT)

    def make() -> PetctlRendezvousHandler:
        return PetctlRendezvousHandler(
            run_id, endpoint, max(1, n // 2), n, "127.0.0.1", config=cfg, expected_nodes=lambda: expected["n"],
            counter=counter,
        )  # fmt: skip

    hs = [make() for _ in range(count)]
    try:
        # cold start: everyone at once
        barrier.wait()
        before = counter.snapshot()
        done = _rendezvous(hs, False, TIMEOUT)
        q.put(("cold", proc, {"joined": max(_joined_at(h, 1) for h in hs), "done": max(done.values()),
                              "requests": _requests(before, counter.snapshot())}))  # fmt: skip
        barrier.wait()
        time.sleep(1.0)  # the leader's cleanup runs; load settles

        # the middle rank leaves; the others wait for the change and re-join
        leaver = next((h for h in hs if h.record["participants"].index(h.node_id) == n // 2), None)
        survivors = [h for h in hs if h is not leaver]
        expected["n"] = n - 1
        before = counter.snapshot()
        result: dict[Any, float] = {}
        th = threading.Thread(
            target=lambda: result.update(_rendezvous(survivors, True, TIMEOUT)), daemon=True
        )
        th.start()
        barrier.wait()
        t0 = None
        if leaver is not None:
            time.sleep(0.3)
            t0 = time.time()
            leaver.leave()
        th.join(TIMEOUT)
        target = survivors[0].round if survivors else None
        kept = all(h.record["participants"].index(h.node_id) == r for h, r in _old_ranks(survivors, n))
        q.put(("leave", proc, {"t0": t0, "done": max(result.values(), default=None), "n_done": len(result),
                               "joined": max((_joined_at(h, target) for h in survivors), default=None),
                               "kept": kept, "requests": _requests(before, counter.snapshot())}))  # fmt: skip
        barrier.wait()
        time.sleep(1.0)

        # a newcomer (in the last process) joins the N-1
        expected["n"] = n
        before = counter.snapshot()
        result = {}
        th = threading.Thread(
            target=lambda: result.update(_rendezvous(survivors, True, TIMEOUT)), daemon=True
        )
        th.start()
        barrier.wait()
        t0 = None
        if proc == procs - 1:
            newcomer = make()
            hs.append(newcomer)
            time.sleep(0.3)
            t0 = time.time()
            result.update(_rendezvous([newcomer], False, TIMEOUT))
        th.join(TIMEOUT)
        q.put(("join", proc, {"t0": t0, "done": max(result.values(), default=None), "n_done": len(result),
                              "requests": _requests(before, counter.snapshot())}))  # fmt: skip
        barrier.wait()
        before = counter.snapshot()
        time.sleep(2.0)
        q.put(
            (
                "refresh",
                proc,
                {"per_s": (counter.snapshot().get("refresh", 0) - before.get("refresh", 0)) / 2.0},
            )
        )
    finally:
        for h in hs:
            h.leave()


def _old_ranks(survivors: list[PetctlRendezvousHandler], n: int) -> list[tuple[PetctlRendezvousHandler, int]]:
    """Expected rank after the middle rank left: ranks above it move down by one."""
    out = []
    for h in survivors:
        old = h._last_record  # noqa: SLF001 - the round before is the one we compare with
        prev = None if old is None else old.get("participants")
        r = h.record["participants"].index(h.node_id) if prev is None else prev.index(h.node_id)
        out.append((h, r))
    return out


TIMEOUT = 60.0


def run_size(endpoint: str, n: int, procs: int, timeout: float) -> dict[str, Any]:
    import multiprocessing as mp

    global TIMEOUT
    TIMEOUT = timeout
    ctx = mp.get_context("fork")
    run_id = f"scale{n}-{uuid.uuid4().hex[:6]}"
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    ps = [
        ctx.Process(target=_worker, args=(endpoint, run_id, n, c, i, procs, barrier, q))
        for i, c in enumerate(counts)
    ]
    for p in ps:
        p.start()
    got: dict[str, list[dict[str, Any]]] = {}
    try:
        for _ in range(4 * procs):
            phase, _proc, d = q.get(timeout=4 * timeout)
            got.setdefault(phase, []).append(d)
    finally:
        for p in ps:
            p.join(timeout)
            if p.is_alive():
                p.kill()

    def reqs(phase: str) -> dict[str, int]:
        tot: dict[str, int] = {}
        for d in got[phase]:
            for k, v in d["requests"].items():
                tot[k] = tot.get(k, 0) + v
        return tot

    def t0(phase: str) -> float:
        return next(d["t0"] for d in got[phase] if d["t0"] is not None)

    def done(phase: str) -> float:
        return max(d["done"] for d in got[phase] if d["done"] is not None)

    if sum(d["n_done"] for d in got["leave"]) != n - 1 or sum(d["n_done"] for d in got["join"]) != n:
        raise RuntimeError(f"N={n}: a round did not complete on every participant: {got}")
    out: dict[str, Any] = {
        "n": n,
        "procs": procs,
        "cold_s": round(done("cold") - max(d["joined"] for d in got["cold"]), 3),
        "leave_s": round(done("leave") - t0("leave"), 3),
        "leave_last_join_to_closed_s": round(
            done("leave") - max(d["joined"] for d in got["leave"] if d["joined"]), 3
        ),
        "leave_ranks_kept": all(d["kept"] for d in got["leave"]),
        "join_s": round(done("join") - t0("join"), 3),
        "refresh_per_s": round(sum(d["per_s"] for d in got["refresh"]), 1),
    }
    for k in ("cold", "leave", "join"):
        r = reqs(k)
        out[f"{k}_requests"] = r
        out[f"{k}_requests_total"] = sum(r.values())
        out[f"{k}_requests_per_node"] = round(sum(r.values()) / n, 2)
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound of every wait (s)")
    ap.add_argument("--per-proc", type=int, default=64, help="participants per process (threads)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("etcd.client").setLevel(logging.CRITICAL)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rdzv-scale-") as tmp:
        etcd = Etcd(Path(tmp))
        etcd.start()
        try:
            for n in sizes:
                t = time.monotonic()
                procs = max(1, -(-n // args.per_proc))
                row = run_size(etcd.endpoint, n, procs, args.timeout)
                row["wall_s"] = round(time.monotonic() - t, 1)
                rows.append(row)
                print(f"N={n}: {json.dumps(row)}", file=sys.stderr, flush=True)
        finally:
            etcd.stop()

    hdr = "| N | procs | cold start: last join -> all returned | leave -> all returned | join -> all returned | requests/round (cold, leave, join) | per node | refreshes/s |"
    print(hdr)
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['n']} | {r['procs']} | {r['cold_s']:.3f} s | {r['leave_s']:.3f} s | {r['join_s']:.3f} s | "
            f"{r['cold_requests_total']}, {r['leave_requests_total']}, {r['join_requests_total']} | "
            f"{r['cold_requests_per_node']}, {r['leave_requests_per_node']}, {r['join_requests_per_node']} | "
            f"{r['refresh_per_s']} |"
        )
    pred: dict[str, float] = {}
    if len(rows) >= 2:
        ns = [float(r["n"]) for r in rows]
        for key in ("cold_s", "leave_s", "join_s", "leave_requests_total", "join_requests_total"):
            a, b = fit(ns, [float(r[key]) for r in rows])
            pred[key] = round(a + b * 1000, 3 if key.endswith("_s") else 0)
        print(
            f"\nlinear fit at N=1000: cold {pred['cold_s']} s, leave {pred['leave_s']} s, join {pred['join_s']} s; "
            f"requests per leave round {pred['leave_requests_total']:.0f}, per join round "
            f"{pred['join_requests_total']:.0f}; refreshes {1000 / Config().refresh:.0f}/s"
        )
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "rows": rows,
        "predicted_n1000": pred,
    }
    print(json.dumps(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
