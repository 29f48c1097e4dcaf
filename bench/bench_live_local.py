"""Live mode through the product's own path: ``petctl --local run-job --live``, 2 -> 3 -> 2 nodes and
a hard loss, measured from the workers' own stamped step lines.

    flock /tmp/petctl-heavy.lock python bench/bench_live_local.py --state-mb 1024 --start-delay 0 10

Per state size and newcomer start delay (``--start-delay``: the set-up a GPU worker pays before it
joins, CUDA context, NCCL, model build), one job on a fresh local cloud:

- the survivors' stall at the join, the drain and the loss: on each survivor, the gap between the
  step lines around the change of world size, minus its median step (``mono=`` stamps, one
  machine's monotonic clock);
- steps lost: committed step numbers a survivor skipped (0: none);
- survivor restarts: ``workers_started`` events of nodes that were never lost or drained, beyond
  their first (0: none);
- the newcomer's time from its process start (its first line) to its first step: its start delay,
  its imports, its join and its pull of the state from a live peer.

Prints a table and one JSON document (``--json FILE`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "live_train.py"
STEP = re.compile(r"step=(\d+) world_size=(\d+) params=(\w+) mono=([\d.]+)")
STARTED = re.compile(r"live_train: launched pid=\d+ mono=([\d.]+)")


class Job:
    def __init__(self, home: Path, name: str) -> None:
        self.name = name
        self.env = {**os.environ, "PETCTL_HOME": str(home), "PETCTL_LOCAL_DIR": str(home / "local")}
        self.env.pop("AWS_ENDPOINT_URL", None)

    def petctl(self, *args: str, json_out: bool = True, local: bool = True, json_lines: bool = False) -> Any:
        """``petctl [--local] [-o json] ARGS``: its parsed JSON, or its text (``json_lines``: text of
        ``-o json``, one document a line)."""
        cmd = [sys.executable, "-m", "petctl.cli", *(["--local"] if local else [])]
        cmd += [*(["-o", "json"] if json_out or json_lines else []), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"petctl {' '.join(args[:2])} failed: {p.stderr.strip()[-400:]}")
        return json.loads(p.stdout) if json_out and p.stdout.strip() else p.stdout

    def status(self) -> dict[str, Any]:
        return self.petctl("status", self.name)

    def workers(self, st: dict[str, Any]) -> list[dict[str, Any]]:
        return [h for h in st["hosts"] if h["role"] == "worker" and h.get("lifecycle_state") == "InService"]

    def wait_world(self, world: int, timeout: float, exclude: str | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            ws = self.workers(st)
            if (
                len(ws) == world
                and all(h.get("agent_state") == "RUNNING" and h.get("world_size") == world for h in ws)
                and exclude not in {h["instance_id"] for h in ws}
            ):
                return st
            if st["state"] in ("FAILED", "SUCCEEDED") or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for world {world}: {st['state']} {st.get('reason')} {ws}")
            time.sleep(1)


def step_lines(job: Job) -> tuple[dict[str, list[tuple[int, int, float]]], dict[str, float]]:
    """Per instance: (step, world, mono) lines in order; and its worker's start stamp."""
    raw = job.petctl("logs", job.name, json_out=False, json_lines=True)
    steps: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    started: dict[str, float] = {}
    for line in raw.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        node = rec["stream"].split("/", 1)[1]
        m = STEP.search(rec["message"])
        if m:
            steps[node].append((int(m[1]), int(m[2]), float(m[4])))
            continue
        m = STARTED.search(rec["message"])
        if m:
            started.setdefault(node, float(m[1]))
    for node in steps:
        steps[node].sort(key=lambda s: s[2])
    return steps, started


def stall_at(lines: list[tuple[int, int, float]], before: int, after: int) -> float | None:
    """The time from the last committed step before the change of world size (``before`` ->
    ``after``) to the first step at ``after``, less the steps' own time (the median step each):
    a discarded attempt (its number printed again) counts as stall."""
    gaps = [b[2] - a[2] for a, b in zip(lines, lines[1:])]
    if not gaps:
        return None
    med = statistics.median(gaps)
    for i in range(1, len(lines)):
        if lines[i][1] == after and lines[i - 1][1] == before:
            j = i - 1
            while j > 0 and lines[j][0] >= lines[i][0]:
                j -= 1  # the attempts of this step number that were discarded
            steps = max(1, lines[i][0] - lines[j][0])
            return max(0.0, lines[i][2] - lines[j][2] - med * steps)
    return None


def lost_steps(lines: list[tuple[int, int, float]]) -> int:
    nums = sorted({s for s, _, _ in lines})
    return (nums[-1] - nums[0] + 1 - len(nums)) if nums else 0


