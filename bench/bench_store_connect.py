#!/usr/bin/env python3
"""How long a rank that started before rank 0 waits to reach rank 0's store, with and without
``distributed.await_listener``, side by side in one run.

After every membership change all ranks start at once; one that reaches its ``TCPStore`` client
before rank 0's store listens is refused, and torch's client backs off exponentially with jitter
before it tries again. ``petctl_agent.distributed.init_process_group`` polls the port (10 ms
apart) first, so the client's own connect succeeds at once. Each rep starts two processes: rank 0
binds its store ``--delays`` seconds after rank 1 began to connect; the time measured is from rank
0's store listening to rank 1's client connected.

    python bench/bench_store_connect.py                       # delays 0,0.1,0.3,0.6; 5 reps
    python bench/bench_store_connect.py --reps 9 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))
from harness import free_port  # noqa: E402

ARMS = ("torch_client", "await_listener")


def _server(port: int, go: float, q) -> None:  # noqa: ANN001
    import torch.distributed as dist

    time.sleep(max(0.0, go - time.monotonic()))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    q.put(("listening", time.monotonic()))
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60),
                          master_listen_fd=sock.detach())  # fmt: skip
    store.wait(["done"])


def _client(port: int, arm: str, go: float, q) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from petctl_agent.distributed import await_listener

    time.sleep(max(0.0, go - time.monotonic()))
    if arm == "await_listener":
        await_listener("127.0.0.1", port, 60)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    q.put(("connected", time.monotonic()))
    store.set("done", "1")


def one(arm: str, delay: float) -> float:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    go = time.monotonic() + 3.0  # both processes have imported torch by then
    ps = [
        ctx.Process(target=_server, args=(port, go + delay, q)),
        ctx.Process(target=_client, args=(port, arm, go, q)),
    ]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(30)
    return max(0.0, got["connected"] - got["listening"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--delays", default="0,0.1,0.3,0.6", help="seconds rank 0's store comes up after rank 1 starts"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    delays = [float(x) for x in a.delays.split(",")]
    rows: list[dict] = []
    for delay in delays:
        per: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(a.reps):
            for arm in ARMS:  # alternating, so the box's noise falls on both
                per[arm].append(round(one(arm, delay), 4))
        rows.append({"delay": delay, **{arm: per[arm] for arm in ARMS}})
    print("| rank 0 late by (s) | torch's client alone: connected after listen (median s) | "
          "await_listener first (median s) | ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|")
    for r in rows:
        t, w = statistics.median(r["torch_client"]), statistics.median(r["await_listener"])
        print(f"| {r['delay']:g} | {t:.3f} | {w:.3f} | {t / w if w > 0 else float('inf'):.1f}x |")
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "reps": a.reps,
           "cpus": os.cpu_count(), "rows": rows}  # fmt: skip
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
