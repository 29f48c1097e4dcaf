#!/usr/bin/env python
"""Elasticity benchmark: petctl's agent vs plain torchrun (etcd, etcd-v2) on one machine.

Every run gets its own real etcd 3.5 (``--enable-v2``) on a free 127.0.0.1 port
and N "nodes", each a process group bound to its own 127.0.0.x address, all
running ``scripts/elastic_train.py`` (``--nnodes 2:8``, one worker per node,
gloo). Tools:

- ``petctl``: ``petctl-agent run`` exactly as production configures it (only
  the local-cloud plumbing -- IMDS URL, EFS dir, agent dir -- is set);
- ``torchrun-etcd``: ``torchrun --rdzv-backend etcd`` with torch's defaults;
- ``torchrun-etcd-v2``: ``torchrun --rdzv-backend etcd-v2`` with torch's defaults.

Times come from the example's ``step=<n> world_size=<w>`` lines, timestamped as
they are read. "All ranks stepping at W" = every live rank printed a step with
world_size=W after the event. Steps lost = last step any rank reached before
training resumed - first step after the resume + 1 (clamped at 0). Every wait is
bounded (``--timeout``); a timeout is a result (a note), not a crash, and the
remaining reps of that (scenario, tool) are skipped.

By default the whole benchmark runs in a private network namespace with only
loopback up (``unshare --net``): plain torchrun binds its stores to the
wildcard address, and here that wildcard then means 127.0.0.0/8 only.

Examples::

    python scripts/bench_elastic.py --reps 3 --json bench.json
    python scripts/bench_elastic.py --reps 1 --scenarios scale_up,hard_loss --tools petctl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import BIN, TOOLS, Node, Run, RunConfig, cmdline, cpu_busy, kill_pids, poll, wait_idle  # noqa: E402

SCENARIOS = ("cold_start", "scale_up", "burst", "scale_in", "hard_loss", "loss_during_rdzv", "etcd_restart")
BASELINE = "torchrun-etcd"


class Miss(Exception):
    """A scenario could not reach its measurement point; the message is the note."""


# ---- scenario building blocks ---------------------------------------------------------------
def bring_up(run: Run, n: int, timeout: float) -> tuple[list[Node], float]:
    """Start ``n`` nodes at once; wait until all step at world ``n`` and a checkpoint exists.

    Returns the nodes and the seconds from the first start to the first step at full size.
    """
    t0 = time.monotonic()
    nodes = [run.add_node() for _ in range(n)]
    t_full, note = run.wait_stepping(nodes, n, t0, timeout)
    if t_full is None:
        raise Miss(f"cold start of {n}: {note}")
    # steady state: a few steps at full size and a checkpoint on disk (a resume point)
    _, note = run.wait_stepping(nodes, n, t0, timeout, min_steps=5)
    if note or not poll(lambda: (run.ckpt_dir / "latest").exists(), timeout):
        raise Miss(f"steady state of {n}: {note or 'no checkpoint written'}")
    # inject the event mid-way between checkpoints, not right after one: a fault at a
    # random moment loses on average half an interval, and the figure should show it
    offset = run.cfg.checkpoint_every // 2

    def mid_interval() -> bool:
        try:
            ck = json.loads((run.ckpt_dir / "latest").read_text())["step"]
        except (OSError, ValueError, KeyError):
            return False
        return run.max_step() % run.cfg.checkpoint_every >= offset and run.max_step() >= ck + offset

    if not poll(mid_interval, timeout, 0.01):
        raise Miss(f"timeout {timeout:.0f}s waiting for a step {offset} after a checkpoint")
    return nodes, t_full - t0


def after_event(run: Run, survivors: list[Node], world: int, t0: float, timeout: float) -> dict[str, Any]:
    t, note = run.wait_stepping(survivors, world, t0, timeout)
    if t is None:
        raise Miss(note or "no resume")
    return {"seconds": t - t0, "steps_lost": run.steps_lost(survivors, world, t0)}


def sc_cold_start(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    _, secs = bring_up(run, a.nodes, a.timeout)
    return {"seconds": secs, "steps_lost": None, "nodes": a.nodes}


def _scale_up(run: Run, a: argparse.Namespace, k: int) -> dict[str, Any]:
    nodes, _ = bring_up(run, 2, a.timeout)
    new = [run.add_node() for _ in range(k - 2)]
    t0 = min(n.started for n in new)
    out = after_event(run, nodes + new, k, t0, a.timeout)
    return {**out, "nodes": k}


def sc_scale_up(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    return _scale_up(run, a, 3)


def sc_burst(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    return _scale_up(run, a, a.burst)


def sc_scale_in(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    nodes, _ = bring_up(run, 3, a.timeout)
    leaving, survivors = nodes[-1], nodes[:-1]
    t0 = run.terminate_node(leaving)
    out = after_event(run, survivors, 2, t0, a.timeout)
    poll(lambda: not leaving.alive(), 30)
    out["leaver_rc"] = leaving.proc.returncode
    return out


def sc_hard_loss(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    nodes, _ = bring_up(run, 3, a.timeout)
    t0 = run.kill_node(nodes[-1])
    return after_event(run, nodes[:-1], 2, t0, a.timeout)


def sc_loss_during_rdzv(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    """3 nodes run; a 4th joins; when the old ranks stop stepping (re-rendezvous), kill node 1."""
    nodes, _ = bring_up(run, 3, a.timeout)
    new = run.add_node()
    stall = max(0.6, 10 * a.step_time)

    def rdzv_started() -> float | None:
        last = max(n.last_t() for n in nodes)
        return last if last > new.started and time.monotonic() - last > stall else None

    t_stop = poll(rdzv_started, a.timeout, 0.02)
    if t_stop is None:
        raise Miss(f"timeout {a.timeout:.0f}s: the join never stopped the running ranks")
    victim = nodes[0]
    t0 = run.kill_node(victim)
    survivors = nodes[1:] + [new]
    out = after_event(run, survivors, 3, t0, a.timeout)
    out["join_to_rdzv"] = t_stop - new.started
    out["kill_after_rdzv_start"] = t0 - t_stop
    return out


def sc_etcd_restart(run: Run, a: argparse.Namespace) -> dict[str, Any]:
    """2 nodes run; SIGKILL etcd, restart it on the same port + data dir; watch ``--settle`` s."""
    nodes, _ = bring_up(run, 2, a.timeout)
    t0, t_back = run.restart_etcd()
    end = t_back + a.settle
    poll(lambda: time.monotonic() >= end or not any(n.alive() for n in nodes), a.settle + 5, 0.1)
    end = time.monotonic()
    dead = [n for n in nodes if not n.alive()]
    if dead:
        raise Miss(
            f"agents exited after the etcd restart ({', '.join(f'{n.name} rc={n.proc.returncode}' for n in dead)})"
        )
    gap = max(1.0, 10 * a.step_time)
    resume_ts, lost = [], []
    for n in nodes:
        before = [s for s in n.steps if s[0] <= t0]
        after = [s for s in n.steps if t0 < s[0] <= end]
        if not after or after[-1][0] < end - max(3.0, gap):
            raise Miss(f"{n.name} not stepping {a.settle:.0f}s after etcd came back")
        prev = before[-1] if before else None
        brk = None
        for s in after:
            if prev is None or s[2] != prev[2] or s[1] != prev[1] + 1 or s[0] - prev[0] > gap:
                brk = (s, prev)
            prev = s
        if brk is None:
            resume_ts.append(after[0][0])
            lost.append(0)
        else:
            s, p = brk
            resume_ts.append(s[0])
            reached = max(x[1] for m in nodes for x in m.steps if x[0] < s[0])
            lost.append(max(0, reached - s[1] + 1))
    return {
        "seconds": max(resume_ts) - t0,
        "steps_lost": max(lost),
        "etcd_down": t_back - t0,
        "restarted_workers": any(x > 0 for x in lost) or max(resume_ts) - t0 > gap,
    }


SCENARIO_FUNCS: dict[str, Callable[[Run, argparse.Namespace], dict[str, Any]]] = {
    "cold_start": sc_cold_start,
    "scale_up": sc_scale_up,
    "burst": sc_burst,
    "scale_in": sc_scale_in,
    "hard_loss": sc_hard_loss,
    "loss_during_rdzv": sc_loss_during_rdzv,
    "etcd_restart": sc_etcd_restart,
}


def run_one(scenario: str, tool: str, rep: int, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One repetition of one scenario with one tool; never raises."""
    cfg = RunConfig(
        tool=tool, min_nodes=2, max_nodes=8, step_time=a.step_time, checkpoint_every=a.checkpoint_every,
        job=f"b-{scenario.replace('_', '-')}",
    )  # fmt: skip
    run = Run(root / f"{scenario}-{tool}-{rep}", cfg)
    waited, busy = wait_idle(a.idle_wait) if a.idle_wait > 0 else (0.0, cpu_busy())
    rec: dict[str, Any] = {
        "scenario": scenario, "tool": tool, "rep": rep, "load": os.getloadavg()[0],
        "cpu_busy_before": round(busy, 2), "idle_wait": round(waited, 1),
    }  # fmt: skip
    t = time.monotonic()
    try:
        run.start()
        rec.update(SCENARIO_FUNCS[scenario](run, a))
    except Miss as e:
        rec.update(seconds=None, steps_lost=None, note=str(e))
    except Exception as e:  # noqa: BLE001 - a broken tool is a result too
        rec.update(seconds=None, steps_lost=None, note=f"error: {type(e).__name__}: {e}")
    finally:
        left = run.close()
        rec["wall"] = round(time.monotonic() - t, 1)
        rec["left_running_at_end"] = len(left)
        if not a.keep:
            shutil.rmtree(run.root, ignore_errors=True)
    for k, v in list(rec.items()):
        if isinstance(v, float):
            rec[k] = round(v, 3)
    return rec


