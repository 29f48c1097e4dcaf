"""``run-job --live`` on the local cloud, through the CLI a user types: the rendezvous instance's
boot runs the job's lighthouse beside etcd, and each node's agent starts its workers once.

2 nodes -> a third joins -> one drains -> one is killed (hard loss, the group replaces it). Checked
from ``petctl status`` and the workers' own step lines (``petctl logs``):

- every node that was never lost or drained started its workers exactly once (one
  ``workers_started`` for the whole run): no survivor ever restarted;
- every node's committed steps are consecutive (a join, a drain or a loss cost no step), and every
  node that committed a step holds the same weights at it;
- the quorum grew to 3 and shrank to 2, as ``quorum`` events and the nodes' world sizes show.

Bounded polling only; the stalls are measured by bench/bench_live_local.py, not asserted here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

pytest.importorskip("torchft", reason="live mode needs torchft==0.2.0 (x86_64 wheels only)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "live_train.py"
STEP = re.compile(r"step=(\d+) world_size=(\d+) params=(\w+) mono=([\d.]+)")


def petctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "petctl.cli", "--local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status(job: str) -> dict:
    r = petctl("-o", "json", "status", job)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def workers(st: dict) -> list[dict]:
    return [h for h in st["hosts"] if h["role"] == "worker" and h.get("lifecycle_state") == "InService"]


def wait_for(job: str, what: str, cond, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = status(job)
        if cond(st):
            return st
        assert st["state"] not in ("FAILED", "SUCCEEDED"), (what, st["state"], st.get("reason"))
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {json.dumps(st['hosts'])} {st['events'][-10:]}")
        time.sleep(1)


def training_at(world: int, after: int = -1):
    def cond(st: dict) -> bool:
        ws = workers(st)
        return (
            len(ws) == world
            and all(h.get("agent_state") == "RUNNING" and h.get("world_size") == world for h in ws)
            and all((h.get("last_step") or -1) > after for h in ws)
        )

    return cond


def _drained(st: dict) -> set[str]:
    return {e["instance_id"] for e in st["events"] if e["kind"] == "drained"}


def step_lines(job: str) -> dict[str, dict[int, str]]:
    """Per instance, the weights' hash at each step it committed (its last line of that number: a
    discarded attempt repeats the number)."""
    r = petctl("-o", "json", "logs", job)
    assert r.returncode == 0, r.stderr
    out: dict[str, dict[int, str]] = defaultdict(dict)
    for line in r.stdout.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        m = STEP.search(rec["message"])
        if m:
            out[rec["stream"].split("/", 1)[1]][int(m[1])] = m[3]
    return out


def test_live_job_survivors_never_restart(local_home) -> None:
    assert petctl("setup").returncode == 0
    job = "live-e2e"
    r = petctl(
        "run-job", "--live", "--name", job, "--min", "1", "--max", "3", "--size", "2", "--drain-timeout", "60",
        str(EXAMPLE), "--", "--steps", "100000", "--step-time", "0.1", "--state-mb", "8",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    st = wait_for(job, "2 nodes training", training_at(2))
    first = {h["instance_id"] for h in workers(st)}

    assert petctl("scale", job, "--size", "3").returncode == 0
    st = wait_for(job, "3 nodes training", training_at(3, after=max(h["last_step"] for h in workers(st))))
    joiner = ({h["instance_id"] for h in workers(st)} - first).pop()

    assert petctl("scale", job, "--size", "2").returncode == 0
    at2 = training_at(2, after=max(h["last_step"] for h in workers(st)))
    # the survivors may step at 2 before the leaving node's workers have exited: its agent's
    # `drained` (published once they have) is waited for too, not assumed already shipped
    st = wait_for(job, "2 nodes after the drain, and the drain's end", lambda s: at2(s) and _drained(s))
    drained = _drained(st)
    assert len(drained) == 1, st["events"]
    alive = {h["instance_id"] for h in workers(st)}

    victim = sorted(alive)[0]
    r = subprocess.run(
        [sys.executable, "-m", "petctl.cli", "local", "kill-instance", victim],
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    st = wait_for(
        job,
        "2 nodes after the loss and its replacement",
        lambda s: (
            training_at(2, after=max(h["last_step"] or 0 for h in workers(st)))(s)
            and victim not in {h["instance_id"] for h in workers(s)}
        ),
    )
    survivors = {h["instance_id"] for h in workers(st)} & (first | {joiner})
    assert survivors, (first, joiner, workers(st))

    started = defaultdict(int)
    for e in st["events"]:
        if e["kind"] == "workers_started":
            started[e["instance_id"]] += 1
    # no survivor ever restarted its workers: one start each, through the join, the drain and the loss
    for node in survivors | drained:
        assert started[node] == 1, (node, dict(started))
    worlds = [e["world_size"] for e in st["events"] if e["kind"] == "quorum"]
    assert 3 in worlds and worlds[-1] == 2, worlds

    # every committed step once per node, consecutive; the same weights on every node at each step
    time.sleep(3)  # the shipper's last batch
    lines = step_lines(job)
    by_step: dict[int, set[str]] = defaultdict(set)
    for node, steps in lines.items():
        nums = sorted(steps)
        assert nums == list(range(nums[0], nums[-1] + 1)), (
            node,
            [n for n in range(nums[0], nums[-1]) if n not in steps],
        )
        for n, h in steps.items():
            by_step[n].add(h)
    for node in survivors:
        assert lines[node], (node, sorted(lines))
    disagree = {n: hs for n, hs in by_step.items() if len(hs) > 1}
    assert not disagree, sorted(disagree.items())[:5]

    r = petctl("kill-job", job, "--yes")
    assert r.returncode == 0, r.stderr
