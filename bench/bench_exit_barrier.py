#!/usr/bin/env python3
"""What torch's exit barrier costs etcd on ``V3Store`` (the agent-side store of petctl-etcd).

N nodes enter ``torch.distributed.elastic.utils.store.barrier`` at once, as every agent does
when its job's workers finish (``SimpleElasticAgent._exit_barrier``): each ``add``s 1 to a
counter, the one that reads N ``set``s a key, every one ``wait``s for that key. Each node is a
thread with its own ``etcdv3.Client`` (its own connections, as separate agents have); the
requests are counted by kind on the client side (one shared counter). Against a real etcd:
started here (``harness.Etcd``), or ``--endpoint``.

    python bench/bench_exit_barrier.py                  # N = 8, 32, 64
    python bench/bench_exit_barrier.py --nodes 8,32,64,128 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))


def measure(endpoint: str, n: int, timeout: float = 120.0) -> dict[str, Any]:
    """Run one barrier of ``n`` concurrent nodes on a fresh store prefix; the requests by kind
    (``txn``, ``range``, ``put``, ``watch``, ...), their total, and the wall time."""
    from torch.distributed.elastic.utils.store import barrier

    from petctl_agent.rendezvous import etcd_transport
    from petctl_agent.rendezvous import etcdv3 as v3
    from petctl_agent.rendezvous.store import V3Store

    stats = etcd_transport.Stats()
    prefix = f"/bench/exit-barrier/{uuid.uuid4().hex[:8]}/"
    stores = [
        V3Store(v3.Client(endpoint, stats=stats), prefix, datetime.timedelta(seconds=timeout))
        for _ in range(n)
    ]
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def node(store: V3Store) -> None:
        try:
            start.wait()
            barrier(store, n, key_prefix="torchelastic/exit/barrier", barrier_timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(s,), daemon=True) for s in stores]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    wall = time.monotonic() - t0
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"the barrier of {n} nodes failed: {errors[:3]}")
    for s in stores:
        s.client.close()
    reqs = dict(stats.snapshot()["requests"])
    reqs.pop("watch-answer", None)  # messages a watch received, not requests
    return {"n": n, "requests": reqs, "total": sum(reqs.values()), "txn": reqs.get("txn", 0), "seconds": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="8,32,64", help="comma-separated node counts (default 8,32,64)")
    p.add_argument("--endpoint", help="an etcd host:port to use (default: start one)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    etcd = None
    endpoint = a.endpoint
    if endpoint is None:
        from harness import Etcd

        etcd = Etcd(Path(tempfile.mkdtemp(prefix="bench-exit-barrier-")))
        etcd.start()
        endpoint = etcd.endpoint
    try:
        rows = [measure(endpoint, int(x)) for x in a.nodes.split(",")]
    finally:
        if etcd is not None:
            etcd.stop()
    print(f"{'N':>5} {'txn':>6} {'range':>6} {'put':>5} {'watch':>6} {'total':>6} {'per node':>9} {'s':>6}")
    for r in rows:
        q = r["requests"]
        print(f"{r['n']:>5} {q.get('txn', 0):>6} {q.get('range', 0):>6} {q.get('put', 0):>5} {q.get('watch', 0):>6} "
              f"{r['total']:>6} {r['total'] / r['n']:>9.2f} {r['seconds']:>6.2f}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