# ---- CLI start-up ------------------------------------------------------------------------------
def _stop_local_cloud(petctl: str, env: dict[str, str], state_dir: str) -> None:
    """Stop the local cloud ``petctl --local`` started for the timing, then any straggler of it."""
    try:
        subprocess.run([petctl, "--local", "local", "stop"], env=env, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pass
    # only processes whose command line names our private state dir: ours, by pid
    mine = [int(d) for d in os.listdir("/proc") if d.isdigit() and state_dir in cmdline(int(d))]
    kill_pids([p for p in mine if p != os.getpid()])


def time_cli(runs: int) -> list[dict[str, Any]]:
    """Median wall time of ``petctl --help`` and ``petctl --local status`` vs ``python -c pass``.

    ``petctl --local`` starts the embedded local cloud on first use: the first
    ``status`` run is reported apart (cold) and the median is over the others.
    """
    petctl = str(BIN / "petctl") if (BIN / "petctl").exists() else (shutil.which("petctl") or "petctl")
    home = tempfile.mkdtemp(prefix="bench-petctl-home-")
    state_dir = os.path.join(home, "local")
    env = {
        **os.environ, "PETCTL_HOME": home, "PETCTL_LOCAL_DIR": state_dir,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
    }  # fmt: skip
    cmds = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "petctl --help": [petctl, "--help"],
        "petctl --local status bench-job": [petctl, "--local", "status", "bench-job"],
    }
    out: list[dict[str, Any]] = []
    base = None
    try:
        for label, cmd in cmds.items():
            times, rc, tail = [], None, ""
            for _ in range(runs + (1 if "--local" in cmd else 0)):
                t = time.monotonic()
                try:
                    p = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
                    rc, tail = p.returncode, (p.stderr or p.stdout).decode(errors="replace").strip()
                except subprocess.TimeoutExpired:
                    rc, tail = None, "timeout 60s"
                times.append(time.monotonic() - t)
            note = "" if rc == 0 else f"rc={rc}: {tail.splitlines()[-1][:160] if tail else ''}"
            if "--local" in cmd:
                note = (
                    f"first run (starts the local cloud) {times[0]:.2f}s, median of the next {runs}. {note}"
                )
                times = times[1:]
            med = statistics.median(times)
            base = base or med
            out.append(
                {
                    "command": label,
                    "median_s": round(med, 3),
                    "ratio": round(med / base, 2),
                    "runs": runs,
                    "note": note,
                }
            )
    finally:
        _stop_local_cloud(petctl, env, state_dir)
        shutil.rmtree(home, ignore_errors=True)
    return out


