"""The README's main job: an elastic job on the local cloud that trains, scales and recovers.

Drives the real CLI (``petctl --local …`` in subprocesses, exactly what a user
would type) through: setup → run_job --min 2 --max 4 → scale up → scale down
(drain) → hard-kill a node → run to completion → status timeline → kill_job.
Every wait is bounded and prints what it sees. The e2e tests run the same steps.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl.errors import PetctlError


def example_script() -> Path:
    """The example training script: from the source tree, or shipped next to the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "scripts" / "elastic_train.py", here.parent / "elastic_train.py"):
        if candidate.is_file():
            return candidate
    raise PetctlError("scripts/elastic_train.py not found; run the demo from a petctl checkout")


@dataclass
class Demo:
    """One run of the scripted scenario; ``log`` receives the progress lines."""

    total_steps: int = 800
    step_time: float = 0.1
    checkpoint_every: int = 20
    timeout: float = 240.0
    poll: float = 1.0
    log: Callable[[str], None] = print
    job: str = field(default_factory=lambda: f"demo-{secrets.token_hex(2)}")
    extra_env: dict[str, str] = field(default_factory=dict)
    page_dir: str | None = None  # where the timeline page goes (default: the current directory)
    _t0: float = field(default_factory=time.monotonic)
    milestones: list[dict[str, Any]] = field(default_factory=list)

    # -- running the CLI --------------------------------------------------------
    def petctl(self, *args: str, json_out: bool = True, check: bool = True) -> Any:
        cmd = (
            [sys.executable, "-m", "petctl.cli", "--local"]
            + (["-o", "json"] if json_out else [])
            + list(args)
        )
        env = {**os.environ, **self.extra_env}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if check and proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode} with no message"])[-1]
            raise PetctlError(f"`petctl --local {' '.join(args)}` failed: {last.removeprefix('Error: ')}")
        if not json_out:
            return proc.stdout
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    def say(self, message: str) -> None:
        self.log(f"[{time.monotonic() - self._t0:6.1f}s] {message}")

    def status(self) -> dict[str, Any]:
        return self.petctl("status", self.job)

    def wait_for(
        self, what: str, cond: Callable[[dict[str, Any]], bool], timeout: float | None = None
    ) -> dict[str, Any]:
        """Poll ``status`` until ``cond`` holds; print a line whenever the picture changes."""
        deadline = time.monotonic() + (timeout or self.timeout)
        last = None
        while True:
            st = self.status()
            line = describe(st)
            if line != last:
                self.say(f"  {line}")
                last = line
            if cond(st):
                self.milestones.append(
                    {"what": what, "t": round(time.monotonic() - self._t0, 1), "step": st.get("last_step")}
                )
                return st
            if st["state"] == "SUCCEEDED" and "finish" not in what:
                raise PetctlError(
                    f"job {self.job} finished before {what}; give it more --total-steps or a longer --step-time"
                )
            if st["state"] == "FAILED" and "FAILED" not in what:
                raise PetctlError(f"job {self.job} FAILED while waiting for {what}: {failure_reason(st)}")
            if time.monotonic() > deadline:
                raise PetctlError(
                    f"timed out after {timeout or self.timeout:.0f}s waiting for {what}; last: {line}"
                )
            time.sleep(self.poll)

    def kill_instance(self, instance_id: str, why: str) -> None:
        self.say(f"petctl local kill-instance {instance_id}  ({why})")
        subprocess.run(
            [sys.executable, "-m", "petctl.cli", "local", "kill-instance", instance_id],
            capture_output=True,
            timeout=120,
            check=True,
        )

    # -- the scenario -------------------------------------------------------------
    def run(self, keep: bool = False) -> dict[str, Any]:
        self.say("petctl --local setup  (base stack on the local cloud)")
        self.petctl("setup")
        self.say(f"petctl --local run-job --name {self.job} --min 2 --max 4 elastic_train.py")
        self.petctl(
            "run_job",
            "--name",
            self.job,
            "--min",
            "2",
            "--max",
            "4",
            "--drain-timeout",
            "60",
            str(example_script()),
            "--",
            "--total-steps",
            str(self.total_steps),
            "--step-time",
            str(self.step_time),
            "--checkpoint-every",
            str(self.checkpoint_every),
        )
        try:
            st = self.wait_for("training at world size 2", lambda s: stepping(s, 2))
            self.say(f"petctl --local scale {self.job} --size 3  (a node joins: re-rendezvous)")
            self.petctl("scale", self.job, "--size", "3")
            st = self.wait_for(
                "training at world size 3", lambda s, m=st["last_step"] or 0: stepping(s, 3, after=m)
            )
            self.say(
                f"petctl --local scale {self.job} --size 2  (a node drains: checkpoint, leave, re-rendezvous)"
            )
            self.petctl("scale", self.job, "--size", "2")
            st = self.wait_for(
                "training at world size 2 after the drain",
                lambda s, m=st["last_step"] or 0: stepping(s, 2, after=m),
            )
            victim = next(h["instance_id"] for h in st["hosts"] if h["role"] == "worker")
            self.kill_instance(victim, "hard node loss: the group replaces it")
            st = self.wait_for(
                "training again after the node loss",
                lambda s, m=st["last_step"] or 0, v=victim: (
                    stepping(s, 2, after=m) and v not in {h["instance_id"] for h in s["hosts"]}
                ),
            )
            server = next(h["instance_id"] for h in st["hosts"] if h["role"] == "rdzv")
            self.kill_instance(
                server,
                "the rendezvous server is lost: a new one takes its address, with a new etcd; "
                "the nodes re-rendezvous on it",
            )
            st = self.wait_for(
                "training again after the rendezvous server loss",
                lambda s, m=st["last_step"] or 0, v=server: (
                    stepping(s, 2, after=m)
                    and any(h["role"] == "rdzv" and h["instance_id"] != v for h in s["hosts"])
                ),
            )
            st = self.wait_for(
                "the job to finish", lambda s: s["state"] in ("SUCCEEDED", "FAILED"), timeout=self.timeout * 2
            )
            self.say(f"job {self.job}: {st['state']} at step {st['last_step']} (of {self.total_steps})")
            self.log(self.petctl("status", self.job, json_out=False))
            self.log(timeline(st))
            page = Path(self.page_dir or Path.cwd()) / f"{self.job}-timeline.html"
            self.petctl("timeline", self.job, "--html", str(page))
            self.say(f"petctl --local timeline {self.job} --html {page}  (open it in a browser)")
        finally:
            if not keep:
                self.say(f"petctl --local kill-job {self.job} --yes")
                self.petctl("kill_job", self.job, "--yes", check=False)
        return st


