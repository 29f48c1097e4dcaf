#!/usr/bin/env python
"""Membership on etcd v3 leases at scale: what N members' keepalives cost one real etcd.

N simulated members, each with its own lease (TTL ``--ttl``) and membership key attached to
it, renewed every ``--interval`` s through the thin v3 client (``petctl_agent.rendezvous.
etcdv3``) from ``--threads`` threads (each its own keep-alive HTTP connection, members
spread over them, renewals paced evenly). After a warm-up, for ``--duration`` s at steady
state it reads etcd's ``/metrics`` and ``maintenance/status`` before and after: raft
proposals committed, mvcc puts, leases renewed, store revision; client side, requests and
JSON body bytes. At the end every member's key must still be there (no lease lapsed).

The v2 design of petctl-etcd: a TTL refresh (a raft write, a new etcd index) per
node every ``refresh`` = 0.5 s, i.e. 2 writes per node per second; etcd v2 keeps the last
1,000 events, so a watcher that falls 1,000 events behind gets EventIndexCleared (401) and
re-reads everything. That column is computed from the design, not measured here.

    python bench/bench_etcd_v3.py                         # N = 256 and 1000 (~1 min)
    python bench/bench_etcd_v3.py --sizes 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "agent"))
from harness import Etcd  # noqa: E402 - bench/harness.py, next to this script

from petctl_agent.rendezvous import etcd_transport  # noqa: E402
from petctl_agent.rendezvous import etcdv3 as v3  # noqa: E402

V2_REFRESH = 0.5  # s: the v2 handler's default refresh (ttl 2)
V2_HISTORY = 1000  # events etcd v2 keeps for watchers


def _counters(c: v3.Client) -> dict[str, float]:
    m = c.metrics()
    s = c.status()
    return {
        "proposals_committed": m.get("etcd_server_proposals_committed_total", 0.0),
        "mvcc_put": m.get("etcd_mvcc_put_total", 0.0),
        "lease_renewed": m.get("etcd_debugging_lease_renewed_total", 0.0),
        "revision": float(s.revision),
        "raft_index": float(s.raft_index),
    }


def run_size(
    etcd: Etcd, n: int, ttl: int, interval: float, threads: int, warmup: float, duration: float
) -> dict[str, Any]:
    stats = etcd_transport.Stats()
    c = v3.connect(etcd.endpoint, timeout=5, stats=stats)
    prefix = f"/bench/n{n}/members/"
    leases: list[int] = []
    t0 = time.monotonic()
    for i in range(n):  # join: a lease and a key on it per member (2 raft writes each)
        lid, _ = c.grant(ttl)
        c.put(f"{prefix}{i:05d}", f"10.0.{i // 256}.{i % 256}:29500", lease=lid)
        leases.append(lid)
    join_s = time.monotonic() - t0
    stop = threading.Event()
    errors: list[str] = []
    late: list[float] = []  # how far behind schedule each thread's renewals ran (s)

    def keep(mine: list[int]) -> None:
        step = interval / max(1, len(mine))
        nxt = time.monotonic()
        worst = 0.0
        while not stop.is_set():
            for lid in mine:
                nxt += step
                delay = nxt - time.monotonic()
                if delay > 0:
                    if stop.wait(delay):
                        break
                else:
                    worst = max(worst, -delay)
                try:
                    c.keepalive_once(lid, timeout=ttl / 2)
                except v3.EtcdError as e:
                    errors.append(str(e))
        late.append(worst)

    groups = [leases[i::threads] for i in range(threads)]
    ts = [threading.Thread(target=keep, args=(g,), daemon=True) for g in groups]
    for t in ts:
        t.start()
    time.sleep(warmup)
    probe = v3.Client(etcd.endpoint, timeout=5)  # its requests are not counted in ``stats``
    before, s0, m0 = _counters(probe), stats.snapshot(), time.monotonic()
    time.sleep(duration)
    after, s1, m1 = _counters(probe), stats.snapshot(), time.monotonic()
    stop.set()
    for t in ts:
        t.join(ttl + 5)
    alive = c.range(prefix, prefix=True, keys_only=True).count
    secs = m1 - m0
    ka = s1["requests"].get("keepalive", 0) - s0["requests"].get("keepalive", 0)
    out_b, in_b = s1["bytes_out"] - s0["bytes_out"], s1["bytes_in"] - s0["bytes_in"]
    for lid in leases:
        c.revoke(lid)
    per_s = {k: round((after[k] - before[k]) / secs, 2) for k in before}
    return {
        "n": n,
        "ttl_s": ttl,
        "interval_s": interval,
        "threads": threads,
        "join_s": round(join_s, 2),
        "seconds": round(secs, 2),
        "keepalives_per_s": round(ka / secs, 1),
        "keepalives_offered_per_s": round(n / interval, 1),
        "renewed_by_etcd_per_s": per_s["lease_renewed"],
        "raft_proposals_per_s": per_s["proposals_committed"],
        "mvcc_puts_per_s": per_s["mvcc_put"],
        "revision_delta": int(after["revision"] - before["revision"]),
        "raft_index_delta": int(after["raft_index"] - before["raft_index"]),
        "body_bytes_out_per_s": round(out_b / secs),
        "body_bytes_in_per_s": round(in_b / secs),
        "bytes_per_keepalive": round((out_b + in_b) / max(1, ka)),
        "worst_lag_s": round(max(late, default=0.0), 3),
        "members_alive_at_end": alive,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "v2_design_writes_per_s": round(n / V2_REFRESH),
        "v2_history_lasts_s": round(V2_HISTORY / (n / V2_REFRESH), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--sizes", default="256,1000")
    ap.add_argument("--ttl", type=int, default=10, help="lease TTL, s (default 10)")
    ap.add_argument("--interval", type=float, default=2.0, help="keepalive period per member, s (default 2)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-etcd-v3-") as tmp:
        e = Etcd(Path(tmp))
        e.start()
        try:
            version = v3.connect(e.endpoint).version()
            for n in (int(x) for x in a.sizes.split(",")):
                rows.append(run_size(e, n, a.ttl, a.interval, a.threads, a.warmup, a.duration))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            e.stop()
    hdr = (
        "N",
        "keepalives/s",
        "raft writes/s",
        "puts/s",
        "rev Δ",
        "B/keepalive",
        "alive",
        "v2 writes/s",
        "v2 history",
    )
    print(
        f"etcd {version}, {platform.machine()}, TTL {a.ttl} s, keepalive every {a.interval} s, {a.threads} threads"
    )
    print(" | ".join(hdr))
    for r in rows:
        print(
            " | ".join(
                str(x)
                for x in (
                    r["n"],
                    f"{r['keepalives_per_s']} (of {r['keepalives_offered_per_s']})",
                    r["raft_proposals_per_s"],
                    r["mvcc_puts_per_s"],
                    r["revision_delta"],
                    r["bytes_per_keepalive"],
                    f"{r['members_alive_at_end']}/{r['n']}",
                    r["v2_design_writes_per_s"],
                    f"{r['v2_history_lasts_s']} s",
                )
            )
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"etcd": version, "args": vars(a), "rows": rows}, indent=2))
    bad = [r for r in rows if r["members_alive_at_end"] != r["n"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
