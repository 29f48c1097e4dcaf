#!/usr/bin/env python
"""Membership cost at real state sizes: petctl's EFS path vs its memory snapshots vs torchrun (issue 20).

Every rank of ``bench/state_train.py`` holds ``--sizes`` GiB of replicated fp32 state and
checkpoints it. Per size, rep and tool, one chain on real processes (``benchlib``: a real etcd,
one process group per node on its own 127.0.0.x, a shared directory as EFS):

    cold start of N -> drain one (SIGTERM, N -> N-1) -> a join (N-1 -> N) -> SIGKILL one (N -> N-1)

each from a steady state (a checkpoint on disk, a step mid-way between checkpoints). Tools:

- ``petctl-efs``: ``petctl-agent run`` with memory snapshots off (``PETCTL_AGENT_NO_SNAPSHOTS=1``):
  checkpoints and restores round-trip the state through EFS (``torch.save`` + fsync by rank 0,
  every rank reads it back);
- ``petctl-mem``: the same agent with memory snapshots on, its default (``PETCTL_AGENT_SNAPSHOT_DIR``
  per node, under ``--shm``, in a directory the run removes);
- ``torchrun-efs``: ``torchrun --rdzv-backend etcd`` (torch's defaults) with the script's
  ``--io plain``: ``torch.save`` to a temp file + fsync + ``os.replace``, ``torch.load`` on every rank;
- ``petctl-local``: the product's own path, ``petctl --local run-job`` on the local cloud (instances
  booted from their user data, TLS etcd, logs and status to moto): ``bench_state_local.py``;
- ``petctl-live``: ``petctl --local run-job --live`` of ``examples/live_train.py`` with the same
  state per rank (``bench_live_local.py``): 2 -> 3 -> 2 nodes and a hard loss; its seconds are the
  survivors' stall (no worker restarts: the newcomer's start and pull run beside their steps).

EFS: the run's directory with the local cloud's EFS limits (AWS's Elastic-mode throughput,
``petctl/local/efs_rate.py``, docs/local.md) on every node, petctl's and torchrun's alike;
``--no-efs-limits`` turns them off.

Numbers (from the outside: the step lines, timestamped as read): join and drain **stall** = last
step any rank printed at the old size -> every rank stepping at the new one; hard loss = SIGKILL ->
every survivor stepping (and its stall); steps lost as in ``bench_elastic.py``. Where the time goes:
the agents' status events (rendezvous, worker restart), the script's own lines (restore time and
source, process start -> ready), and a watcher of the checkpoint directory's ``latest`` (when a
checkpoint was persisted). The periodic checkpoint's blocking time is what ``ckpt.step`` (or the
plain save) took on rank 0 at a periodic checkpoint.

Memory: before each run the chain's need (N workers x state, + 2 x state per node for the
snapshots' two slots, + one more state for a save's buffers, + 1 GiB) is checked against
``MemAvailable``; a run that does not fit is skipped and reported, never started. Except the
snapshots of petctl-mem: the product itself admits a snapshot only while it fits in
``MemAvailable`` less its reserve (``budget.fits``) and sends the rest to EFS, so a chain whose
snapshots do not all fit runs when its workers and buffer do (``memory_model``: it says how many
of the 2 x N slots the product would admit), and the tables say per checkpoint and restore
whether memory or EFS served it. During a chain the run is stopped (its nodes SIGKILLed, the
chain reported as aborted) if ``MemAvailable`` drops under ``--stop-below`` (2 GiB): the machine
is shared; the lowest ``MemAvailable`` seen and the kernel's OOM kills (``/proc/vmstat``
``oom_kill``) during the chain are recorded.

    python bench/bench_state.py --sizes 0.1,1 --reps 3 --json state.json
    python bench/bench_state.py --sizes 2 --nodes 2 --reps 1 --tools petctl-efs,petctl-mem
    python bench/bench_state.py --render state.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_elastic import Miss, measure, steady  # noqa: E402
from benchlib import (  # noqa: E402
    REPO,
    Node,
    Run,
    RunConfig,
    _f,
    _med,
    add_marks,
    cap_flows,
    mem_available_gib,
    poll,
    reexec_in_netns,
)

STATE_SCRIPT = REPO / "bench" / "state_train.py"
#: tool -> (benchlib tool, memory snapshots on, the script's --io)
TOOLS = {
    "petctl-efs": ("petctl", False, "helper"),
    "petctl-mem": ("petctl", True, "helper"),
    "torchrun-efs": ("torchrun-etcd", False, "plain"),
    # the product's own path: `petctl --local run-job`, instances booted from their user data
    # (bench/bench_state_local.py); drain and join only
    "petctl-local": ("petctl", True, "helper"),
    # live membership through the local cloud (bench/bench_live_local.py): drain, join, hard loss
    "petctl-live": ("petctl", False, "helper"),
}
BASELINE = "torchrun-efs"
SCENARIOS = ("cold_start", "drain", "join", "hard_loss")
WHAT = {
    "cold_start": "first start -> all N stepping",
    "drain": "stall: last step at N -> all stepping at N-1",
    "join": "stall: last step at N-1 -> all N stepping",
    "hard_loss": "SIGKILL -> survivors stepping",
}
#: issue 20's targets (seconds) by state size: join, drain, hard loss
TARGETS = {0.1: (1.5, 1.5, 4.0), 1.0: (2.0, 2.0, 4.0), 4.0: (4.0, 4.0, 6.0)}
BLOCK_TARGET = 0.25  # s/GiB a periodic checkpoint may block
GIB = 2**30


# ---- pure helpers (tests/unit/test_bench_state.py) ------------------------------------------
def parse_sizes(value: str) -> list[float]:
    try:
        sizes = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {value!r}: comma-separated GiB, e.g. 0.1,1,4") from None
    if not sizes or any(s <= 0 or s > 64 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes {value!r}: each size must be > 0 and <= 64 GiB")
    return sizes


def parse_nodes(value: str, sizes: list[float]) -> dict[float, int]:
    """``--nodes``: one N for every size (``3``), or per size (``0.1:3,1:3,4:2``); default N=3 up
    to 1 GiB, 2 above (the chain runs N, N-1, N)."""
    if not value:
        return {s: 3 if s <= 1 else 2 for s in sizes}
    if ":" not in value:
        n = int(value)
        out = {s: n for s in sizes}
    else:
        out = {}
        for item in value.split(","):
            k, _, v = item.partition(":")
            out[float(k)] = int(v)
        missing = [s for s in sizes if s not in out]
        if missing:
            raise argparse.ArgumentTypeError(f"--nodes {value!r} names no N for size(s) {missing}")
    if any(not 2 <= n <= 8 for n in out.values()):
        raise argparse.ArgumentTypeError(f"--nodes {value!r}: N must be within 2..8")
    return out


def memory_need(gib: float, nodes: int, snapshots: bool) -> float:
    """GiB a chain of ``nodes`` at ``gib`` per rank may hold at once (see the module doc)."""
    return nodes * gib * (3 if snapshots else 1) + gib + 1.0


def snapshot_reserve_gib(mem_total_gib: float) -> float:
    """The snapshot store's reserve (``budget.fits``): max(RESERVE_MIN, RESERVE_FRACTION x MemTotal)."""
    from petctl_agent.checkpointing import budget

    return max(budget.RESERVE_MIN / GIB, budget.RESERVE_FRACTION * mem_total_gib)


