#!/usr/bin/env python
"""Elasticity benchmark: petctl's agent (petctl-etcd, and on the etcd-v2 fallback) vs plain torchrun.

Every run gets its own real etcd 3.5 (``--enable-v2``) on a free 127.0.0.1 port
and N "nodes", each a process group bound to its own 127.0.0.x address, all
running ``scripts/elastic_train.py`` (``--nnodes 2:8``, one worker per node,
gloo). Tools:

- ``petctl``: ``petctl-agent run`` exactly as production configures it (only the
  local-cloud plumbing -- IMDS URL, EFS dir, agent dir -- is set): rendezvous petctl-etcd;
- ``petctl-live``: the same agent with the job spec's ``live`` (``run-job --live``): every node's
  worker is a torchft replica group running ``examples/live_train.py``, a lighthouse runs beside
  etcd, and no change restarts a survivor. Its "loss during a re-rendezvous" is a loss while the
  newcomer joins (its workers started, not yet stepping): live workers never stop for a join;
- ``petctl-etcd-v2``: the same agent with the job spec's ``rdzv_backend: etcd-v2``
  (torch's handler plus the agent's workarounds: the fallback);
- ``torchrun-etcd``: ``torchrun --rdzv-backend etcd`` with torch's defaults;
- ``torchrun-etcd-v2``: ``torchrun --rdzv-backend etcd-v2`` with torch's defaults.

Per rep and tool, two runs. **chain**: a job's life, each step from the previous steady
state (a checkpoint on disk, a step mid-way between checkpoints): cold start of 3 ->
SIGTERM drain of one (3->2) -> a join (2->3) -> SIGKILL of a node tree (3->2) -> a join
(not measured) -> a 4th joins and a running node is SIGKILLed as soon as the running
ranks stop for the re-rendezvous (-> 3). **burst**: 2 run, then 4 start at once (2->6);
the petctl agents see a worker group (an Auto Scaling look-alike) whose desired capacity
goes 2 -> 6 first, as on AWS (``--no-hint``: none).

Times come from the example's ``step=<n> world_size=<w>`` lines, timestamped as they
are read. For joins, drains and the burst the number is the **stall**: from the last step
any rank printed at the old size to every rank having printed a step at the new size (a
newcomer's boot, while the others train on, is not a stall; its time from the process
start is in ``from_event``). Hard losses: from the SIGKILL to every survivor stepping. Cold
start: from the first agent's start to all 3 stepping. Steps lost = last step any rank
reached before training resumed - first step after the resume + 1 (clamped at 0).
Burst rounds = distinct world sizes the old ranks trained at on the way (1 = one round).
Every wait is bounded (``--timeout`` after an event, ``--start-timeout`` for starts); a
timeout is a result (reported as a hang, and counted as +inf in the median), not a crash;
a chain that hangs reports its later steps as not reached.

By default the whole benchmark runs in a private network namespace with only
loopback up (``unshare --net``): plain torchrun binds its stores to the
wildcard address, and here that wildcard then means 127.0.0.0/8 only.

Examples::

    python bench/bench_elastic.py --reps 3 --json bench.json --keep --workdir /tmp/bench
    python bench/bench_elastic.py --reps 1 --scenarios burst --tools petctl
    python bench/bench_elastic.py --render bench.json
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
from benchlib import (  # noqa: E402
    BIN,
    LIVE,
    LIVE_SCRIPT,
    TOOLS,
    Node,
    Run,
    RunConfig,
    cmdline,
    cpu_busy,
    kill_pids,
    poll,
    wait_idle,
)

#: what a rep measures, in the order it happens: one "chain" run (a job's life: cold start,
#: drain, join, hard loss, a loss during a re-rendezvous) and one "burst" run per tool
SCENARIOS = ("cold_start", "scale_up", "burst", "scale_in", "hard_loss", "loss_during_rdzv")
CHAIN = ("cold_start", "scale_in", "scale_up", "hard_loss", "loss_during_rdzv")
BASELINE = "torchrun-etcd"


class Miss(Exception):
    """A scenario could not reach its measurement point; the message is the note."""


# ---- scenario building blocks ---------------------------------------------------------------
#: steps at a size before the next change when nothing checkpoints periodically (``steady``)
STEADY_STEPS_NO_CKPT = 150


def steady(run: Run, nodes: list[Node], world: int, timeout: float) -> None:
    """Wait for a few steps at ``world``, a checkpoint on disk, and a step mid-way between
    checkpoints: a fault at a random moment loses on average half an interval."""
    if run.cfg.checkpoint_every <= 0:
        # snapshots only at membership changes (``--checkpoint-every 0``): no interval to wait for,
        # but a job trains a while between changes: the start's background work (a restore's
        # spares, the first snapshot's files) is done before the next change, as it would be
        _, note = run.wait_stepping(nodes, world, 0, timeout, min_steps=STEADY_STEPS_NO_CKPT)
        if note:
            raise Miss(f"steady state of {world}: {note}")
        return
    _, note = run.wait_stepping(nodes, world, 0, timeout, min_steps=5)
    if note or not poll(lambda: (run.ckpt_dir / "latest").exists(), timeout):
        raise Miss(f"steady state of {world}: {note or 'no checkpoint written'}")
    every = run.cfg.checkpoint_every
    offset = every // 2
    start = run.max_step()

    def mid_interval() -> bool:
        try:
            ck = json.loads((run.ckpt_dir / "latest").read_text())["step"]
        except (OSError, ValueError, KeyError):
            return False
        m = run.max_step()
        return m > start and m % every >= offset and m >= ck + offset

    if not poll(mid_interval, timeout, 0.01):
        raise Miss(f"timeout {timeout:.0f}s waiting for a step {offset} after a checkpoint")


#: agent events, in the order a membership change goes through them (the phases)
PHASE_EVENTS = ("workers_ready", "drain_requested", "workers_failed", "rendezvous_start", "rendezvous_done",
                "workers_started")  # fmt: skip


def phases(
    run: Run, nodes: list[Node], t0: float, world: int, extra: list[Node] = ()
) -> dict[str, float] | None:
    """petctl tools: where the time of a change went, from the agents' own status events.

    Seconds from the event ``t0`` (monotonic) to the *latest* node's first event of each kind
    after it, plus ``last_old_step`` (the last step any of ``nodes`` printed at another world
    size) and ``first_step`` (every node stepping at ``world``). None for torchrun.
    """
    if run.imds is None:
        return None
    offset = time.time() - time.monotonic()  # status events carry time.time()
    out: dict[str, float] = {}
    for kind in PHASE_EVENTS:
        ts = []
        for n in [*nodes, *extra]:
            evs = [e["t"] - offset for e in (run.status(n) or {}).get("events", []) if e.get("kind") == kind]
            evs = [t for t in evs if t > t0 - 0.05]
            if evs:
                ts.append(min(evs))
        if ts:
            out[kind] = round(max(ts) - t0, 3)
    firsts = [n.steps_after(t0, world) for n in nodes]
    if all(firsts):
        t_first = min(f[0][0] for f in firsts)
        lasts = [x[0] for n in nodes for x in list(n.steps) if x[0] < t_first and x[2] != world]
        if lasts:
            out["last_old_step"] = round(max(lasts) - t0, 3)
        out["first_step"] = round(max(f[0][0] for f in firsts) - t0, 3)
    return out


def measure(run: Run, old: list[Node], survivors: list[Node], world: int, t0: float, a: argparse.Namespace,
            stall: bool = True, extra: list[Node] = ()) -> dict[str, Any]:  # fmt: skip
    """Wait until every survivor steps at ``world``; the stall (last step at the old size ->
    every rank stepping at the new one), the time from the event, steps lost, phases."""
    t, note = run.wait_stepping(survivors, world, t0, a.timeout)
    if t is None:
        raise Miss(note or "no resume")
    out: dict[str, Any] = {"from_event": t - t0, "steps_lost": run.steps_lost(survivors, world, t0)}
    out["seconds"] = run.stall(old, survivors, world, t0) if stall else out["from_event"]
    time.sleep(0.3)  # the status documents follow the step lines by a publish
    ph = phases(run, survivors, t0, world, extra)
    if ph:
        out["phases"] = ph
    return out


def run_chain(run: Run, a: argparse.Namespace, rec: Callable[..., None]) -> None:
    """cold start of 3 -> drain one (3->2) -> a join (2->3) -> SIGKILL one (3->2) -> another
    join (2->3, not measured) -> a 4th joins and a running node is SIGKILLed as soon as the
    running ranks stop for the re-rendezvous (-> 3). Each step from the previous steady state."""
    t0 = time.monotonic()
    nodes = [run.add_node() for _ in range(3)]
    t, note = run.wait_stepping(nodes, 3, t0, a.start_timeout)
    if t is None:
        raise Miss(f"cold start of 3: {note}")
    if a.chain_from == "hard_loss":  # a chain that hung earlier: start from 3 nodes at this step
        return _chain_hard_loss(run, a, rec, nodes)
    if a.chain_from == "loss_during_rdzv":
        return _chain_loss_during_rdzv(run, a, rec, nodes)
    rec("cold_start", seconds=t - t0, from_event=t - t0, steps_lost=None)
    steady(run, nodes, 3, a.timeout)

    leaving, live = nodes[2], nodes[:2]
    t0 = run.terminate_node(leaving)
    r = measure(run, nodes, live, 2, t0, a, extra=[leaving])
    poll(lambda: not leaving.alive(), 30)
    rec("scale_in", **r, leaver_rc=leaving.proc.returncode)
    steady(run, live, 2, a.timeout)

    new = run.add_node()
    r = measure(run, live, live + [new], 3, new.started, a)
    rec("scale_up", **r)
    live = live + [new]
    _chain_hard_loss(run, a, rec, live)


def lose(run: Run, node: Node, a: argparse.Namespace) -> float:
    """A hard loss (``--loss``): ``kill``, SIGKILL of the node's tree (its sockets get a RST: the
    survivors' collectives fail at once, as in the local cloud); ``vanish``, SIGSTOP of the tree
    (no RST: the survivors' collectives hang, as when a real instance vanishes)."""
    return run.vanish_node(node) if a.loss == "vanish" else run.kill_node(node)


def _chain_hard_loss(run: Run, a: argparse.Namespace, rec: Callable[..., None], live: list[Node]) -> None:
    steady(run, live, 3, a.timeout)
    victim = live[0]
    t0 = lose(run, victim, a)
    r = measure(run, live, live[1:], 2, t0, a, stall=False)
    run.kill_node(victim)  # a vanished tree: its instance is terminated later
    rec("hard_loss", **r, loss=a.loss)
    live = live[1:]
    steady(run, live, 2, a.timeout)

    new = run.add_node()
    run.wait_stepping(live + [new], 3, new.started, a.timeout)
    _chain_loss_during_rdzv(run, a, rec, live + [new])


def _chain_loss_during_rdzv(
    run: Run, a: argparse.Namespace, rec: Callable[..., None], live: list[Node]
) -> None:
    steady(run, live, 3, a.timeout)
    new = run.add_node()
    quiet = max(0.3, 6 * a.step_time)

    def newcomer_started() -> float | None:
        """Live: the running workers never stop for a join; the loss comes while the newcomer
        joins (its workers started, before its first step: it is healing from a peer)."""
        evs = [e for e in (run.status(new) or {}).get("events", []) if e.get("kind") == "workers_started"]
        return time.monotonic() if evs else None

    def rdzv_started() -> float | None:
        last = max(n.last_t() for n in live)
        return last if last > new.started and time.monotonic() - last > quiet else None

    t_stop = poll(newcomer_started if run.cfg.tool == LIVE else rdzv_started, a.start_timeout, 0.01)
    if t_stop is None:
        raise Miss(f"timeout {a.start_timeout:.0f}s: the join never stopped the running ranks")
    victim = live[0]
    t0 = lose(run, victim, a)
    r = measure(run, live, live[1:] + [new], 3, t0, a, stall=False)
    run.kill_node(victim)
    rec(
        "loss_during_rdzv",
        **r,
        join_to_rdzv=t_stop - new.started,
        kill_after_rdzv_start=t0 - t_stop,
        loss=a.loss,
    )


def run_burst(run: Run, a: argparse.Namespace, rec: Callable[..., None]) -> None:
    """2 nodes run; the worker group's desired capacity goes to ``--burst``; that many - 2 start
    at once. Rounds = distinct world sizes the old ranks trained at on the way (1 = one round)."""
    if run.asg is not None:
        run.asg.desired = 2
    t0 = time.monotonic()
    nodes = [run.add_node() for _ in range(2)]
    t, note = run.wait_stepping(nodes, 2, t0, a.start_timeout)
    if t is None:
        raise Miss(f"start of 2: {note}")
    steady(run, nodes, 2, a.timeout)
    if run.asg is not None:
        run.asg.desired = a.burst
    new = [run.add_node() for _ in range(a.burst - 2)]
    t0 = min(n.started for n in new)
    r = measure(run, nodes, nodes + new, a.burst, t0, a)
    worlds = {s[2] for n in nodes for s in n.steps_after(t0)}
    rec("burst", **r, rounds=len(worlds - {2}), worlds=sorted(worlds))


def run_one(kind: str, tool: str, rep: int, a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """One run (``chain`` or ``burst``) with one tool; one record per measured scenario; never raises."""
    cfg = RunConfig(
        tool=tool, min_nodes=2, max_nodes=8, step_time=a.step_time, checkpoint_every=a.checkpoint_every,
        job=f"b-{kind}", worker_group=kind == "burst" and not a.no_hint,
    )  # fmt: skip
    if tool == LIVE:  # examples/live_train.py: the state lives in the peers, no periodic checkpoint
        cfg.script, cfg.checkpoint_every = LIVE_SCRIPT, 0
    run = Run(root / f"{kind}-{tool}-{rep}", cfg)
    waited, busy = wait_idle(a.idle_wait) if a.idle_wait > 0 else (0.0, cpu_busy())
    base = {"tool": tool, "rep": rep, "cpu_busy_before": round(busy, 2), "idle_wait": round(waited, 1)}
    out: list[dict[str, Any]] = []

    def rec(scenario: str, **kw: Any) -> None:
        out.append({"scenario": scenario, **base, "load": os.getloadavg()[0], **kw})

    wanted = CHAIN[CHAIN.index(a.chain_from) :] if kind == "chain" else ("burst",)
    t = time.monotonic()
    try:
        run.start()
        (run_chain if kind == "chain" else run_burst)(run, a, rec)
    except Miss as e:
        note = str(e)
    except Exception as e:  # noqa: BLE001 - a broken tool is a result too
        note = f"error: {type(e).__name__}: {e}"
    else:
        note = ""
    finally:
        left = run.close()
        if not a.keep:
            shutil.rmtree(run.root, ignore_errors=True)
    done = {r["scenario"] for r in out}
    missed = [sc for sc in wanted if sc not in done]
    for i, sc in enumerate(missed):
        why = note if i == 0 else f"not reached: the run stopped at {missed[0]} ({note[:80]})"
        rec(sc, seconds=None, steps_lost=None, note=why)
    for r in out:
        r["wall"] = round(time.monotonic() - t, 1)
        r["left_running_at_end"] = len(left)
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 3)
    return out


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
def _median(recs: list[dict[str, Any]], key: str, timeout: float) -> float | None:
    """Median over reps; a rep that hit the wait bound counts as +inf (so a hang in most reps
    is the median); reps that never got to the measurement for another reason are left out."""
    vals = []
    for r in recs:
        v = r.get(key)
        if v is not None:
            vals.append(float(v))
        elif "timeout" in (r.get("note") or "") and not (r.get("note") or "").startswith("not reached"):
            vals.append(float("inf"))
    return statistics.median(vals) if vals else None


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
            secs = _median(recs, "seconds", a.timeout)
            lost_vals = [r["steps_lost"] for r in ok if r.get("steps_lost") is not None]
            rounds = [r["rounds"] for r in ok if r.get("rounds") is not None]
            notes = sorted({r["note"] for r in recs if r.get("note")})
            note = "; ".join(notes)
            if ok and len(ok) < len(recs):
                note = f"{len(recs) - len(ok)}/{len(recs)} reps failed: {note}"
            if sc == "burst":
                note = (f"2->{a.burst} nodes. " + note).strip()
            med[tool] = secs
            rows.append({
                "scenario": sc, "tool": tool, "seconds": None if secs is None else round(secs, 2),
                "from_event": None if _median(recs, "from_event", a.timeout) is None
                else round(_median(recs, "from_event", a.timeout), 2),
                "steps_lost": statistics.median(lost_vals) if lost_vals else None,
                "rounds": statistics.median(rounds) if rounds else None,
                "per_rep": [r.get("seconds") for r in recs],
                "load": [r.get("load") for r in recs],
                "reps": len(ok), "attempts": len(recs), "note": note,
            })  # fmt: skip
        base = med.get(BASELINE)
        for row in rows:
            if row["scenario"] != sc:
                continue
            s = row["seconds"]
            if s is None or s == float("inf"):
                row["ratio"] = None
            elif base is not None and base == float("inf"):
                row["ratio"] = f"<{s / a.timeout:.3f}"  # the baseline hung: at most s / bound
            elif base:
                row["ratio"] = round(s / base, 3)
            else:
                row["ratio"] = None
    return rows


WHAT = {
    "cold_start": "first agent start -> all 3 stepping",
    "scale_up": "stall: last step at 2 -> all 3 stepping",
    "burst": "stall: last step at 2 -> all 6 stepping",
    "scale_in": "stall: last step at 3 -> both stepping at 2",
    "hard_loss": "SIGKILL (--loss vanish: SIGSTOP) -> both survivors stepping",
    "loss_during_rdzv": "SIGKILL (--loss vanish: SIGSTOP) -> 3 survivors stepping",
}


def phase_table(records: list[dict[str, Any]], scenarios: list[str], tools: list[str]) -> str:
    """Median seconds from the event to each agent event (the latest node's), petctl tools only."""
    cols = ("workers_ready", "drain_requested", "last_old_step", "workers_failed", "rendezvous_start",
            "rendezvous_done", "workers_started", "first_step")  # fmt: skip
    lines = [
        "| scenario | tool | " + " | ".join(cols) + " | reps |",
        "|---|---|" + "---:|" * (len(cols) + 1),
    ]
    for sc in scenarios:
        for tool in tools:
            phs = [
                r["phases"] for r in records if r["scenario"] == sc and r["tool"] == tool and r.get("phases")
            ]
            if not phs:
                continue
            cells = []
            for c in cols:
                vals = [p[c] for p in phs if c in p]
                cells.append(f"{statistics.median(vals):.2f}" if vals else "—")
            lines.append(f"| {sc} | {tool} | " + " | ".join(cells) + f" | {len(phs)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def markdown(rows: list[dict[str, Any]], cli: list[dict[str, Any]], a: argparse.Namespace) -> str:
    def f(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            if v == float("inf"):
                return f"> {a.timeout:g} (hang)"
            return f"{v:g}" if v == int(v) else f"{v:.2f}"
        return str(v)

    lines = [
        f"| scenario (what the seconds are) | tool | median s | from the event | steps lost | rounds "
        f"| ratio to {BASELINE} | reps | per rep (s) | load avg | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        ratio = r.get("ratio")
        ratio_s = f"{ratio:.3f}" if isinstance(ratio, float) else f(ratio)
        per = " / ".join(f(x) for x in r["per_rep"])
        loads = [x for x in r["load"] if x is not None]
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"
        lines.append(
            f"| {r['scenario']} ({WHAT.get(r['scenario'], '')}) | {r['tool']} | {f(r['seconds'])} | "
            f"{f(r['from_event'])} | {f(r['steps_lost'])} | {f(r['rounds'])} | {ratio_s} | "
            f"{r['reps']}/{r['attempts']} | {per} | {load} | {r['note'].replace('|', '/')} |"
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
    p.add_argument("--reps", type=int, default=3, help="repetitions per tool; median reported")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma list of {', '.join(SCENARIOS)} (any of the chain runs the whole chain)")  # fmt: skip
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--json", type=Path, help="write all records + the summary here (after every run)")
    p.add_argument("--idle-wait", type=float, default=0,
                   help="before each run wait up to this many s for other load to stop (0: don't)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=90, help="bound of every wait after an event, seconds")
    p.add_argument("--start-timeout", type=float, default=150, help="bound of a (cold) start, seconds")
    p.add_argument("--burst", type=int, default=6, help="target size of the 2->k burst scale-up")
    p.add_argument("--no-hint", action="store_true",
                   help="burst: no worker group (petctl gets no desired-capacity hint)")  # fmt: skip
    p.add_argument("--step-time", type=float, default=0.05, help="extra sleep per training step")
    p.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint interval in steps")
    p.add_argument("--chain-from", choices=("cold_start", "hard_loss", "loss_during_rdzv"), default="cold_start",
                   help="start the chain at this scenario (from a cold start of 3 that is not reported): "
                   "for a tool whose chain hangs before it")  # fmt: skip
    p.add_argument("--loss", choices=("kill", "vanish"), default="kill",
                   help="the hard losses: kill = SIGKILL the node's tree (RST: collectives fail); vanish = "
                   "SIGSTOP it (no RST: collectives hang, as a real instance that vanishes)")  # fmt: skip
    p.add_argument("--cli-runs", type=int, default=0, help="runs per CLI start-up timing (0: skip)")
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
        print(markdown(rows, doc.get("cli", []), cfg))
        print()
        print(phase_table(doc["records"], cfg.scenario_list, cfg.tool_list))
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
            "command": "python bench/bench_elastic.py " + " ".join(argv),
            "complete": complete,
            "started": started,
            "wall_s": round(time.time() - started, 1),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "netns": bool(os.environ.get("BENCH_IN_NETNS")),
                "loadavg_now": os.getloadavg(),
            },
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "summary": rows,
            "cli": cli,
            "records": records,
        }
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str))
        os.replace(tmp, a.json)

    kinds = [k for k, scs in (("chain", CHAIN), ("burst", ("burst",))) if set(scs) & set(a.scenario_list)]
    # reps outermost: every tool gets its first rep before any gets a second, so an
    # interrupted run still has the whole table (the JSON is rewritten after each run)
    for rep in range(1, a.reps + 1):
        for kind in kinds:
            for tool in a.tool_list:
                recs = [r for r in run_one(kind, tool, rep, a, root) if r["scenario"] in a.scenario_list]
                records.extend(recs)
                for rec in recs:
                    print(
                        f"# {rec['scenario']:17s} {tool:17s} rep {rep}: seconds={rec.get('seconds')} "
                        f"from_event={rec.get('from_event')} lost={rec.get('steps_lost')} "
                        f"rounds={rec.get('rounds', '')} load={rec['load']:.1f} {rec.get('note') or ''}",
                        file=sys.stderr,
                        flush=True,
                    )
                write_json(summarize(records, a.scenario_list, a.tool_list, a), [], False)
    cli = time_cli(a.cli_runs) if a.cli_runs > 0 else []
    rows = summarize(records, a.scenario_list, a.tool_list, a)
    print(markdown(rows, cli, a))
    print()
    print(phase_table(records, a.scenario_list, a.tool_list))
    write_json(rows, cli, True)
    if not a.keep and a.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
