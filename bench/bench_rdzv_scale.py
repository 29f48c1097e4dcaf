#!/usr/bin/env python
"""Rendezvous at scale: the handler's scenarios with N simulated participants.

One real etcd on 127.0.0.1 (started here, ``bench/harness.py``); participants are the real
``petctl_agent.rendezvous`` handler of this checkout, driven like torch's elastic agent drives
it, without torch workers (``bench/rdzv_sim.py``: threads in forked processes, a "worker"
is a sleep loop counting steps that asks ``num_nodes_waiting`` at each step). Scenarios:

* ``cold``: N participants arrive uniformly over ``--arrival`` s (the group's desired capacity
  N as the hint, MIN = ``--min-frac`` x N): rounds, and last arrival -> every participant in one
  round (all of its participants returned from ``next_rendezvous``);
* ``steady``: then, for ``--window`` s with nothing happening: etcd's raft proposals committed/s
  and mvcc puts/s (its ``/metrics``, diffed), the participants' requests/s by kind, re-reads;
* ``drain``: then one participant leaves: leave -> the others back in one round, and that
  round's requests and bytes (the participants' counts over the round, less the steady-state
  rate over as long): the *bytes per round* figure; run at N and at ``--fault-n`` for O(N);
* ``scaleup``: ``--scale-from`` participants run; the desired capacity becomes
  ``--scale-to`` and the newcomers arrive uniformly over ``--spread`` s: rounds, each running
  node's stall per round (its worker stopped -> its ``next_rendezvous`` returned), and the
  total per running node;
* ``straggler`` (``--fault-n`` participants and one more that registers and never joins):
  last join -> the round closed without it (bounded by ``--straggler-wait``); then it joins;
* ``agent_pause`` / ``etcd_pause``: SIGSTOP ``--pause`` s on one participant's process (its
  own) / on etcd; for ``--observe`` s after: rounds and lost steps (none expected);
* ``etcd_replaced``: etcd killed, its data dir deleted, a new one on the same port: from the
  new etcd answering to every participant in one round on it.
* ``field``: ``--n`` participants (with ``--light-nodes``, ``--real`` real handlers, the rest
  light nodes) start cold, then, each from a steady window of ``--window`` s: a join of 1 (a
  real handler), a burst of ``--burst`` at once, a trickle of ``--trickle`` over ``--trickle-s``
  s, and the hard loss of a real handler that does not lead (the survivors' workers fail
  ``--fail-after`` s later: ``workers_failed``). Per window: rounds, time to a round, lost steps,
  etcd writes/s, the events the watches delivered (real handlers; light processes' shared
  watches and their per-node equivalent), range and lease reads, the leader's among them.

Lost steps (the model, rdzv_sim.py): a round that ends with a participant gone loses the steps
since the last periodic checkpoint; a coordinated one (newcomers waiting) loses none.
Bytes: every socket of the participant processes, application bytes both ways (HTTP headers
and bodies), counted by wrapping socket send/recv; requests: every HTTP request. Prints a
table, a prediction for ``--predict`` (5,000) nodes, and JSON (``--json`` writes it to a file).

    python bench/bench_rdzv_scale.py --quick                  # N=16, short windows (~1 min)
    flock /tmp/petctl-heavy.lock python bench/bench_rdzv_scale.py --json out.json   # 1,000 / 256 -> 512
    # what fits 2 cores at 1,000: all but --real (2) participants of cold/scaleup are light nodes
    flock /tmp/petctl-heavy.lock python bench/bench_rdzv_scale.py --light-nodes --etcd-binary /usr/bin/etcd \
        --scenarios cold,scaleup --json out.json
    # 200 real handlers beside 800 light nodes: cold, join of 1, burst of 50, trickle of 20, a loss
    flock /tmp/petctl-heavy.lock python bench/bench_rdzv_scale.py --scenarios field --n 1000 --light-nodes \
        --real 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Etcd  # noqa: E402 - bench/harness.py, next to this script
from rdzv_light import make_config  # noqa: E402
from rdzv_sim import Sim, Spec  # noqa: E402

#: the etcd API each scenario's participants spoke (by their requests), in order
SEEN_API: list[str] = []

METRICS = {
    "proposals": "etcd_server_proposals_committed_total",
    "puts": "etcd_mvcc_put_total",
    "txns": "etcd_mvcc_txn_total",
    "ranges": "etcd_mvcc_range_total",
}


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """etcd's own counters (``/metrics``) of interest; a missing one reads 0."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for k, name in METRICS.items():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[k] += float(line.rsplit(" ", 1)[1])
    return out


#: the etcd process the Meter reads the CPU time of (set by main at each start of etcd)
ETCD_PID: list[int] = []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """etcd's counters, the participants' I/O, the CPU time of etcd and of the participant
    processes, and the time, at one moment; ``since`` diffs."""

    def __init__(self, sim: Sim, endpoint: str) -> None:
        self.t = time.monotonic()
        self.io = sim.io()
        self.cpu = {
            "etcd": sum(cpu_seconds(p) for p in ETCD_PID[-1:]),
            "participants": sum(cpu_seconds(p.pid) for p in sim.procs if p.pid),
        }
        try:
            self.etcd = etcd_metrics(endpoint)
        except OSError:
            self.etcd = {}

    def since(self, before: Meter) -> dict[str, Any]:
        secs = max(1e-9, self.t - before.t)
        d = {k: self.io[k] - before.io.get(k, 0) for k in self.io}
        e = {k: self.etcd.get(k, 0) - before.etcd.get(k, 0) for k in self.etcd} if before.etcd else {}
        cpu = {k: round((self.cpu[k] - before.cpu.get(k, 0)) / secs, 3) for k in self.cpu}
        return {"seconds": secs, "io": d, "etcd": e, "cpu_cores": cpu, "load1": os.getloadavg()[0]}


def _health(w: dict[str, Any]) -> dict[str, Any]:
    """What says whether the machine kept up: CPU cores used by etcd and by the participants,
    the load average, and (light nodes) late keepalives, leases lost, failed requests."""
    io = w["io"]
    return {
        "cpu_cores": w.get("cpu_cores"),
        "load1": round(w.get("load1", 0.0), 1),
        "ka_late": int(io.get("ka_late", 0)),
        "ka_behind": int(io.get("ka_behind", 0)),
        "leases_lost": int(io.get("leases_lost", 0)),
        "task_errors": int(io.get("task_errors", 0)),
    }


