"""A live node (``run-job --live``): its workers never restart because of a change elsewhere.

Each local worker is its own torchft replica group (:mod:`petctl_agent.live.run`) and the agent
starts it once, as a plain process: no torch rendezvous, no torch elastic agent, nothing that a
join, a drain or a loss on another node could stop. The job's lighthouse, on the rendezvous
instance beside etcd, forms every step's quorum; a newcomer takes the state from a live peer.

What the agent still does, as on the restart path:

- **start**: one process per local rank (``python -u SCRIPT ARGS`` in the job's work dir), with
  the restart path's worker environment plus ``PETCTL_LIVE_LIGHTHOUSE``,
  ``PETCTL_LIVE_REPLICA_ID`` (the instance id), ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. Their
  stdout and stderr lie under ``logs/live/attempt_<n>/<local rank>/``, shipped like any worker's.
  Each start is a ``workers_started`` event, so a run shows that survivors never restarted.
- **success**: a worker that exits 0 has finished (every group shares the step count, so all
  finish at the same step); when every local worker has, the node has ``SUCCEEDED``.
- **a failed worker** (``workers_failed``): that worker alone starts again, under a new replica
  id, and heals from a live peer; the others go on. Past the job's ``max_restarts`` the node
  has ``FAILED``, and the job with it, as on the restart path.
- **a leave** (the drain hook, a spot notice, SIGTERM): the drain file; each worker leaves at its
  next step boundary (``step_done()`` returns False) and exits. Past the drain timeout, SIGTERM
  (which leaves at a boundary too), then SIGKILL. ``DRAINED``: the caller completes the
  lifecycle action.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.elastic.outcome import Outcome

log = logging.getLogger("petctl_agent")

#: after SIGTERM, how long a worker has to leave before SIGKILL
TERM_GRACE = 5.0
#: how often the agent looks at its workers (and its leave request)
POLL = 0.2
#: the worker's first act, before the script: die with the agent (as the restart path's workers
#: do), by SIGTERM, which a live worker answers by leaving at its next step boundary
_PDEATHSIG = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None).prctl(1,signal.SIGTERM);"
    "p=int(os.environ.get('PETCTL_AGENT_PID','0'));"
    "(p and os.getppid()!=p) and os._exit(70);"
    "os.execv(sys.executable,[sys.executable,'-u']+sys.argv[1:])"
)


def lighthouse_url(rdzv_endpoint: str, port: int) -> str:
    """The job's lighthouse: the rendezvous instance's address (``host:port`` of etcd), ``port``."""
    host = rdzv_endpoint.rsplit(":", 1)[0] if rdzv_endpoint.count(":") == 1 else rdzv_endpoint
    return f"http://{host}:{port}"


@dataclass
class Worker:
    local_rank: int
    attempt: int = 0
    proc: subprocess.Popen | None = None
    #: exit status once it has exited for good (0: finished, or left on a drain)
    done: int | None = None
    started_at: float = field(default_factory=time.monotonic)


class LiveNode:
    """This node's live workers, from their first start to the node's end (:meth:`run`)."""

    def __init__(
        self,
        *,
        python: str,
        script: Path,
        args: tuple[str, ...],
        nproc: int,
        env: MutableMapping[str, str],
        lighthouse: str,
        replica_id: str,
        logs_dir: Path,
        work_dir: Path,
        drain_file: Path,
        drain_timeout: float,
        max_restarts: int,
        pub: Any,
    ) -> None:
        self.python = python
        self.script = script
        self.args = args
        self.env = dict(env)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
            self.env.pop(k, None)  # no torch rendezvous: torchft forms the groups
        self.env["PETCTL_LIVE_LIGHTHOUSE"] = lighthouse
        # torchft's Rust side logs every step's quorum and commit at INFO (four lines a step, each
        # shipped to CloudWatch): warnings only, unless the job asks (--env RUST_LOG=info)
        self.env.setdefault("RUST_LOG", "warn")
        self.env["LOCAL_WORLD_SIZE"] = str(nproc)
        self.replica_id = replica_id
        self.logs_dir = logs_dir
        self.work_dir = work_dir
        self.drain_file = drain_file
        self.drain_timeout = drain_timeout
        self.max_restarts = max_restarts
        self.pub = pub
        self.leave_requested = threading.Event()
        self.leave_reason: str | None = None
        #: called before every start (the node agent's: the workers marker, the project's links, logs)
        self.before_workers_start: Callable[[], None] | None = None
        self.workers = [Worker(r) for r in range(nproc)]
        self.restarts = 0
        self._world: int | None = None
        self._quorum_read = 0.0
        self.fail_reason: str | None = None
        #: what :meth:`run` ended with; ``running`` meanwhile (the node agent's leave watcher reads it)
        self.phase = "init"

    def request_leave(self, reason: str) -> None:
        """Leave the job at the workers' next step boundary (any thread; the first reason wins)."""
        if self.leave_reason is None:
            self.leave_reason = reason
        self.leave_requested.set()

    # ---- one worker -----------------------------------------------------------------------
    def _start(self, w: Worker) -> None:
        out = self.logs_dir / "live" / f"attempt_{w.attempt}" / str(w.local_rank)
        out.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        env["LOCAL_RANK"] = str(w.local_rank)
        # a restarted worker is a new member: the lighthouse must not take it for the one that died
        env["PETCTL_LIVE_REPLICA_ID"] = self.replica_id + (f".r{w.attempt}" if w.attempt else "")
        with open(out / "stdout.log", "ab") as so, open(out / "stderr.log", "ab") as se:
            w.proc = subprocess.Popen(
                [self.python, "-u", "-c", _PDEATHSIG, str(self.script), *self.args],
                env=env,
                cwd=self.work_dir,
                stdout=so,
                stderr=se,
                stdin=subprocess.DEVNULL,
            )
        w.started_at = time.monotonic()
        w.done = None

    def _start_all(self, ws: list[Worker], restart: bool) -> None:
        if self.before_workers_start is not None:
            try:
                self.before_workers_start()
            except Exception as e:  # noqa: BLE001 - logs and markers must never stop a start
                log.debug("before_start: %s", e)
        for w in ws:
            self._start(w)
        self.pub.update(state="RUNNING", restarts=self.restarts)
        self.pub.event(
            "workers_started",
            pids=[w.proc.pid for w in ws if w.proc],
            local_ranks=[w.local_rank for w in ws],
            start_method="live",
            live=True,
            restart=restart,
        )

    def _stderr_tail(self, w: Worker, limit: int = 400) -> str:
        path = self.logs_dir / "live" / f"attempt_{w.attempt}" / str(w.local_rank) / "stderr.log"
        try:
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][-limit:] if lines else ""

    # ---- the node ---------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Start the workers and watch them until the node's end: SUCCEEDED, DRAINED or FAILED."""
        self.phase = "running"
        try:
            self.drain_file.unlink()  # an earlier agent's leave on this instance is not ours
        except FileNotFoundError:
            pass
        self._start_all(self.workers, restart=False)
        while True:
            if self.leave_requested.is_set():
                return self._drain()
            for w in self.workers:
                if w.done is not None or w.proc is None:
                    continue
                rc = w.proc.poll()
                if rc is None:
                    continue
                if rc == 0:
                    w.done = 0
                    continue
                outcome = self._failed(w, rc)
                if outcome is not None:
                    return outcome
            if all(w.done == 0 for w in self.workers):
                self.phase = "done"
                return Outcome.SUCCEEDED
            self._publish_quorum()
            time.sleep(POLL)

    def _publish_quorum(self) -> None:
        """The quorum's size, as the workers report it with their step (``report_progress``): the
        node's ``world_size`` (replica groups) and, when it changes, a ``quorum`` event."""
        now = time.monotonic()
        if now - self._quorum_read < 1.0:
            return
        self._quorum_read = now
        try:
            prog = json.loads(Path(knobs.progress_file(self.env) or "").read_text())
            world, step = int(prog["world_size"]), int(prog["step"])
            since = int(prog.get("since", step))
        except (OSError, ValueError, KeyError, TypeError):
            return
        if world != self._world:
            self._world = world
            self.pub.update(world_size=world)
            # ``round``: the step this quorum size first committed, the same on every member, so
            # the timeline groups the members' events into one round (petctl/timeline/parse.py)
            self.pub.event("quorum", world_size=world, step=step, round=since, live=True)

    def _failed(self, w: Worker, rc: int) -> Outcome | None:
        why = self._stderr_tail(w)
        code = f"signal {-rc}" if rc < 0 else f"exit {rc}"
        failures = f"local rank {w.local_rank}: {code}" + (f": {why}" if why else "")
        log.warning("live worker failed: %s", failures)
        self.pub.event(
            "workers_failed", exit_codes=[rc], failures=failures, local_rank=w.local_rank, live=True
        )
        if self.leave_requested.is_set():
            w.done = rc
            return self._drain()
        if self.restarts >= self.max_restarts:
            self.fail_reason = f"{failures} (after {self.max_restarts} restarts: the restart budget is spent)"
            self._stop(self._running())
            self.phase = "done"
            return Outcome.FAILED
        self.restarts += 1
        log.warning(
            "restarting local rank %d alone (%d of %d restarts used): it heals from a live peer",
            w.local_rank,
            self.restarts,
            self.max_restarts,
        )
        w.attempt += 1
        self._start_all([w], restart=True)
        return None

    def _running(self) -> list[Worker]:
        return [w for w in self.workers if w.proc is not None and w.proc.poll() is None]

    def _drain(self) -> Outcome:
        """Leave at a step boundary: the drain file, then SIGTERM past the drain timeout."""
        self.phase = "draining"
        t0 = time.monotonic()
        self.pub.update(state="DRAINING", reason=self.leave_reason)
        self.pub.event("drain_requested", reason=self.leave_reason, live=True)
        try:
            self.drain_file.parent.mkdir(parents=True, exist_ok=True)
            self.drain_file.write_text("leave")
        except OSError as e:
            log.warning("could not write the drain file (SIGTERM instead): %s", e)
            self._signal(self._running(), signal.SIGTERM)
        deadline = t0 + self.drain_timeout
        while self._running() and time.monotonic() < deadline:
            time.sleep(POLL / 4)
        sigterm = bool(self._running())
        self._stop(self._running())
        codes = sorted(
            {w.proc.returncode for w in self.workers if w.proc is not None}, key=lambda c: (c is None, c)
        )
        self.pub.event(
            "drained",
            clean=not sigterm,
            sigterm=sigterm,
            exit_codes=codes,
            seconds=round(time.monotonic() - t0, 3),
        )
        self.phase = "done"
        return Outcome.DRAINED

    @staticmethod
    def _signal(ws: list[Worker], sig: int) -> None:
        for w in ws:
            try:
                assert w.proc is not None
                os.kill(w.proc.pid, sig)
            except (OSError, AssertionError):
                pass

    def _stop(self, ws: list[Worker]) -> None:
        """SIGTERM (a live worker leaves at its next boundary), then SIGKILL after TERM_GRACE."""
        if not ws:
            return
        self._signal(ws, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        while any(w.proc is not None and w.proc.poll() is None for w in ws) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal([w for w in ws if w.proc is not None and w.proc.poll() is None], signal.SIGKILL)
        for w in ws:
            if w.proc is not None:
                w.proc.wait()
