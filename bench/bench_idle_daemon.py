"""CPU of an idle local-cloud daemon (no instances), per reconcile period, for one or more source
trees side by side (e.g. this one and ``git archive <rev>`` of another).

    python bench/bench_idle_daemon.py [--tree DIR ...] [--periods 0.25,0.5] [--seconds 40]

Each run starts a fresh daemon (``petctl.local.ensure_started``, its own state dir, moto's backend
warm-up off), waits 5 s, and reads the daemon's utime + stime from ``/proc/<pid>/stat`` over
``--seconds``. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_ONE = """
import os, sys, time
from petctl import local
pid = local.ensure_started(timeout=60)["pid"]
def cpu():
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
try:
    time.sleep(5)
    c0 = cpu(); time.sleep(float(sys.argv[1])); c1 = cpu()
    print((c1 - c0) / float(sys.argv[1]))
finally:
    local.stop()
"""


def measure(tree: Path, period: float, seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="idle-daemon-") as d:
        env = {
            **os.environ,
            "PYTHONPATH": f"{tree}:{tree / 'agent'}",
            "PETCTL_LOCAL_DIR": f"{d}/local",
            "PETCTL_HOME": f"{d}/home",
            "PETCTL_LOCAL_PERIOD": str(period),
            "PETCTL_LOCAL_WARMUP": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        out = subprocess.run(
            # cwd: the temporary directory, so that the tree on PYTHONPATH is the one imported
            [sys.executable, "-c", _ONE, str(seconds)],
            env=env,
            cwd=d,
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, help="a source tree (default: this one)")
    ap.add_argument("--periods", default="0.25,0.5")
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    trees = args.tree or [REPO]
    rows = [
        {"tree": str(t), "period_s": float(p), "cores": measure(t.resolve(), float(p), args.seconds)}
        for t in trees
        for p in args.periods.split(",")
    ]
    print(f"{'tree':<40} {'period s':>8} {'% of a core':>12}")
    for r in rows:
        print(f"{r['tree'][-40:]:<40} {r['period_s']:>8.2f} {100 * r['cores']:>11.1f}%")
    print(json.dumps({"bench": "idle_daemon", "seconds": args.seconds, "rows": rows}))


if __name__ == "__main__":
    main()