def _rounds_after(sim: Sim, after: float, ids: set[int] | None = None) -> list[Any]:
    """Distinct rounds that participants returned into after ``after``, in order."""
    seen: list[Any] = []
    for e in sim.snapshot():
        if e[0] == "ret" and e[2] > after and (ids is None or e[1] in ids) and e[3] not in seen:
            seen.append(e[3])
    return seen


def _round_info(sim: Sim, after: float, t_ref: float) -> list[list[Any]]:
    """Each round participants returned into after ``after``: [round, world size, first and
    last return (s after ``t_ref``)]."""
    out: dict[Any, list[Any]] = {}
    for e in sim.snapshot():
        if e[0] == "ret" and e[2] > after:
            r = out.setdefault(e[3], [e[3], e[5], e[2], e[2]])
            r[2], r[3] = min(r[2], e[2]), max(r[3], e[2])
    return [[r, w, round(a - t_ref, 2), round(b - t_ref, 2)] for r, w, a, b in out.values()]


def _lost_after(sim: Sim, after: float) -> tuple[int, int]:
    """(steps lost, worker stops) after ``after``."""
    ends = [e for e in sim.snapshot() if e[0] == "end" and e[2] > after and e[6] != "left"]
    return sum(e[5] for e in ends), len(ends)


def _per_round(window: dict[str, Any], base: dict[str, Any] | None) -> tuple[float, float]:
    """Requests and bytes of a window, less the steady-state rate over as long (``base``)."""
    io, secs = window["io"], window["seconds"]
    req, byt = io["requests"], io["bytes_out"] + io["bytes_in"]
    if base:
        bs = base["seconds"]
        req -= base["io"]["requests"] / bs * secs
        byt -= (base["io"]["bytes_out"] + base["io"]["bytes_in"]) / bs * secs
    return max(0.0, req), max(0.0, byt)


def _fail(sim: Sim, what: str) -> str:
    errs = sim.errors()
    return f"{what}" + (f" ({len(errs)} errors, first: {errs[0][3]})" if errs else "")


def _drain(
    sim: Sim,
    endpoint: str,
    ids: list[int],
    base: dict[str, Any] | None,
    timeout: float,
    who: int | None = None,
) -> dict[str, Any]:
    """``who`` (default: the last of ``ids``) leaves; the others form a round. Its time, requests
    and bytes."""
    who = ids[-1] if who is None else who
    rest = [i for i in ids if i != who]
    sim.set_expected(len(rest))
    m0 = Meter(sim, endpoint)
    sim.leave(who)
    got = sim.wait_together(rest, timeout, after=m0.t)
    if got is None:
        return {"ok": False, "error": _fail(sim, f"no round of the {len(rest)} within {timeout:.0f} s")}
    time.sleep(0.5)  # the last answers of the round arrive
    w = Meter(sim, endpoint).since(m0)
    w["seconds"] = got[1] - m0.t + 0.5
    req, byt = _per_round(w, base)
    fan = w["io"].get("fanout_bytes", 0.0)
    out = {
        "ok": True,
        "n": len(rest),
        "close_s": round(got[1] - m0.t, 3),
        "requests": round(req),
        "bytes": round(byt),
        "bytes_per_node": round(byt / len(rest)),
        "requests_raw": w["io"],
        **_health(w),
    }
    if fan:  # light nodes: what their per-node rounds watches would have received too
        out["bytes_fanout"] = round(fan)
        out["bytes_equiv"] = round(byt + fan)
        out["bytes_equiv_per_node"] = round((byt + fan) / len(rest))
    return out


def _light(a: argparse.Namespace, n: int) -> set[int]:
    """With ``--light-nodes``: every participant but the first ``--real`` is a light node."""
    return set(range(a.real, n)) if a.light_nodes else set()


def _light_opts(a: argparse.Namespace) -> dict[str, int]:
    return {
        "light_per_proc": a.light_per_proc,
        "light_ka_threads": a.light_ka_threads,
        "light_workers": a.light_workers,
    }


