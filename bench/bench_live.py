"""Live mode's costs on this machine: the survivors' stall at a join, a drain and a hard loss, and
the steady-state cost per step against the same loop as plain DDP.

    flock /tmp/petctl-heavy.lock python bench/bench_live.py --state-mb 64 --step-time 0.1

Two replica groups of examples/live_train.py (one process each, gloo, 127.0.0.1) and a lighthouse;
a third group joins, drains, then one survivor is SIGKILLed. Times come from the workers' own
stamped step lines (``mono=``): a stall is the survivor's gap between the step lines around the
change minus its median step. The baseline is the same script with ``--plain`` (torch DDP, two
ranks), over the same number of steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_harness import Lighthouse, Replica, free_port, wait_for  # noqa: E402


def median_step(r: Replica, first: int, last: int) -> float:
    ts = [s.mono for s in r.steps[first:last]]
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


def gap_at(r: Replica, pred) -> float:
    """Gap before the first step line matching ``pred`` (the step that took the change)."""
    for prev, s in zip(r.steps, r.steps[1:]):
        if pred(prev, s):
            return s.mono - prev.mono
    return float("nan")


def steady(tmp: Path, args, plain: bool) -> float:
    extra = ["--state-mb", str(args.state_mb), "--step-time", str(args.step_time)]
    if plain:
        port = free_port()
        envs = [
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i), "WORLD_SIZE": "2"}
            for i in range(2)
        ]
        lh = Lighthouse(tmp)  # unused, but Replica names one
        rs = [Replica(f"plain{i}", lh, tmp, "--plain", *extra, env=envs[i]) for i in range(2)]
    else:
        lh = Lighthouse(tmp).start()
        rs = [Replica(f"live{i}", lh, tmp, *extra) for i in range(2)]
    try:
        n = args.warmup + args.steps
        wait_for(lambda: all(len(r.steps) >= n for r in rs), 60 + n * 2, "the steady-state steps")
        return statistics.mean(median_step(r, args.warmup, n) for r in rs)
    finally:
        for r in rs:
            r.stop()
        lh.kill()


def changes(tmp: Path, args) -> dict[str, float]:
    extra = ["--state-mb", str(args.state_mb), "--step-time", str(args.step_time)]
    lh = Lighthouse(tmp).start()
    a, b = Replica("a", lh, tmp, *extra), Replica("b", lh, tmp, *extra)
    c = None
    try:
        for r in (a, b):
            r.wait_lines(lambda s: s.world == 2, 60, "a quorum of 2")
        a.wait_lines(lambda s: True, 5, "a step")
        base = len(a.steps)
        c = Replica("c", lh, tmp, *extra, "--linger", "30")
        t0 = time.monotonic()
        first = c.wait_lines(lambda s: s.world == 3, 120, "the newcomer's first step")
        newcomer_first_step = first.mono - t0
        a.wait_lines(lambda s: s.step >= first.step + 5, 30, "steps after the join")
        c.drain()
        a.wait_lines(lambda s: s.world == 2, 30, "the drain")
        a.wait_lines(lambda s: s.world == 2, 10, "a step after the drain")
        a.wait_lines(lambda s: s.world == 2, 10, "a step after the drain")
        b.signal(signal.SIGKILL)
        t_kill = time.monotonic()
        a.wait_lines(lambda s: s.world == 1, 30, "the loss")
        a.wait_lines(lambda s: s.world == 1, 10, "a step after the loss")
        med = median_step(a, max(0, base - 20), base)
        return {
            "step": med,
            # the join's step and the two after it (the newcomer's pull may hold a later optimizer step)
            "join": max(
                b.mono - p.mono
                for p, b in zip(a.steps, a.steps[1:])
                if b.world == 3 and b.step <= first.step + 2
            )
            - med,
            "drain": gap_at(a, lambda p, s: p.world == 3 and s.world == 2) - med,
            # from the last step line before the kill to the first step alone (a discarded step between)
            "loss": next(s.mono for s in a.steps if s.world == 1 and s.mono > t_kill)
            - max(s.mono for s in a.steps if s.mono <= t_kill)
            - med,
            "newcomer_first_step": newcomer_first_step,
        }
    finally:
        for r in (a, b, c):
            if r:
                r.stop()
        lh.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state-mb", type=float, default=64)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=60, help="steady-state steps measured")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=2, help="plain/live steady-state runs, alternated")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-live-") as d:
        tmp = Path(d)
        plains, lives = [], []
        for _ in range(args.reps):  # alternated: the machine's other load hits both alike
            plains.append(steady(tmp, args, plain=True))
            lives.append(steady(tmp, args, plain=False))
        plain, live = statistics.median(plains), statistics.median(lives)
        ch = changes(tmp, args)
    print(f"state {args.state_mb:g} MiB/rank, step time {args.step_time:g} s, {os.cpu_count()} cores")
    print(
        f"steady step (median of {args.reps}, alternated): plain DDP {plain:.4f} s, live {live:.4f} s, "
        f"overhead {100 * (live / plain - 1):+.1f} % (plain {[round(x, 4) for x in plains]}, "
        f"live {[round(x, 4) for x in lives]})"
    )
    print(
        f"survivor stall: join {ch['join']:.2f} s, drain {ch['drain']:.2f} s, loss {ch['loss']:.2f} s "
        f"(median step {ch['step']:.3f} s); newcomer's first step {ch['newcomer_first_step']:.2f} s after its start"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