# ---- summary -----------------------------------------------------------------------------------
def summarize(
    records: list[dict[str, Any]], scenarios: list[str], tools: list[str], a: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for sc in scenarios:
        med: dict[str, float | None] = {}
        for tool in tools:
            recs = [r for r in records if r["scenario"] == sc and r["tool"] == tool]
            if not recs:
                continue
            ok = [r for r in recs if r.get("seconds") is not None]
            secs = statistics.median(r["seconds"] for r in ok) if ok else None
            lost_vals = [r["steps_lost"] for r in ok if r.get("steps_lost") is not None]
            lost = statistics.median(lost_vals) if lost_vals else None
            notes = sorted({r["note"] for r in recs if r.get("note")})
            note = "; ".join(notes)
            if ok and len(ok) < len(recs):
                note = f"{len(recs) - len(ok)}/{len(recs)} reps failed: {note}"
            skipped = sum(1 for r in recs if r.get("skipped"))
            if skipped:
                note += f" (hang reproduced; {skipped} further rep(s) skipped)"
            if sc == "burst":
                note = (f"2->{a.burst} nodes. " + note).strip()
            if sc == "cold_start":
                note = (f"{a.nodes} nodes. " + note).strip()
            med[tool] = secs
            rows.append({
                "scenario": sc, "tool": tool, "seconds": None if secs is None else round(secs, 2),
                "steps_lost": lost, "reps": len(ok), "attempts": len([r for r in recs if not r.get("skipped")]),
                "note": note,
            })  # fmt: skip
        base = med.get(BASELINE)
        baseline_note = next((r["note"] for r in rows if r["scenario"] == sc and r["tool"] == BASELINE), "")
        for row in rows:
            if row["scenario"] != sc:
                continue
            s = row["seconds"]
            if s is not None and base:
                row["ratio"] = round(s / base, 3)
            elif s is not None and BASELINE in med and base is None and "timeout" in baseline_note:
                # baseline timed out: the ratio is at most s / timeout
                row["ratio"] = f"<{s / a.timeout:.3f}"
            else:
                row["ratio"] = None
    return rows


def markdown(rows: list[dict[str, Any]], cli: list[dict[str, Any]]) -> str:
    def f(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:g}" if v == int(v) else f"{v:.2f}"
        return str(v)

    lines = [
        f"| scenario | tool | median s | steps lost | ratio to {BASELINE} | reps | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = r.get("ratio")
        ratio_s = f"{ratio:.3f}" if isinstance(ratio, float) else f(ratio)
        lines.append(
            f"| {r['scenario']} | {r['tool']} | {f(r['seconds'])} | {f(r['steps_lost'])} | {ratio_s} | "
            f"{r['reps']}/{r['attempts']} | {r['note'].replace('|', '/')} |"
        )
    if cli:
        lines += [
            "",
            "| command | median s | ratio to `python -c pass` | runs | note |",
            "|---|---:|---:|---:|---|",
        ]
        for c in cli:
            lines.append(
                f"| `{c['command']}` | {c['median_s']:.3f} | {c['ratio']:.2f} | {c['runs']} | {c['note'].replace('|', '/')} |"
            )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------
def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions per (scenario, tool); median reported")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--json", type=Path, help="write all records + the summary here")
    p.add_argument(
        "--baseline-reps", type=int, default=None, help="reps for the torchrun tools (default: --reps)"
    )
    p.add_argument("--idle-wait", type=float, default=180,
                   help="before each run wait up to this many s for other load to stop (0: don't)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=120, help="bound of every wait, seconds")
    p.add_argument("--nodes", type=int, default=3, help="nodes in the cold-start scenario")
    p.add_argument("--burst", type=int, default=6, help="target size of the 2->k burst scale-up")
    p.add_argument("--step-time", type=float, default=0.05, help="extra sleep per training step")
    p.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint interval in steps")
    p.add_argument("--settle", type=float, default=15, help="seconds watched after etcd comes back")
    p.add_argument("--cli-runs", type=int, default=7, help="runs per CLI start-up timing (0: skip)")
    p.add_argument("--no-skip-hangs", action="store_true", help="repeat a (scenario, tool) after a timeout")
    p.add_argument("--render", type=Path, help="only print the tables of an existing --json file")
    p.add_argument("--keep", action="store_true", help="keep run directories (logs) under --workdir")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="run inside a private loopback-only network namespace (unshare --net)")  # fmt: skip
    a = p.parse_args(argv)
    a.scenario_list = _csv(a.scenarios, SCENARIOS, "scenario")
    a.tool_list = _csv(a.tools, TOOLS, "tool")
    if not 3 <= a.burst <= 8:
        p.error("--burst must be within 3..8 (max nodes is 8)")
    return a


def _reexec_in_netns(argv: list[str]) -> int | None:
    """Re-run this script in a new network namespace with only loopback up; None if impossible."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip or os.environ.get("BENCH_IN_NETNS"):
        return None
    probe = subprocess.run([unshare, "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    env = {**os.environ, "BENCH_IN_NETNS": "1"}
    cmd = [unshare, "--net", "--", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh",
           sys.executable, os.path.abspath(__file__), *argv]  # fmt: skip
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.render:
        doc = json.loads(a.render.read_text())
        cfg = argparse.Namespace(**{**vars(a), **doc["config"]})
        rows = summarize(doc["records"], cfg.scenario_list, cfg.tool_list, cfg)
        print(markdown(rows, doc.get("cli", [])))
        return 0
    if a.netns != "off" and not os.environ.get("BENCH_IN_NETNS"):
        rc = _reexec_in_netns(argv)
        if rc is not None:
            return rc
        if a.netns == "on":
            print("cannot create a network namespace (unshare --net)", file=sys.stderr)
            return 2
    root = a.workdir or Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    root.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    started = time.time()

    def write_json(rows: list[dict[str, Any]], cli: list[dict[str, Any]], complete: bool) -> None:
        if not a.json:
            return
        doc = {
            "command": "python scripts/bench_elastic.py " + " ".join(argv),
            "complete": complete,
            "started": started,
            "wall_s": round(time.time() - started, 1),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "netns": bool(os.environ.get("BENCH_IN_NETNS")),
            },
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "summary": rows,
            "cli": cli,
            "records": records,
        }
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        os.replace(tmp, a.json)

    def reps_for(tool: str) -> int:
        return a.reps if tool == "petctl" or a.baseline_reps is None else a.baseline_reps

    # reps outermost: every (scenario, tool) gets its first rep before any gets a second,
    # so an interrupted run still has the whole table (JSON is rewritten after each run)
    for rep in range(1, max(reps_for(t) for t in a.tool_list) + 1):
        for sc in a.scenario_list:
            for tool in a.tool_list:
                if rep > reps_for(tool):
                    continue
                prev = [r for r in records if r["scenario"] == sc and r["tool"] == tool]
                if not a.no_skip_hangs and any("timeout" in (r.get("note") or "") for r in prev):
                    records.append({"scenario": sc, "tool": tool, "rep": rep, "skipped": True})
                    continue
                rec = run_one(sc, tool, rep, a, root)
                records.append(rec)
                print(
                    f"# {sc:17s} {tool:17s} rep {rep}: seconds={rec.get('seconds')} "
                    f"lost={rec.get('steps_lost')} busy={rec['cpu_busy_before']} wall={rec['wall']}s {rec.get('note') or ''}",
                    file=sys.stderr,
                    flush=True,
                )
                write_json(summarize(records, a.scenario_list, a.tool_list, a), [], False)
    cli = time_cli(a.cli_runs) if a.cli_runs > 0 else []
    rows = summarize(records, a.scenario_list, a.tool_list, a)
    print(markdown(rows, cli))
    write_json(rows, cli, True)
    if not a.keep and a.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