# ---- scenarios ------------------------------------------------------------------------------------
def scenario_cold_steady_drain(etcd: Etcd, a: argparse.Namespace) -> list[dict[str, Any]]:
    n, spread = a.n, a.arrival
    specs = [Spec(i, arrive=spread * i / max(1, n - 1)) for i in range(n)]
    light = _light(a, n)
    for s in specs[: a.real if light else 0]:
        s.arrive = 0.0  # the real handlers register first: one of them leads
    sim = Sim(
        etcd.endpoint, specs, min_nodes=max(1, int(n * a.min_frac)), max_nodes=n, expected=n,
        conf=a.conf, per_proc=a.per_proc, step_s=a.step, run_id=f"cold{n}-{uuid.uuid4().hex[:6]}",
        light=light, **_light_opts(a),
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    m0 = Meter(sim, etcd.endpoint)
    t0 = sim.start()
    try:
        ids = list(range(n))
        got = sim.wait_together(ids, spread + a.timeout)
        calls = [e[2] for e in sim.snapshot() if e[0] == "call"]
        last_arrival = max(calls) if calls else t0 + spread
        if got is None:
            st = sim.state()
            rows.append({"scenario": "cold", "n": n, "ok": False,
                         "error": _fail(sim, f"not all {n} in one round within {spread + a.timeout:.0f} s "
                                             f"({sum(1 for e in st.values() if e[0] == 'ret')} running)")})  # fmt: skip
            return rows
        rounds = _rounds_after(sim, t0)
        w = Meter(sim, etcd.endpoint).since(m0)
        req, byt = _per_round(w, None)
        close = got[1] - last_arrival
        rows.append({
            "scenario": "cold", "n": n, "rounds": len(rounds), "close_s": round(close, 3),
            "close_what": f"last arrival -> all {n} in one round (arrivals over {spread:g} s)",
            "requests": round(req / len(rounds)), "bytes": round(byt / len(rounds)),
            "per_round_note": "whole cold start / rounds",
            "writes_per_s": round(w["etcd"].get("proposals", 0) / w["seconds"], 1),
            "light_nodes": len(light), **_health(w), "snapshot_bytes": int(w["io"].get("snapshot_bytes", 0)),
            "round_info": _round_info(sim, t0, t0), "round_info_what": "round, world, first/last return (s after t0)",
            "target": "<= 3 rounds; <= 3 s", "ok": len(rounds) <= 3 and close <= 3.0,
        })  # fmt: skip

        time.sleep(a.settle)
        s0 = Meter(sim, etcd.endpoint)
        time.sleep(a.window)
        base = Meter(sim, etcd.endpoint).since(s0)
        secs = base["seconds"]
        wps = base["etcd"].get("proposals", 0) / secs
        reads = base["io"]["read"]
        rows.append({
            "scenario": "steady", "n": n, "rounds": len(_rounds_after(sim, s0.t)), "close_s": None,
            "requests_per_s": round(base["io"]["requests"] / secs, 1),
            "bytes_per_s": round((base["io"]["bytes_out"] + base["io"]["bytes_in"]) / secs),
            "writes_per_s": round(wps, 1), "writes_per_node_s": round(wps / n, 4),
            "puts_per_s": round(base["etcd"].get("puts", 0) / secs, 1),
            "rereads": int(reads), "full_rereads": int(base["io"].get("rereads", 0)),
            "window_s": round(secs, 1), "io": base["io"], "light_nodes": len(light), **_health(base),
            "target": "<= 0.1 writes/s per node; no re-read storm",
            "ok": wps / n <= 0.1 and reads <= n * 0.01 * secs and base["io"].get("rereads", 0) <= n * 0.01 * secs,
        })  # fmt: skip

        d = _drain(sim, etcd.endpoint, ids, base, a.timeout)
        rows.append({"scenario": "drain", **d, "rounds": 1 if d.get("ok") else None,
                     "close_what": "leave -> the others in one round",
                     "writes_per_s": None, "target": "bytes O(N)", "ok": d.get("ok", False)})  # fmt: skip
        return rows
    finally:
        sim.stop()
        SEEN_API.append(sim.api())


def scenario_scaleup(etcd: Etcd, a: argparse.Namespace) -> dict[str, Any]:
    n0, n1, spread = a.scale_from, a.scale_to, a.spread
    specs = [Spec(i) for i in range(n0)]
    specs += [Spec(i, arrive=spread * (i - n0) / max(1, n1 - n0 - 1), phase=1) for i in range(n0, n1)]
    sim = Sim(
        etcd.endpoint, specs, min_nodes=max(1, int(n0 * a.min_frac)), max_nodes=n1, expected=n0,
        conf=a.conf, per_proc=a.per_proc, step_s=a.step, run_id=f"up{n0}-{uuid.uuid4().hex[:6]}",
        light=_light(a, n1), **_light_opts(a),
    )  # fmt: skip
    row: dict[str, Any] = {"scenario": "scaleup", "n": f"{n0}->{n1}", "target": "<= 2 rounds, each <= 2 s"}
    sim.start()
    try:
        old = list(range(n0))
        if sim.wait_together(old, a.timeout) is None:
            return {**row, "ok": False, "error": _fail(sim, f"the first {n0} never formed a round")}
        time.sleep(a.settle)
        m0 = Meter(sim, etcd.endpoint)
        sim.set_expected(n1)  # the group's desired capacity goes up as the newcomers launch
        time.sleep(a.hint_lead)  # ... a boot time before the first of them is ready
        t_up = sim.go()
        got = sim.wait_together(list(range(n1)), spread + a.timeout, after=t_up)
        calls = [e[2] for e in sim.snapshot() if e[0] == "call" and e[1] >= n0]
        last = max(calls) if calls else t_up + spread
        if got is None:
            return {
                **row,
                "ok": False,
                "error": _fail(sim, f"not all {n1} in one round by spread + {a.timeout:.0f} s"),
            }
        w = Meter(sim, etcd.endpoint).since(m0)
        rounds = _rounds_after(sim, t_up)
        # each running node: stall per round = its worker stopped -> its next_rendezvous returned
        stalls: dict[int, list[float]] = {i: [] for i in old}
        ended: dict[int, float] = {}
        for e in sim.snapshot():
            if e[1] in stalls and e[2] > t_up:
                if e[0] == "end":
                    ended[e[1]] = e[2]
                elif e[0] == "ret" and e[1] in ended:
                    stalls[e[1]].append(e[2] - ended.pop(e[1]))
        per_round = max((s for v in stalls.values() for s in v), default=0.0)
        total = max((sum(v) for v in stalls.values()), default=0.0)
        restarts = max((len(v) for v in stalls.values()), default=0)
        req, byt = _per_round(w, None)
        lost, _ = _lost_after(sim, t_up)
        return {
            **row, "rounds": len(rounds), "close_s": round(got[1] - last, 3),
            "close_what": f"last newcomer ready -> all {n1} in one round (newcomers over {spread:g} s)",
            "stall_per_round_max_s": round(per_round, 3), "stall_total_max_s": round(total, 3),
            "restarts_per_running_node": restarts, "lost_steps": lost,
            "requests": round(req / max(1, len(rounds))), "bytes": round(byt / max(1, len(rounds))),
            "per_round_note": "whole scale-up / rounds", "light_nodes": len(_light(a, n1)), **_health(w),
            "round_info": _round_info(sim, t_up, t_up), "round_info_what": "round, world, first/last return (s after go)",
            "writes_per_s": round(w["etcd"].get("proposals", 0) / w["seconds"], 1),
            "ok": len(rounds) <= 2 and per_round <= 2.0 and total <= 4.0,
        }  # fmt: skip
    finally:
        sim.stop()
        SEEN_API.append(sim.api())


def _observe(
    sim: Sim, etcd: Etcd, name: str, target_pid: int, a: argparse.Namespace, n: int
) -> dict[str, Any]:
    m0 = Meter(sim, etcd.endpoint)
    os.kill(target_pid, signal.SIGSTOP)
    try:
        time.sleep(a.pause)
    finally:
        os.kill(target_pid, signal.SIGCONT)
    time.sleep(a.observe)
    w = Meter(sim, etcd.endpoint).since(m0)
    rounds = _rounds_after(sim, m0.t)
    lost, stops = _lost_after(sim, m0.t)
    return {
        "scenario": name, "n": n, "rounds": len(rounds), "close_s": None, "lost_steps": lost, "worker_stops": stops,
        "close_what": f"SIGSTOP {a.pause:g} s, then {a.observe:g} s watched",
        "writes_per_s": round(w["etcd"].get("proposals", 0) / w["seconds"], 1) if w["etcd"] else None,
        "target": "no round, no lost step", "ok": not rounds and lost == 0 and stops == 0,
    }  # fmt: skip


def scenario_faults(etcd: Etcd, a: argparse.Namespace) -> list[dict[str, Any]]:
    n = a.fault_n
    which = set(a.faults.split(","))
    straggler, victim = n, n - 1
    specs = [Spec(i) for i in range(n)]
    if "straggler" in which:
        specs.append(Spec(straggler, straggler=True))
    everyone = [s.idx for s in specs]
    sim = Sim(
        etcd.endpoint, specs, min_nodes=max(1, int(n * a.min_frac)), max_nodes=len(specs), expected=len(specs),
        conf=a.conf, per_proc=a.per_proc, step_s=a.step, solo=(victim,), run_id=f"faults{n}-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    t0 = sim.start()
    try:
        ids = list(range(n))
        if "straggler" in which:
            got = sim.wait_together(ids, a.straggler_wait)
            regs = [e[2] for e in sim.snapshot() if e[0] == "registered"]
            calls = [e[2] for e in sim.snapshot() if e[0] == "call"]
            last = max(calls) if calls else t0
            sim.release_stragglers()
            t_rel = time.monotonic()
            joined = sim.wait_together(everyone, a.timeout, after=t_rel)
            row = {
                "scenario": "straggler", "n": n, "rounds": len(_rounds_after(sim, t0)),
                "close_s": None if got is None else round(got[1] - last, 3),
                "close_what": f"last join -> the {n} in a round without the straggler (waited <= {a.straggler_wait:g} s)",
                "straggler_registered": bool(regs),
                "straggler_joined_s": None if joined is None else round(joined[1] - t_rel, 3),
                "writes_per_s": None, "target": "closes at the straggler deadline; straggler joins later",
                "ok": got is not None and joined is not None,
            }  # fmt: skip
            if got is None:
                row["error"] = f"no round without the straggler within {a.straggler_wait:g} s"
            rows.append(row)
            if joined is None:
                row["error"] = _fail(sim, "the straggler never got into a round with the others")
                return rows
        elif sim.wait_together(everyone, a.timeout) is None:
            rows.append({"scenario": "start", "n": n, "ok": False, "error": _fail(sim, "no first round")})
            return rows
        time.sleep(a.settle)
        s0 = Meter(sim, etcd.endpoint)
        time.sleep(min(a.window, 5.0))
        base = Meter(sim, etcd.endpoint).since(s0)
        # a clean round first (before any fault): the second size of the bytes-per-round fit
        d = _drain(sim, etcd.endpoint, everyone, base, a.timeout, who=everyone[1])
        rows.append({"scenario": "drain", **d, "rounds": 1 if d.get("ok") else None,
                     "close_what": "leave -> the others in one round", "writes_per_s": None,
                     "target": "bytes O(N)", "ok": d.get("ok", False)})  # fmt: skip
        if not d.get("ok"):
            return rows
        everyone.remove(everyone[1])
        time.sleep(a.settle)

        for name, pid in (("agent_pause", lambda: sim.pid_of(victim)), ("etcd_pause", lambda: etcd.proc.pid)):
            if name not in which:
                continue
            rows.append(_observe(sim, etcd, name, pid(), a, len(everyone)))
            if sim.wait_together(everyone, a.timeout) is None:
                rows[-1]["error"] = _fail(sim, f"no common round after the {name}")
                return rows
            time.sleep(a.settle)

        if "etcd_replaced" in which:
            row = {"scenario": "etcd_replaced", "n": len(everyone), "target": "<= 4 s after it answers"}
            t_kill = time.monotonic()
            etcd.stop()
            shutil.rmtree(etcd.data_dir, ignore_errors=True)
            time.sleep(a.replace_gap)
            etcd.start()
            ETCD_PID.append(etcd.proc.pid)
            t_ans = time.monotonic()
            got = sim.wait_together(everyone, a.timeout, after=t_kill)
            if got is None:
                row.update(ok=False, error=_fail(sim, f"no round on the new etcd within {a.timeout:.0f} s"))
                rows.append(row)
                return rows
            lost, _ = _lost_after(sim, t_kill)
            row.update({
                "rounds": len(_rounds_after(sim, t_kill)), "close_s": round(got[1] - t_ans, 3),
                "close_what": "new etcd answers -> everyone in one round on it", "lost_steps": lost,
                "writes_per_s": None, "ok": got[1] - t_ans <= 4.0,
            })  # fmt: skip
            rows.append(row)
            time.sleep(a.settle)
        return rows
    finally:
        sim.stop()
        SEEN_API.append(sim.api())


# ---- the field: real handlers beside light nodes, one event at a time ------------------------------
class FieldMeter(Meter):
    """A Meter that also reads the counts of the real handlers' processes and of the leader's."""

    def __init__(self, sim: Sim, endpoint: str, real_rows: list[int], leader_row: int) -> None:
        super().__init__(sim, endpoint)
        self.real = sim.io(real_rows)
        self.leader = sim.io([leader_row])

    def window(self, before: FieldMeter, n: int) -> dict[str, Any]:
        """What the window since ``before`` cost, with ``n`` participants: etcd writes, the
        events the watches delivered, the leader's reads, and the machine's health."""
        w = self.since(before)
        secs, io = w["seconds"], w["io"]
        real = {k: self.real[k] - before.real.get(k, 0) for k in self.real}
        lead = {k: self.leader[k] - before.leader.get(k, 0) for k in self.leader}
        wps = w["etcd"].get("proposals", 0) / secs if w["etcd"] else None
        light_watch = io["watch_events"] - real["watch_events"]
        return {
            "window_s": round(secs, 2),
            "writes_per_s": None if wps is None else round(wps, 2),
            "writes_per_node_s": None if wps is None else round(wps / n, 5),
            "requests_per_s": round(io["requests"] / secs, 1),
            "keepalives_per_s": round(io["keepalive"] / secs, 1),
            # the events the real handlers' watches delivered (every watch of each of them)
            "watch_events_real": int(real["watch_events"]),
            # the light processes' shared rounds watches: delivered, and once per node they serve
            "watch_events_light": int(light_watch),
            "watch_events_light_equiv": int(io["watch_events_equiv"]),
            "leader_range_reads": int(lead["read"]),
            "leader_lease_reads": int(lead["lease_read"]),
            "range_reads": int(io["read"]),
            "lease_reads": int(io["lease_read"]),
            "lease_reads_per_node": round(io["lease_read"] / n, 3),
            # of those: reads of a lease read less than rdzv_sim.REREAD_S before, and reads that
            # found 0-4 s left (TTL 6: renewed more than 1 s before; etcd rounds down)
            "lease_rereads": int(io["lease_reread"]),
            "lease_reads_low": int(io["lease_read_low"]),
            "io": io,
            **_health(w),
        }


def _wait_field(
    sim: Sim, ids: list[int], after: float, timeout: float, meter: Any
) -> tuple[tuple[Any, float] | None, FieldMeter | None]:
    """``Sim.wait_together``, and the meter at the first worker stop of one of ``ids`` after
    ``after`` (the next round seen open: what was read before it was read to open it)."""
    deadline = time.monotonic() + timeout
    opened: FieldMeter | None = None
    want = set(ids)
    while time.monotonic() < deadline:
        if opened is None and any(
            e[0] == "end" and e[2] > after and e[1] in want and e[6] != "left" for e in sim.snapshot()
        ):
            opened = meter()
        got = sim.together(ids, after)
        if got is not None or sim.errors():
            return got, opened
        time.sleep(0.05)
    return None, opened


def _field_event(
    sim: Sim,
    m0: FieldMeter,
    ids: list[int],
    t_ref: float,
    last: float,
    meter: Any,
    opened: FieldMeter | None = None,
    lost: int = 0,
) -> dict[str, Any]:
    """The row of one event that ended with ``ids`` in one round: rounds and lost steps since
    ``t_ref``, time to the round from ``last``, the window's costs; ``opened``: the meter when the
    round was seen open (the lease reads until then, and after it while the round formed).
    ``lost``: nodes the event removed; the window's lease reads are per node it began with (the
    lost node's lease is one of those read)."""
    time.sleep(0.5)  # the last answers of the round arrive
    w = meter().window(m0, len(ids) + lost)
    w["window_nodes"] = len(ids) + lost
    if opened is not None:
        w["open_s"] = round(opened.t - last, 3)
        w["lease_reads_to_open"] = int(opened.io["lease_read"] - m0.io["lease_read"])
        w["lease_reads_after_open"] = w["lease_reads"] - w["lease_reads_to_open"]
    got = sim.together(ids, t_ref)
    lost, stops = _lost_after(sim, t_ref)
    rounds = _rounds_after(sim, t_ref)
    return {
        "n": len(ids), "rounds": len(rounds), "close_s": None if got is None else round(got[1] - last, 3),
        "lost_steps": lost, "worker_stops": stops, "round_info": _round_info(sim, t_ref, t_ref),
        "round_info_what": "round, world, first/last return (s after the event)", **w,
    }  # fmt: skip


def scenario_field(etcd: Etcd, a: argparse.Namespace) -> list[dict[str, Any]]:
    """``--n`` participants (all but ``--real`` light nodes with ``--light-nodes``) start cold;
    then, each from the steady state before it: a join of 1 (a real handler), a burst of
    ``--burst`` (at once), a trickle of ``--trickle`` over ``--trickle-s`` s, and the hard loss
    of a real handler that does not lead (its peers' workers fail ``--fail-after`` s later, as
    their collectives would). A steady window of ``--window`` s after the cold start and after
    each event. Participant 0 (a real handler) registers first, alone in its process: it leads,
    and its process's counts are the leader's."""
    n, spread = a.n, a.arrival
    join1 = n
    burst = list(range(n + 1, n + 1 + a.burst))
    trickle = list(range(burst[-1] + 1 if burst else n + 1, (burst[-1] + 1 if burst else n + 1) + a.trickle))
    total = n + 1 + a.burst + a.trickle
    light = _light(a, n) | (set(burst) | set(trickle) if a.light_nodes else set())
    specs = [Spec(0)]
    for i in range(1, n):  # the other real handlers a moment after 0, so that 0 leads
        s = spread * i / max(1, n - 1)
        specs.append(Spec(i, arrive=s if i in light else a.leader_lead + (0.0 if light else s)))
    specs.append(Spec(join1, phase=1))
    specs += [Spec(i, phase=2) for i in burst]
    specs += [Spec(i, arrive=a.trickle_s * k / max(1, a.trickle - 1), phase=3) for k, i in enumerate(trickle)]
    sim = Sim(
        etcd.endpoint, specs, min_nodes=max(1, int(n * a.min_frac)), max_nodes=total, expected=n,
        conf=a.conf, per_proc=a.per_proc, step_s=a.step, solo=(0,), run_id=f"field{n}-{uuid.uuid4().hex[:6]}",
        light=light, **_light_opts(a),
    )  # fmt: skip
    leader_row = sim.row_of(0)
    real_rows = list(range(sim.n_real_groups))
    real_n = total - len(light)
    cfg = make_config(a.conf)

    def meter() -> FieldMeter:
        return FieldMeter(sim, etcd.endpoint, real_rows, leader_row)

    base = {"real": real_n, "light_nodes": len(light)}
    rows: list[dict[str, Any]] = []

    def steady(ids: list[int], after: str) -> bool:
        time.sleep(a.settle)
        s0 = meter()
        time.sleep(a.window)
        w = meter().window(s0, len(ids))
        r = len(_rounds_after(sim, s0.t))
        ok = r == 0 and (w["writes_per_node_s"] or 0) <= 0.1 and w["lease_reads"] == 0
        rows.append({"scenario": "steady", "after": after, "n": len(ids), "rounds": r, "close_s": None, **base,
                     **w, "target": "no round; <= 0.1 writes/s per node; no lease read", "ok": ok})  # fmt: skip
        return True

    m0 = meter()
    t0 = sim.start()
    try:
        ids = list(range(n))
        got = sim.wait_together(ids, spread + a.timeout)
        calls = [e[2] for e in sim.snapshot() if e[0] == "call"]
        last = max(calls) if calls else t0 + spread
        if got is None:
            rows.append({"scenario": "cold", "n": n, **base, "ok": False,
                         "error": _fail(sim, f"not all {n} in one round within {spread + a.timeout:.0f} s")})  # fmt: skip
            return rows
        ev = _field_event(sim, m0, ids, t0, last, meter)
        st = sim.state()
        ev["rank0"] = next((i for i, e in st.items() if e[0] == "ret" and e[4] == 0), None)
        rows.append({"scenario": "cold", **base, **ev, "close_what": f"last arrival -> all {n} in one round "
                     f"(arrivals over {spread:g} s)", "target": "<= 3 rounds; <= 3 s",
                     "ok": ev["rounds"] <= 3 and (ev["close_s"] or 1e9) <= 3.0})  # fmt: skip
        steady(ids, "cold")

        for name, phase, who, what in (
            ("join1", 1, [join1], "a join of 1 (a real handler)"),
            (f"burst{a.burst}", 2, burst, f"a burst of {a.burst} at once"),
            (f"trickle{a.trickle}", 3, trickle, f"a trickle of {a.trickle} over {a.trickle_s:g} s"),
        ):
            if not who:
                continue
            ids = ids + who
            m0 = meter()
            sim.set_expected(len(ids))  # the group's desired capacity: what launched
            time.sleep(a.hint_lead)
            t_go = sim.go(phase)
            got, opened = _wait_field(sim, ids, t_go, a.trickle_s + a.timeout, meter)
            calls = [e[2] for e in sim.snapshot() if e[0] == "call" and e[1] in who]
            last = max(calls) if calls else t_go
            if got is None:
                rows.append({"scenario": name, "n": len(ids), **base, "ok": False,
                             "error": _fail(sim, f"no round of all {len(ids)} after {what}")})  # fmt: skip
                return rows
            ev = _field_event(sim, m0, ids, t_go, last, meter, opened)
            rows.append({"scenario": name, **base, **ev, "close_what": f"{what}: last newcomer ready -> all in one round",
                         "target": "1 round; <= 3 s", "ok": ev["rounds"] == 1 and (ev["close_s"] or 1e9) <= 3.0})  # fmt: skip
            steady(ids, name)

        victim = next((i for i in ids if i != 0 and i not in light), None)
        if victim is None:
            return rows
        ids = [i for i in ids if i != victim]
        m0 = meter()
        sim.set_expected(len(ids))
        t_crash = time.monotonic()
        sim.crash(victim)
        sim.workers_fail(t_crash + a.fail_after)
        bound = cfg.ttl + 1.5
        got, opened = _wait_field(sim, ids, t_crash, bound + a.timeout, meter)
        ends = [e[2] for e in sim.snapshot() if e[0] == "end" and e[1] == victim and e[6] == "crashed"]
        t_lost = ends[-1] if ends else t_crash
        if got is None:
            rows.append({"scenario": "loss", "n": len(ids), **base, "ok": False,
                         "error": _fail(sim, f"no round of the {len(ids)} after the loss of {victim}")})  # fmt: skip
            return rows
        ev = _field_event(sim, m0, ids, t_crash, t_lost, meter, opened, lost=1)
        rows.append({"scenario": "loss", **base, **ev, "victim": victim,
                     "close_what": f"hard loss of a real non-leader (its peers' workers fail {a.fail_after:g} s "
                                   "later) -> the others in one round",
                     "target": f"1 round; <= ttl + 1.5 = {bound:g} s; lease reads <= 1 per node",
                     "ok": ev["rounds"] == 1 and (ev["close_s"] or 1e9) <= bound and ev["lease_reads_per_node"] <= 1})  # fmt: skip
        steady(ids, "loss")
        return rows
    finally:
        sim.stop()
        SEEN_API.append(sim.api())


def field_table(rows: list[dict[str, Any]]) -> str:
    """The field scenario's rows: one line per window."""
    lines = [
        "| window | N | rounds | time to a round | lost steps | etcd writes/s (per node) | watch events real / light (per-node equiv) "
        "| leader's range / lease reads | all range / lease reads (lease per node) | cores etcd / sim, load | late keepalives, leases lost | met |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        if "window_s" not in r:
            lines.append(f"| {r['scenario']} | {r['n']} | | | | | | | | | | NO: {r.get('error', '')} |")
            continue
        name = r["scenario"] + (f" after {r['after']}" if r.get("after") else "")
        c = r.get("cpu_cores") or {}
        lines.append(
            f"| {name} ({r['window_s']:g} s) | {r['n']} | {r['rounds']} | {_fmt(r.get('close_s'), ' s')} | "
            f"{_fmt(r.get('lost_steps'))} | {_fmt(r['writes_per_s'])} ({_fmt(r['writes_per_node_s'])}) | "
            f"{r['watch_events_real']} / {r['watch_events_light']} ({r['watch_events_light_equiv']}) | "
            f"{r['leader_range_reads']} / {r['leader_lease_reads']} | "
            f"{r['range_reads']} / {r['lease_reads']} ({r['lease_reads_per_node']:g})"
            f"{'' if r.get('lease_reads_to_open') is None else '; ' + str(r['lease_reads_to_open']) + ' to open'} | "
            f"{c.get('etcd', 0):g} / {c.get('participants', 0):g}, {r['load1']:g} | "
            f"{r['ka_late']}, {r['leases_lost']} | {'yes' if r.get('ok') else 'NO'} |"
        )
    return "\n".join(lines)


# ---- report ---------------------------------------------------------------------------------------
def _power(n1: float, y1: float, n2: float, y2: float, n: float) -> tuple[float, float]:
    """y = c N^k through two points: (y at n, k)."""
    if n1 == n2 or y1 <= 0 or y2 <= 0:
        return y2 * n / n2, 1.0
    k = math.log(y2 / y1) / math.log(n2 / n1)
    return y2 * (n / n2) ** k, k


def predict(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """What ``n`` nodes would cost, from the measured per-node costs (see the docstring of main)."""
    out: dict[str, Any] = {"n": n}
    steady = next(
        (
            r
            for r in rows
            if r["scenario"] == "steady" and r.get("ok") is not None and "writes_per_node_s" in r
        ),
        None,
    )
    if steady:
        out["writes_per_s"] = round(steady["writes_per_node_s"] * n)
        out["requests_per_s"] = round(steady["requests_per_s"] / steady["n"] * n)
        out["steady_from"] = f"per-node rates at N={steady['n']} x {n}"
    drains = sorted((r for r in rows if r["scenario"] == "drain" and r.get("ok")), key=lambda r: r["n"])
    for r in drains:  # light nodes: with what their own rounds watches would have received
        r.setdefault("bytes_equiv", r["bytes"])
        r.setdefault("bytes_equiv_per_node", r["bytes_per_node"])
    if len(drains) >= 2:
        a, b = drains[0], drains[-1]
        y, k = _power(a["n"], a["bytes_equiv"], b["n"], b["bytes_equiv"], n)
        out["bytes_per_round"] = round(y)
        out["bytes_exponent"] = round(k, 2)
        t, kt = _power(a["n"], max(a["close_s"], 1e-3), b["n"], max(b["close_s"], 1e-3), n)
        out["drain_close_s"] = round(t, 2)
        out["drain_close_exponent"] = round(kt, 2)
        out["bytes_per_round_linear"] = round(b["bytes_equiv_per_node"] * n)
        out["drain_from"] = (
            f"power law through the drain rounds at N={a['n']} and N={b['n']}; linear: per node at N={b['n']}"
        )
    elif drains:
        b = drains[-1]
        out["bytes_per_round"] = round(b["bytes_equiv_per_node"] * n)
        out["drain_from"] = f"bytes per node of the drain round at N={b['n']} x {n} (assumes O(N))"
    return out


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}{unit}"
    return f"{v}{unit}"


def _si(v: Any) -> str:
    if v is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= f:
            return f"{v / f:.1f} {unit}"
    return f"{v:.0f} B"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | N | rounds | time to close | requests/round | bytes/round | etcd writes/s | lost steps | other | target | met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        other = []
        if r["scenario"] == "steady":
            other.append(f"{r['writes_per_node_s']} writes/s per node, {r['requests_per_s']} req/s, "
                         f"{_si(r['bytes_per_s'])}/s, {r['rereads']} range reads and {r.get('full_rereads', 0)} "
                         f"full re-reads in {r['window_s']} s")  # fmt: skip
        if r["scenario"] == "scaleup" and "stall_per_round_max_s" in r:
            other.append(f"stall/round <= {r['stall_per_round_max_s']} s, total <= {r['stall_total_max_s']} s "
                         f"per running node ({r['restarts_per_running_node']} restarts)")  # fmt: skip
        if r["scenario"] == "straggler" and r.get("straggler_joined_s") is not None:
            other.append(f"straggler in a round {r['straggler_joined_s']} s after it joined")
        if r["scenario"] == "drain" and r.get("ok"):
            other.append(f"{_si(r['bytes_per_node'])} per node")
            if r.get("bytes_fanout"):
                other.append(f"{_si(r['bytes_equiv'])} ({_si(r['bytes_equiv_per_node'])} per node) with per-node "
                             "rounds watches")  # fmt: skip
        if r.get("round_info"):
            other.append("round sizes " + ", ".join(str(x[1]) for x in r["round_info"]))
        if r.get("snapshot_bytes"):
            other.append(f"{_si(r['snapshot_bytes'])} of reads of nodes/ (one per registration)")
        if r.get("cpu_cores"):
            c = r["cpu_cores"]
            other.append(
                f"cores: etcd {c['etcd']:g}, participants {c['participants']:g}, load {r['load1']:g}"
            )
        if r.get("leases_lost") or r.get("ka_late"):
            other.append(f"{r['leases_lost']} leases lost, {r['ka_late']} late keepalives")
        if r.get("error"):
            other.append(r["error"])
        close = _fmt(r.get("close_s"), " s")
        lines.append(
            f"| {r['scenario']} | {r['n']} | {_fmt(r.get('rounds'))} | {close} | {_fmt(r.get('requests'))} | "
            f"{_si(r.get('bytes'))} | {_fmt(r.get('writes_per_s'))} | {_fmt(r.get('lost_steps'))} | "
            f"{'; '.join(other)} | {r.get('target', '')} | {'yes' if r.get('ok') else 'NO'} |"
        )
    return "\n".join(lines)


def parse_conf(s: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in filter(None, s.split(",")):
        k, _, v = kv.partition("=")
        try:
            out[k.strip()] = float(v) if "." in v or v.isdigit() else v
        except ValueError:
            out[k.strip()] = v
    return out


def _etcd_version(binary: str) -> str:
    try:
        out = subprocess.run(
            [shutil.which(binary) or binary, "--version"], capture_output=True, text=True, timeout=10
        )
    except OSError as e:
        return f"? ({e})"
    return out.stdout.splitlines()[0] if out.stdout else "?"


def main(argv: list[str] | None = None) -> int:
    """Prediction for ``--predict`` nodes: steady-state writes and requests scale the measured
    per-node rates linearly; bytes and time per round follow the power law y = c N^k through the
    drain rounds measured at two sizes (``--fault-n`` and ``--n``; k is printed: 1 is O(N))."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenarios",
        default="cold,scaleup,faults",
        help="cold (cold+steady+drain), scaleup, faults, field (cold, then a join of 1, a burst, a trickle, a loss)",
    )
    ap.add_argument("--n", type=int, default=1000, help="participants of cold start / steady / drain")
    ap.add_argument("--arrival", type=float, default=60.0, help="cold start: arrivals spread over this (s)")
    ap.add_argument("--window", type=float, default=10.0, help="steady-state window (s)")
    ap.add_argument("--scale-from", type=int, default=256)
    ap.add_argument("--scale-to", type=int, default=512)
    ap.add_argument("--spread", type=float, default=90.0, help="scale-up: newcomers ready over this (s)")
    ap.add_argument(
        "--hint-lead",
        type=float,
        default=0.0,
        help="scale-up: the hint rises this long before the first newcomer is ready (s; AWS: a boot time)",
    )
    ap.add_argument("--fault-n", type=int, default=256, help="participants of the fault scenarios")
    ap.add_argument(
        "--straggler-wait", type=float, default=30.0, help="how long to wait for the round without it"
    )
    ap.add_argument(
        "--faults",
        default="straggler,agent_pause,etcd_pause,etcd_replaced",
        help="which fault scenarios (a drain round always ends them)",
    )
    ap.add_argument("--pause", type=float, default=3.0, help="SIGSTOP length (s)")
    ap.add_argument("--observe", type=float, default=6.0, help="watched after a pause (s)")
    ap.add_argument("--replace-gap", type=float, default=0.5, help="etcd down this long when replaced (s)")
    ap.add_argument("--min-frac", type=float, default=0.5, help="MIN = this x N")
    ap.add_argument("--step", type=float, default=0.2, help="a simulated training step (s)")
    ap.add_argument("--settle", type=float, default=2.0, help="pause between phases (s)")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound of every wait (s)")
    ap.add_argument("--per-proc", type=int, default=64, help="participants per process (threads)")
    ap.add_argument(
        "--conf", default="join_timeout=900", help="handler Config, k=v,... (unknown keys dropped)"
    )
    ap.add_argument("--predict", type=int, default=5000)
    ap.add_argument("--quick", action="store_true", help="N=16 everywhere, short windows (the test's mode)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--light",
        action="store_true",
        help="one keepalive thread per participant process (rdzv_sim.KeepaliveHub)",
    )
    ap.add_argument(
        "--etcd-binary", default="etcd", help="the etcd to run (e.g. Debian's /usr/bin/etcd, 3.4)"
    )
    ap.add_argument(
        "--light-nodes",
        action="store_true",
        help="cold and scaleup: all but --real participants are light nodes (bench/rdzv_light.py)",
    )
    ap.add_argument("--real", type=int, default=2, help="with --light-nodes: real handlers (they lead)")
    ap.add_argument("--burst", type=int, default=50, help="field: newcomers arriving at once")
    ap.add_argument("--trickle", type=int, default=20, help="field: newcomers arriving one by one ...")
    ap.add_argument("--trickle-s", type=float, default=20.0, help="field: ... evenly over this (s)")
    ap.add_argument(
        "--fail-after",
        type=float,
        default=0.3,
        help="field: after a hard loss, the real handlers' workers fail this much later (s; their collectives)",
    )
    ap.add_argument(
        "--leader-lead",
        type=float,
        default=1.0,
        help="field: the other real handlers arrive this long after 0 (s)",
    )
    ap.add_argument("--light-per-proc", type=int, default=250, help="light nodes per process")
    ap.add_argument("--light-ka-threads", type=int, default=4, help="keepalive threads per light process")
    ap.add_argument("--light-workers", type=int, default=8, help="request threads per light process")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # new defaults; flags given still win
        ap.set_defaults(n=16, fault_n=8, scale_from=8, scale_to=16, arrival=3.0, spread=3.0, window=3.0)
        ap.set_defaults(settle=1.0, timeout=30.0, straggler_wait=15.0, observe=4.0)
        ap.set_defaults(burst=4, trickle=3, trickle_s=2.0)
    a = ap.parse_args(argv)
    a.conf = parse_conf(a.conf)
    if a.light:
        os.environ["PETCTL_SIM_LIGHT"] = "1"  # the forked participant processes read it
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rdzv-scale-") as tmp:
        etcd = Etcd(Path(tmp), binary=a.etcd_binary)
        etcd.start()
        ETCD_PID.append(etcd.proc.pid)
        try:
            for sc in a.scenarios.split(","):
                t = time.monotonic()
                got = {
                    "cold": lambda: scenario_cold_steady_drain(etcd, a),
                    "scaleup": lambda: [scenario_scaleup(etcd, a)],
                    "faults": lambda: scenario_faults(etcd, a),
                    "field": lambda: [{**r, "field": True} for r in scenario_field(etcd, a)],
                }[sc]()
                died = etcd.proc is None or etcd.proc.poll() is not None
                for r in got:
                    r["api"] = SEEN_API[-1] if SEEN_API else "none"
                    if died:  # etcd 3.5.1 can panic under load ("unexpected error during txn")
                        r["ok"] = False
                        r["error"] = (r.get("error", "") + "; etcd exited: see its log").lstrip("; ")
                if died:  # the next scenario gets a fresh etcd
                    shutil.copy(etcd.root / "etcd.log", etcd.root.parent / f"etcd-died-{sc}.log")
                    etcd.stop()
                    shutil.rmtree(etcd.data_dir, ignore_errors=True)
                    etcd.start()
                    ETCD_PID.append(etcd.proc.pid)
                    print(json.dumps(r, default=str), file=sys.stderr, flush=True)
                rows += got
                print(f"[{sc}: {time.monotonic() - t:.0f} s]", file=sys.stderr, flush=True)
        finally:
            etcd.stop()
    pred = predict(rows, a.predict)
    print(table([r for r in rows if not r.get("field")]))
    if any(r.get("field") for r in rows):
        print("\n" + field_table([r for r in rows if r.get("field")]))
    print(f"\nprediction for {a.predict} nodes: {json.dumps(pred)}")
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "etcd": _etcd_version(a.etcd_binary),
        },  # fmt: skip
        "wall_s": round(time.monotonic() - t_all, 1),
        "rows": rows,
        "prediction": pred,
    }
    print(json.dumps(doc, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