def failure_reason(st: dict[str, Any]) -> str:
    """Why a FAILED job failed: the status's reason (the failing boot's or agent's first error
    line), else its failed agents' reasons; never empty."""
    if st.get("reason"):
        return str(st["reason"])
    reasons = sorted(
        {str(a["reason"]) for a in st.get("agents", []) if a.get("state") == "FAILED" and a.get("reason")}
    )
    return (
        "; ".join(reasons) or f"no reason recorded; `petctl --local status {st.get('job')}` shows the hosts"
    )


def stepping(st: dict[str, Any], world: int, after: int = -1) -> bool:
    """All live workers RUNNING at ``world`` and the job past step ``after``."""
    workers = [
        h for h in st.get("hosts", []) if h["role"] == "worker" and h.get("lifecycle_state") == "InService"
    ]
    return (
        st.get("state") == "RUNNING"
        and len(workers) == world
        and all(h.get("agent_state") == "RUNNING" and h.get("world_size") == world for h in workers)
        and (st.get("last_step") or -1) > after
    )


def describe(st: dict[str, Any]) -> str:
    workers = [h for h in st.get("hosts", []) if h["role"] == "worker"]
    nodes = " ".join(f"{(h.get('private_ip') or '?')}:{h.get('agent_state') or '-'}" for h in workers)
    return (
        f"{st['state']:<10} world={st.get('world_size') or '-'} step={st.get('last_step') if st.get('last_step') is not None else '-'} "
        f"ckpt={st.get('last_checkpoint_step') if st.get('last_checkpoint_step') is not None else '-'} nodes=[{nodes}]"
    )


def timeline(st: dict[str, Any]) -> str:
    """What each membership change cost: the rounds table of ``petctl timeline``."""
    from petctl import timeline as tl

    return "timeline (stall: training stopped -> the new round's workers started)\n" + tl.rounds_table(
        tl.build(st)
    )