def one(state_mb: float, delay: float, step_time: float, home: Path) -> dict[str, Any]:
    job = Job(home, f"live-{int(state_mb)}-{int(delay)}")
    job.petctl("setup")
    args = ["--steps", "100000", "--step-time", str(step_time), "--state-mb", str(state_mb)]
    job.petctl(
        "run-job", "--live", "--name", job.name, "--min", "1", "--max", "3", "--size", "2",
        "--drain-timeout", "120", str(EXAMPLE), "--", *args, "--start-delay", str(delay),
    )  # fmt: skip
    t = 300 + state_mb / 10
    st = job.wait_world(2, t)
    first = {h["instance_id"] for h in job.workers(st)}
    time.sleep(5)
    job.petctl("scale", job.name, "--size", "3")
    st = job.wait_world(3, t)
    joiner = ({h["instance_id"] for h in job.workers(st)} - first).pop()
    time.sleep(5)
    job.petctl("scale", job.name, "--size", "2")
    st = job.wait_world(2, t)
    drained = {e["instance_id"] for e in st["events"] if e["kind"] == "drained"}
    time.sleep(5)
    alive = sorted(h["instance_id"] for h in job.workers(st))
    victim = alive[0]
    job.petctl("local", "kill-instance", victim, json_out=False, local=False)
    st = job.wait_world(2, t, exclude=victim)
    time.sleep(5)
    st = job.status()
    steps, started = step_lines(job)
    survivors = [n for n in alive if n != victim]
    starts = defaultdict(int)
    for e in st["events"]:
        if e["kind"] == "workers_started":
            starts[e["instance_id"]] += 1
    keep = (first | {joiner}) - {victim}
    joiner_first = next((m for s, w, m in steps.get(joiner, [])), None)
    row = {
        "state_mb": state_mb,
        "start_delay_s": delay,
        "step_time_s": step_time,
        "join_stall_s": _worst(stall_at(steps[n], 2, 3) for n in first),
        "drain_stall_s": _worst(
            stall_at(steps[n], 3, 2) for n in survivors + [x for x in first if x not in drained]
        ),
        "loss_stall_s": _worst(stall_at(steps[n], 2, 1) for n in survivors),
        "steps_lost": sum(lost_steps(steps[n]) for n in keep if n in steps),
        "survivor_restarts": sum(max(0, starts[n] - 1) for n in keep | drained),
        "newcomer_first_step_s": round(joiner_first - started[joiner], 2)
        if joiner_first is not None and joiner in started
        else None,
    }
    job.petctl("kill-job", job.name, "--yes")
    job.petctl("local", "stop", json_out=False, local=False)
    return row


def state_records(
    gib: float, rep: int, step_time: float, start_delay: float, root: Path
) -> list[dict[str, Any]]:
    """One run as ``bench_state.py``'s records (tool ``petctl-live``): drain, join and hard loss,
    their seconds the survivors' stall, side by side with the restart path's tools."""
    home = root / f"live-{gib:g}-{rep}"
    home.mkdir(parents=True, exist_ok=True)
    base = {"gib": gib, "tool": "petctl-live", "rep": rep, "nodes": 3, "start_delay": start_delay}
    try:
        row = one(gib * 1024, start_delay, step_time, home)
    except Exception as e:  # noqa: BLE001 - a broken path is a result too
        note = f"error: {type(e).__name__}: {e}"
        return [
            {"scenario": sc, **base, "seconds": None, "note": note} for sc in ("drain", "join", "hard_loss")
        ]
    load = round(os.getloadavg()[0], 2)
    lost = row["steps_lost"]
    out = []
    for sc, key in (("drain", "drain_stall_s"), ("join", "join_stall_s"), ("hard_loss", "loss_stall_s")):
        out.append({"scenario": sc, **base, "seconds": row[key], "stall": row[key], "steps_lost": lost,
                    "load": load, "note": f"survivor restarts {row['survivor_restarts']}"})  # fmt: skip
    return out


def _worst(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(max(vals), 3) if vals else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state-mb", type=float, nargs="+", default=[100.0, 1024.0])
    p.add_argument("--start-delay", type=float, nargs="+", default=[0.0, 10.0])
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for mb in a.state_mb:
        for delay in a.start_delay:
            with tempfile.TemporaryDirectory(prefix="bench-live-") as d:
                rows.append(one(mb, delay, a.step_time, Path(d)))
                print(json.dumps(rows[-1]), flush=True)
    cols = [
        "state_mb", "start_delay_s", "join_stall_s", "drain_stall_s", "loss_stall_s", "steps_lost",
        "survivor_restarts", "newcomer_first_step_s",
    ]  # fmt: skip
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    doc = {"bench": "live_local", "step_time_s": a.step_time, "rows": rows}
    print(json.dumps(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