def memory_model(gib: float, nodes: int, snapshots: bool, avail: float, reserve: float) -> dict[str, Any]:
    """What a chain needs once the product's own memory rule is counted (``memory_need`` is the
    whole need; every number GiB). ``base``: what the product does not govern -- the workers' state,
    a save's buffer, 1 GiB of processes (``memory_need`` without snapshots): the chain is skipped
    when that does not fit. ``need``: ``base`` plus the snapshot slots the product would admit:
    ``budget.fits`` takes a slot only when its whole size plus ``reserve`` fits in
    ``MemAvailable``, so with ``avail`` free at the start and the workers' state and processes in
    place, ``slots`` of the 2 x ``nodes`` fit (the rest go to EFS: the product's fallback).
    ``fallback``: fewer than all."""
    base = memory_need(gib, nodes, False)
    if not snapshots:
        return {"base": base, "need": base, "slots": 0, "of_slots": 0, "fallback": False}
    room = avail - nodes * gib - 1.0 - reserve  # what the snapshots may take before fits says no
    of = 2 * nodes
    slots = max(0, min(of, int(room // gib)))
    return {"base": base, "need": base + slots * gib, "slots": slots, "of_slots": of, "fallback": slots < of}


def oom_kills() -> int:
    """The kernel's count of OOM kills since boot (``/proc/vmstat`` ``oom_kill``), -1 if unknown."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def mem_total_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, scenario, tool): medians over reps (a rep that missed is left out)."""
    rows = []
    keys = sorted({(r["gib"], r["scenario"], r["tool"]) for r in records},
                  key=lambda k: (k[0], SCENARIOS.index(k[1]), list(TOOLS).index(k[2])))  # fmt: skip
    for gib, sc, tool in keys:
        recs = [r for r in records if (r["gib"], r["scenario"], r["tool"]) == (gib, sc, tool)]
        ok = [r for r in recs if r.get("seconds") is not None]
        rows.append({
            "gib": gib, "scenario": sc, "tool": tool, "nodes": recs[0].get("nodes"),
            "seconds": _med([r["seconds"] for r in ok]),
            "stall": _med([r.get("stall") for r in ok]),
            "steps_lost": _med([r.get("steps_lost") for r in ok]),
            "per_rep": [r.get("seconds") for r in recs],
            "reps": len(ok), "attempts": len(recs),
            "note": "; ".join(sorted({r["note"] for r in recs if r.get("note")})),
        })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table: a row per size and scenario, a column per tool, and the target."""
    tools = [t for t in TOOLS if any(r["tool"] == t for r in rows)]
    lines = [
        "| GiB/rank (nodes) | scenario | "
        + " | ".join(tools)
        + " | target | steps lost ("
        + ", ".join(tools)
        + ") |",
        "|---|---|" + "---:|" * len(tools) + "---:|---|",
    ]
    cells: dict[tuple[float, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["gib"], r["scenario"]), {})[r["tool"]] = r
    for (gib, sc), by in cells.items():
        vals, lost = [], []
        for t in tools:
            r = by.get(t)
            if r is None:
                vals.append("—")
                lost.append("—")
                continue
            v = _f(r["seconds"])
            if r["reps"] < r["attempts"]:
                v += f" ({r['reps']}/{r['attempts']})"
            vals.append(v)
            lost.append(_f(r["steps_lost"], 0))
        tgt = target(gib, sc)
        nodes = next(iter(by.values())).get("nodes")
        lines.append(
            f"| {gib:g} ({nodes}) | {sc} | "
            + " | ".join(vals)
            + f" | {'≤ ' + _f(tgt, 1) if tgt else '—'} | "
            + " / ".join(lost)
            + " |"
        )
    return "\n".join(lines)


def target(gib: float, scenario: str) -> float | None:
    """Issue 20's target for this size (the next listed size up), or None."""
    idx = {"join": 0, "drain": 1, "hard_loss": 2}.get(scenario)
    if idx is None:
        return None
    for size in sorted(TARGETS):
        if gib <= size:
            return TARGETS[size][idx]
    return None


BREAKDOWN = ("drain_requested", "last_old_step", "workers_failed", "rendezvous_start", "rendezvous_done",
             "workers_started", "worker_begun", "worker_grouped", "ready", "first_step")  # fmt: skip


def breakdown(records: list[dict[str, Any]]) -> str:
    """Where the time went: median seconds from the event to each phase (the latest node's)."""
    lines = [
        "| GiB | scenario | tool | "
        + " | ".join(BREAKDOWN)
        + " | 5 more steps s | restore s (source) | reps |",
        "|---|---|---|" + "---:|" * (len(BREAKDOWN) + 1) + "---|---:|",
    ]
    keys = sorted({(r["gib"], r["scenario"], r["tool"]) for r in records if r.get("phases")},
                  key=lambda k: (k[0], SCENARIOS.index(k[1]), list(TOOLS).index(k[2])))  # fmt: skip
    for gib, sc, tool in keys:
        phs = [r["phases"] for r in records if (r["gib"], r["scenario"], r["tool"]) == (gib, sc, tool)
               and r.get("phases")]  # fmt: skip
        cells = [_f(_med([p.get(c) for p in phs])) for c in BREAKDOWN]
        cells.append(_f(_med([p.get("five_more_steps") for p in phs])))
        rest = _med([p.get("restore") for p in phs])
        srcs = sorted({s for p in phs for s in p.get("sources", [])})
        lines.append(
            f"| {gib:g} | {sc} | {tool} | "
            + " | ".join(cells)
            + f" | {_f(rest)} ({'+'.join(srcs) or '—'}) | "
            f"{len(phs)} |"
        )
    return "\n".join(lines)


def ckpt_table(records: list[dict[str, Any]]) -> str:
    """The periodic checkpoint: what it blocked training for, when it was on EFS, and (when the
    records say) how many memory served and how many EFS (snapshots off, or the product's fallback)."""
    vias = any(r.get("ckpt_via") for r in records)
    lines = [
        "| GiB | tool | blocks (median s) | s/GiB | max s | on EFS after (median s) | checkpoints |"
        + (" served by memory / EFS | blocks via memory / via EFS (median s) |" if vias else ""),
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if vias else ""),
    ]
    keys = sorted({(r["gib"], r["tool"]) for r in records if r.get("ckpt_blocked")},
                  key=lambda k: (k[0], list(TOOLS).index(k[1])))  # fmt: skip
    for gib, tool in keys:
        rs = [r for r in records if (r["gib"], r["tool"]) == (gib, tool)]
        b = [x for r in rs for x in r.get("ckpt_blocked") or []]
        per = [x for r in rs for x in r.get("ckpt_persisted") or []]
        med = statistics.median(b)
        line = (
            f"| {gib:g} | {tool} | {med:.3f} | {med / gib:.3f} | {max(b):.3f} | {_f(_med(per))} | {len(b)} |"
        )
        if vias:
            pairs = [(x, v) for r in rs for x, v in zip(r.get("ckpt_blocked") or [], r.get("ckpt_via") or [])]
            by = {w: [x for x, v in pairs if v == w] for w in ("memory", "efs")}
            line += (
                f" {len(by['memory'])} / {len(by['efs'])} |"
                f" {_f(_med(by['memory']), 3)} / {_f(_med(by['efs']), 3)} |"
            )
        lines.append(line)
    return "\n".join(lines)


# ---- one chain ------------------------------------------------------------------------------------
class LatestWatcher:
    """Polls the checkpoint directory's ``latest``: when each step first became the persisted one."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.path = ckpt_dir / "latest"
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                step = int(json.loads(self.path.read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            self.seen.setdefault(step, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)


def pss_anon_gib(pid: int) -> float:
    """``Pss_Anon`` of one process, GiB (its share of anonymous pages: tensors, buffers); 0 if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def tree_bytes_gib(root: Path) -> float:
    """Bytes the files under ``root`` hold (allocated blocks: on tmpfs, RAM), GiB."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total / GIB


class MemoryStop(BaseException):  # no broad except swallows a stop
    """Raised in the main thread when :class:`MemWatcher` stopped the run (MemAvailable too low)."""


class MemWatcher:
    """The memory a chain holds, sampled every 0.25 s: the anonymous memory of every process the
    run started (``Pss_Anon``: shared pages split between their sharers) plus the nodes' memory
    snapshots (tmpfs files: RAM that no process's Pss_Anon counts). Page cache (EFS's files) is
    left out: the kernel reclaims it. Also the machine-wide ``MemTotal - MemAvailable`` rise from
    the chain's start (other sessions' work moves that one)."""

    def __init__(self, run: Run, shm: Path | None, stop_below: float = 0.0) -> None:
        self.run, self.shm, self.stop_below = run, shm, stop_below
        self.base_used = self._used()
        self.base_oom = oom_kills()
        self.min_available = mem_available_gib()
        self.stopped = ""  # why the run was stopped (MemAvailable under stop_below), or ''
        self.interrupt = False  # set while the chain runs: a stop interrupts its waits (MemoryStop)
        # a real signal, not _thread.interrupt_main: SIGINT is ignored in a background job (nohup &),
        # and then neither interrupts the main thread's sleep
        self._old_handler = signal.signal(signal.SIGUSR1, self._on_stop)

        self.peak: dict[str, float] = {
            "run_gib": 0.0,
            "anon_gib": 0.0,
            "shm_gib": 0.0,
            "system_rise_gib": 0.0,
        }
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _on_stop(self, signum: int, frame: Any) -> None:
        if self.interrupt:  # still in the chain (not in its cleanup)
            raise MemoryStop()

    @staticmethod
    def _used() -> float:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info[k] = int(v.split()[0])
        return (info["MemTotal"] - info["MemAvailable"]) / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            try:
                pids = self.run.leftovers()
            except RuntimeError:  # the run's pid map grew while read (another thread): next tick
                continue
            anon = sum(pss_anon_gib(p) for p in pids)
            shm = tree_bytes_gib(self.shm) if self.shm is not None else 0.0
            if anon + shm > self.peak["run_gib"]:
                self.peak.update(run_gib=anon + shm, anon_gib=anon, shm_gib=shm)
            self.peak["system_rise_gib"] = max(self.peak["system_rise_gib"], self._used() - self.base_used)
            avail = mem_available_gib()
            self.min_available = min(self.min_available, avail)
            if avail < self.stop_below and not self.stopped:
                # the machine is shared: stop the run (every node's tree) before the kernel must
                self.stopped = f"stopped: MemAvailable {avail:.2f} GiB < {self.stop_below:g} GiB"
                print(f"# {self.stopped}", file=sys.stderr, flush=True)
                for n in list(self.run.nodes):
                    if n.alive():
                        self.run.kill_node(n)
                if self.interrupt:  # the chain's waits end now, not at their timeouts
                    os.kill(os.getpid(), signal.SIGUSR1)

    def close(self) -> dict[str, Any]:
        self._stop.set()
        self._t.join(2)
        signal.signal(signal.SIGUSR1, self._old_handler)
        out: dict[str, Any] = {k: round(v, 2) for k, v in self.peak.items()}
        oom = oom_kills()
        out["min_available_gib"] = round(self.min_available, 2)
        out["oom_kills"] = oom - self.base_oom if oom >= 0 and self.base_oom >= 0 else None
        return out


def latest_step(run: Run) -> int:
    try:
        return int(json.loads((run.ckpt_dir / "latest").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def run_chain(run: Run, n: int, a: argparse.Namespace, rec: Any) -> None:
    t0 = time.monotonic()
    nodes = [run.add_node() for _ in range(n)]
    t, note = run.wait_stepping(nodes, n, t0, a.start_timeout)
    if t is None:
        raise Miss(f"cold start of {n}: {note}")
    rec("cold_start", seconds=t - t0, from_event=t - t0, steps_lost=None)
    steady(run, nodes, n, a.timeout)

    live = nodes
    if {"drain", "join"} & a.scenario_set:
        live = drain_and_join(run, nodes, n, a, rec)
    # a hard loss from the state a job is in most of the time: a periodic checkpoint taken by
    # every node now in the job (not the join's, which the newcomer did not hold)
    if "hard_loss" in a.scenario_set:
        hard_loss(run, live, n, a, rec)


def drain_and_join(run: Run, nodes: list[Node], n: int, a: argparse.Namespace, rec: Any) -> list[Node]:
    leaving, live = nodes[-1], nodes[:-1]
    t0 = run.terminate_node(leaving)
    r = measure(run, nodes, live, n - 1, t0, a, extra=[leaving])
    poll(lambda: not leaving.alive(), 30)
    run.drop_memory(leaving)
    rec("drain", **add_marks(run, r, nodes, live, n - 1, t0))
    steady(run, live, n - 1, a.timeout)

    new = run.add_node()
    r = measure(run, live, live + [new], n, new.started, a)
    t_first = min(x.steps_after(new.started, n)[0][0] for x in live + [new])
    t_last = max((s[0] for x in live for s in list(x.steps) if s[2] == n - 1 and s[0] < t_first), default=0.0)
    rec("join", **add_marks(run, r, live, live + [new], n, new.started, since=max(t_last, new.started)))
    return live + [new]


def hard_loss(run: Run, live: list[Node], n: int, a: argparse.Namespace, rec: Any) -> None:
    # after the join, or alone (--scenarios hard_loss): past a checkpoint every node took after
    # the chain's last membership change, and not the cold start's first two (fresh tmpfs pages)
    if "join" in a.scenario_set:
        first = min(s[1] for x in live for s in x.steps_after(max(x.started for x in live), n))
    else:
        first = 3 * a.checkpoint_every
    if not poll(lambda: latest_step(run) >= first, a.timeout, 0.05):
        raise Miss(f"timeout {a.timeout:.0f}s: no checkpoint after step {first}")
    steady(run, live, n, a.timeout)

    victim = live[0]
    t0 = run.kill_node(victim)
    run.drop_memory(victim)
    r = measure(run, live, live[1:], n - 1, t0, a, stall=False)
    r["stall"] = run.stall(live, live[1:], n - 1, t0)
    rec("hard_loss", **add_marks(run, r, live, live[1:], n - 1, t0))


def run_one(
    gib: float, n: int, tool: str, rep: int, a: argparse.Namespace, root: Path
) -> list[dict[str, Any]]:
    """One chain; one record per scenario; never raises (a miss is a result)."""
    base_tool, snapshots, io = TOOLS[tool]
    tag = f"{gib:g}".replace(".", "p")
    shm = Path(a.shm) / f"bench-state-{os.getpid()}-{tag}-{tool}-{rep}" if snapshots else None
    cfg = RunConfig(
        tool=base_tool, min_nodes=n - 1, max_nodes=n, step_time=a.step_time,
        checkpoint_every=a.checkpoint_every, job="state", script=STATE_SCRIPT,
        extra_args=["--state-gib", f"{gib:g}", "--io", io, "--start-delay", f"{a.start_delay:g}"],
        drain_timeout=a.timeout,
        snapshot_root=str(shm) if shm else "", efs_limits=not a.no_efs_limits,
        # memory snapshots are on by default in the agent: the EFS path turns them off
        env={} if snapshots or base_tool != "petctl" else {"PETCTL_AGENT_NO_SNAPSHOTS": "1"},
    )  # fmt: skip
    base = {"gib": gib, "tool": tool, "rep": rep, "nodes": n}
    out: list[dict[str, Any]] = []

    def rec(scenario: str, **kw: Any) -> None:
        out.append({"scenario": scenario, **base, "load": round(os.getloadavg()[0], 2), **kw})

    avail = mem_available_gib()
    model = memory_model(gib, n, snapshots, avail, snapshot_reserve_gib(mem_total_gib()))
    need = model["need"]
    # the whole need when it fits (0.1 and 1 GiB here, as before); else what the product does not
    # govern (its snapshots fall back to EFS once MemAvailable less its reserve cannot hold them)
    if memory_need(gib, n, snapshots) > avail - a.mem_margin and model["base"] > avail - a.mem_margin:
        note = f"skipped: needs ~{need:.1f} GiB, MemAvailable {avail:.1f} GiB (margin {a.mem_margin:g})"
        return [{"scenario": sc, **base, "seconds": None, "note": note} for sc in SCENARIOS]
    if model["fallback"]:
        print(
            f"# {gib:g} GiB x {n} {tool}: ~{model['slots']} of {model['of_slots']} snapshot slots fit "
            f"(MemAvailable {avail:.1f} GiB): the product sends the rest to EFS",
            file=sys.stderr,
            flush=True,
        )
    run = Run(root / f"{tag}-{tool}-{rep}", cfg)
    watcher = LatestWatcher(run.ckpt_dir)
    mem = MemWatcher(run, shm, a.stop_below)
    note, t = "", time.monotonic()
    try:
        mem.interrupt = True
        run.start()
        run_chain(run, n, a, rec)
        mem.interrupt = False
    except Miss as e:
        note = str(e)
    except MemoryStop:
        pass  # mem.stopped says why
    except Exception as e:  # noqa: BLE001 - a broken tool is a result too
        note = f"error: {type(e).__name__}: {e}"
    finally:
        mem.interrupt = False
        if mem.stopped:
            note = f"{mem.stopped}; {note}" if note else mem.stopped
        ckpts = [(tt, kv) for nd in run.nodes for tt, w, kv in list(nd.marks) if w == "ckpt"]
        peak = mem.close()
        left = run.close()
        watcher.close()
        # --keep keeps the logs and status files, never the checkpoints (GiBs per run)
        shutil.rmtree(run.root / "efs" if a.keep else run.root, ignore_errors=True)
    blocked = [float(kv["blocked"]) for _, kv in ckpts]
    via = [kv.get("via", "") for _, kv in ckpts]  # memory / efs (state_train.py), '' from older lines
    persisted = []
    for tt, kv in ckpts:
        s, b = int(kv["step"]), float(kv["blocked"])
        if s in watcher.seen:  # from the start of the checkpoint to ``latest`` naming it
            persisted.append(round(max(watcher.seen[s] - (tt - b), b), 3))
    done = {r["scenario"] for r in out}
    missed = [sc for sc in SCENARIOS if sc not in done and (sc == "cold_start" or sc in a.scenario_set)]
    for i, sc in enumerate(missed):
        rec(
            sc,
            seconds=None,
            steps_lost=None,
            note=note if i == 0 else f"not reached ({missed[0]}: {note[:80]})",
        )
    for r in out:
        r.update(wall=round(time.monotonic() - t, 1), left_running_at_end=len(left))
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 3)
    if out:
        out[0]["ckpt_blocked"] = blocked
        out[0]["ckpt_steps"] = [int(kv["step"]) for _, kv in ckpts]
        if any(via):
            out[0]["ckpt_via"] = via
        out[0]["mem_peak"] = peak | {
            "model_gib": round(need, 2),
            "model_full_gib": round(memory_need(gib, n, snapshots), 2),
            "model_slots": f"{model['slots']}/{model['of_slots']}" if snapshots else "",
        }
    return out


# ---- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.1,1", help="GiB of replicated fp32 state per rank, comma list")
    p.add_argument("--nodes", default="", help="N of the chain: one for all (3) or per size (0.1:3,1:3,4:2)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; medians reported")
    p.add_argument("--tools", default=",".join(t for t in TOOLS if t not in ("petctl-local", "petctl-live")),
                   help=f"comma list of {', '.join(TOOLS)} (petctl-local: through `petctl --local`, "
                   "drain and join; not by default)")  # fmt: skip
    p.add_argument("--scenarios", default=",".join(SCENARIOS[1:]),
                   help="comma list of drain, join, hard_loss (a cold start always runs; drain and join run together)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write every record + the summary here (after every run)")
    p.add_argument("--timeout", type=float, default=120, help="bound of every wait after an event, seconds")
    p.add_argument("--start-timeout", type=float, default=180, help="bound of a cold start, seconds")
    p.add_argument("--step-time", type=float, default=0.05, help="extra sleep per training step")
    p.add_argument(
        "--start-delay", type=float, default=0.0,
        help="seconds every worker sleeps before its process group, at every start: a GPU worker's "
        "CUDA and NCCL set-up or a model's build, which this CPU box does not have (an emulation)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=20,
        help="checkpoint interval in steps (0: snapshots only at membership changes, "
        "what a job that never checkpoints on its own pays; drain and join)",
    )
    p.add_argument("--no-efs-limits", action="store_true",
                   help="EFS without AWS's throughput limits (default: the local cloud's emulation)")  # fmt: skip
    p.add_argument("--shm", default="/dev/shm", help="tmpfs for petctl-mem's snapshots")
    p.add_argument("--mem-margin", type=float, default=3.0, help="GiB of MemAvailable a run leaves free")
    p.add_argument("--stop-below", type=float, default=2.0,
                   help="stop a chain (SIGKILL its nodes) when MemAvailable drops under this many GiB")  # fmt: skip
    p.add_argument("--render", type=Path, help="only print the tables of an existing --json file")
    p.add_argument(
        "--keep", action="store_true", help="keep run directories (logs, not the checkpoints) under --workdir"
    )
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="run inside a private loopback-only network namespace (unshare --net)")  # fmt: skip
    p.add_argument("--flow-cap", type=float, default=5.0,
                   help="Gbit/s per TCP flow on the namespace's loopback (AWS's single-flow limit outside a "
                        "cluster placement group: 5; 0: none); only inside the bench's own network namespace")  # fmt: skip
    a = p.parse_args(argv)
    try:
        a.size_list = parse_sizes(a.sizes)
        a.node_map = parse_nodes(a.nodes, a.size_list)
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    a.tool_list = [t.strip() for t in a.tools.split(",") if t.strip()]
    bad = [t for t in a.tool_list if t not in TOOLS]
    if bad or not a.tool_list:
        p.error(f"--tools: unknown {bad}; choose from {', '.join(TOOLS)}")
    a.scenario_set = {x.strip() for x in a.scenarios.split(",") if x.strip()}
    if not a.scenario_set or a.scenario_set - set(SCENARIOS[1:]):
        p.error(f"--scenarios: choose from {', '.join(SCENARIOS[1:])}")
    if a.reps < 1:
        p.error("--reps must be >= 1")
    return a


def mem_table(records: list[dict[str, Any]]) -> str:
    """The peak memory of a chain (``MemWatcher``), next to ``memory_need``'s model of it."""
    keys = sorted({(r["gib"], r["nodes"], r["tool"]) for r in records if r.get("mem_peak")},
                  key=lambda k: (k[0], list(TOOLS).index(k[2])))  # fmt: skip
    if not keys:
        return ""
    # the lowest MemAvailable of the chain and the kernel's OOM kills during it
    low = any("min_available_gib" in r.get("mem_peak", {}) for r in records)
    lines = [
        "| GiB/rank (nodes) | tool | peak held (max s over reps), GiB | of it anon | of it snapshots (tmpfs) "
        "| per GiB of state per node | machine-wide rise, GiB | model (memory_need), GiB | chains |"
        + (" lowest MemAvailable, GiB | OOM kills |" if low else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if low else ""),
    ]
    for gib, n, tool in keys:
        ps = [r["mem_peak"] for r in records if (r["gib"], r["nodes"], r["tool"]) == (gib, n, tool)
              and r.get("mem_peak")]  # fmt: skip
        top = max(ps, key=lambda p: p["run_gib"])
        lines.append(
            f"| {gib:g} ({n}) | {tool} | {top['run_gib']:.2f} | {top['anon_gib']:.2f} | {top['shm_gib']:.2f} "
            f"| {top['run_gib'] / (gib * n):.2f} | {max(p['system_rise_gib'] for p in ps):.2f} "
            f"| {top['model_gib']:.1f} | {len(ps)} |"
            + (
                f" {_f(min(p.get('min_available_gib', 99.0) for p in ps))} |"
                f" {sum(p.get('oom_kills') or 0 for p in ps)} |"
                if low
                else ""
            )
        )
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    recs = doc["records"]
    from bench_state_local import cloud_table

    parts = (markdown(summarize(recs)), ckpt_table(recs), breakdown(recs), mem_table(recs), cloud_table(recs))
    return "\n\n".join(x for x in parts if x)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.render:
        print(render(json.loads(a.render.read_text())))
        return 0
    if a.netns != "off" and not os.environ.get("BENCH_IN_NETNS"):
        rc = reexec_in_netns(__file__, argv)
        if rc is not None:
            return rc
        if a.netns == "on":
            print("cannot create a network namespace (unshare --net)", file=sys.stderr)
            return 2
    flow_cap = None
    if a.flow_cap > 0:
        why = (
            cap_flows(a.flow_cap)
            if os.environ.get("BENCH_IN_NETNS")
            else "not in a network namespace of its own"
        )
        if why:
            print(f"# per-flow cap of {a.flow_cap:g} Gbit/s not applied: {why}", file=sys.stderr, flush=True)
        else:
            flow_cap = a.flow_cap
    root = a.workdir or Path(tempfile.mkdtemp(prefix="bench-state-"))
    root.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    started = time.time()

    def write_json(complete: bool) -> None:
        if not a.json:
            return
        doc = {
            "command": "python bench/bench_state.py " + " ".join(argv), "complete": complete,
            "started": started, "wall_s": round(time.time() - started, 1),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "netns": bool(os.environ.get("BENCH_IN_NETNS")), "flow_cap_gbit": flow_cap,
                        "mem_total_gib": round(
                            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)},
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                       if k != "node_map"} | {"node_map": {str(k): v for k, v in a.node_map.items()}},
            "summary": summarize(records), "records": records,
        }  # fmt: skip
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, a.json)

    # reps outermost, then sizes, then tools: an interrupted run still has every tool side by side
    for rep in range(1, a.reps + 1):
        for gib in a.size_list:
            for tool in a.tool_list:
                if tool == "petctl-local":
                    from bench_state_local import run_one as run_local

                    recs = run_local(gib, a.node_map[gib], rep, a, root)
                elif tool == "petctl-live":
                    from bench_live_local import state_records

                    recs = state_records(gib, rep, a.step_time, a.start_delay, root)
                else:
                    recs = run_one(gib, a.node_map[gib], tool, rep, a, root)
                records.extend(recs)
                for r in recs:
                    print(
                        f"# {gib:g} GiB {r['scenario']:10s} {tool:13s} rep {rep}: seconds={r.get('seconds')} "
                        f"stall={r.get('stall')} lost={r.get('steps_lost')} load={r.get('load')} "
                        f"phases={r.get('phases')} {r.get('note') or ''}",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                write_json(False)
    print(render({"records": records}))
    write_json(True)
    if not a.keep and a.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
