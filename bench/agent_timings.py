#!/usr/bin/env python
"""Measure elasticity with real etcd + real agents + real torch workers on this machine.

For each scenario: seconds from the event to "all ranks stepping again" and the
training steps lost (highest step reached before - step resumed from). Prints a
table and the same data as JSON. Nothing talks to AWS.

    python bench/agent_timings.py                       # all scenarios, agent defaults (petctl-etcd)
    PETCTL_AGENT_RDZV_BACKEND=etcd-v2 python bench/agent_timings.py   # the etcd-v2 fallback
    PETCTL_AGENT_RDZV_BACKEND=etcd-v2 PETCTL_AGENT_LAST_CALL=2 python bench/agent_timings.py --only start,join
    PETCTL_AGENT_NO_SYNC_RESTART=1 python bench/agent_timings.py --only join

Workaround off-switches (PETCTL_AGENT_NO_*) and tunables are read from the
environment by the agents, so the same script compares configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import Cluster, recovery, wait_for

EVERY = 20
ARGS = ["--total-steps", "1000000", "--step-time", "0.05", "--checkpoint-every", str(EVERY)]
ENV = {"PETCTL_COLLECTIVE_TIMEOUT": "30"}


def _events(c: Cluster, n: Any, kind: str) -> list[dict]:
    return [e for e in (c.status(n.instance_id) or {}).get("events", []) if e["kind"] == kind]


def lifecycle(tmp: Path, timeout: float) -> list[dict]:
    rows = []
    c = Cluster(
        tmp / "lifecycle", job="timing-lifecycle", min_nodes=2, max_nodes=4, script_args=ARGS, extra_env=ENV
    )
    try:
        c.start_etcd()
        t = time.time()
        a, b = c.add_node(), c.add_node()
        c.wait(lambda: c.all_at_world([a, b], 2, 0, 3), timeout, "start", alive=[a, b])
        first = max(next(s[0] for s in n.steps) for n in (a, b))
        rows.append({"scenario": "start 2 nodes (MIN=2)", "seconds": round(first - t, 2), "steps_lost": 0})

        t = time.time()
        n3 = c.add_node()
        c.wait(lambda: c.all_at_world([a, b, n3], 3, t, 3), timeout, "join", alive=[a, b, n3])
        rows.append({"scenario": "node joins (2 -> 3)", **recovery(c, t, [a, b, n3])})

        t = time.time()
        c.terminate(b)
        c.wait(lambda: c.all_at_world([a, n3], 2, t, 3), timeout, "drain", alive=[a, n3])
        wait_for(lambda: b.proc.poll() is not None, timeout, "drained agent exit")
        rows.append(
            {"scenario": f"SIGTERM drain (3 -> 2), rc={b.proc.returncode}", **recovery(c, t, [a, n3])}
        )

        t = time.time()
        n4 = c.add_node()
        c.wait(lambda: c.all_at_world([a, n3, n4], 3, t, 3), timeout, "rejoin", alive=[a, n3, n4])
        t = time.time()
        c.kill_hard(n4)
        c.wait(lambda: c.all_at_world([a, n3], 2, t, 3), timeout, "hard kill", alive=[a, n3])
        rows.append({"scenario": "SIGKILL node tree (3 -> 2)", **recovery(c, t, [a, n3])})
    finally:
        c.close()
    return rows


def mid_rendezvous(tmp: Path, timeout: float) -> list[dict]:
    c = Cluster(
        tmp / "midrdzv", job="timing-midrdzv", min_nodes=2, max_nodes=4, script_args=ARGS, extra_env=ENV
    )
    try:
        c.start_etcd()
        a, b = c.add_node(), c.add_node()
        c.wait(lambda: c.all_at_world([a, b], 2, 0, 3), timeout, "start", alive=[a, b])
        n3 = c.add_node()
        wait_for(lambda: _events(c, a, "rendezvous_start")[1:], timeout, "re-rendezvous")
        t = time.time()
        c.kill_hard(n3)
        c.wait(lambda: c.all_at_world([a, b], 2, t, 3), timeout, "survivors", alive=[a, b])
        return [{"scenario": "joiner SIGKILLed during re-rendezvous", **recovery(c, t, [a, b])}]
    finally:
        c.close()


def etcd_restart(tmp: Path, timeout: float) -> list[dict]:
    c = Cluster(tmp / "etcd", job="timing-etcd", min_nodes=2, max_nodes=2, script_args=ARGS, extra_env=ENV)
    try:
        c.start_etcd()
        a, b = c.add_node(), c.add_node()
        c.wait(lambda: c.all_at_world([a, b], 2, 0, 3), timeout, "start", alive=[a, b])
        t = time.time()
        c.etcd.stop()
        c.etcd.start()
        t_up = time.time()
        c.wait(
            lambda: all(n.steps and n.steps[-1][0] > t_up + 5 for n in (a, b)), timeout, "steps", alive=[a, b]
        )
        return [{"scenario": "etcd SIGKILL + restart", **recovery(c, t, [a, b])}]
    finally:
        c.close()


SCENARIOS = {"lifecycle": lifecycle, "midrdzv": mid_rendezvous, "etcd": etcd_restart}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--timeout", type=float, default=240, help="bound on every wait (s)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (agent logs)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="petctl-timings-"))
    rows: list[dict] = []
    for name in args.only.split(","):
        try:
            rows += SCENARIOS[name](tmp, args.timeout)
        except Exception as e:  # noqa: BLE001 - report and carry on with the others
            rows.append({"scenario": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    load = os.getloadavg()[0]
    print(f"\n{'scenario':44} {'s to all ranks stepping':>24} {'steps lost':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['scenario']:44} ERROR {r['error']}")
        else:
            print(f"{r['scenario']:44} {r.get('seconds', '?'):>24} {r.get('steps_lost', '?'):>11}")
    knobs = {k: v for k, v in os.environ.items() if k.startswith("PETCTL_AGENT_")}
    print(json.dumps({"rows": rows, "env": knobs, "loadavg_1m": load, "logs": str(tmp)}, indent=2))
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
