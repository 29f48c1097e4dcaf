"""How one node's workers are asked to stop, and how long the agent waits for them.

Two ways: the drain file (a script that uses ``petctl_agent.checkpoint`` sees it, agrees with
every rank on a step, checkpoints it and exits 75) and SIGTERM (any script, as torchrun does).
The agent tells which applies from the node's progress file: once any worker on the node has
reported progress, the script uses the helper. :class:`WorkerStops` owns both files and the
waits; :class:`petctl_agent.elastic.agent.PetctlElasticAgent` decides when to stop and publishes it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from petctl_agent.elastic.decisions import classify_exits

log = logging.getLogger("petctl_agent.elastic")  # the torch agent's lines, under its logger as before

Monitor = Callable[[], RunResult]  # one look at the workers (torch's _monitor_workers)


@dataclass
class Drained:
    """How the workers ended in a drain."""

    result: RunResult
    sigterm: bool  # they were sent SIGTERM (a plain script, or stragglers at the drain timeout)
    clean: bool  # every worker stopped at the drain checkpoint, or ended on our SIGTERM
    codes: list[Any]  # the failed workers' exit codes
    started: float  # time.monotonic() when the drain began


class WorkerStops:
    """The drain file and the progress file of this node, and the waits on the workers."""

    def __init__(
        self, drain_file: Path, progress_file: Path, drain_probe: float, failure_file: Path | None = None
    ) -> None:
        self.drain_file = Path(drain_file)
        self.progress_file = Path(progress_file)
        #: written by a failing worker before it exits (``worker.forkserver.note_failure``)
        self.failure_file = (
            Path(failure_file) if failure_file else self.progress_file.with_name("failed.json")
        )
        self.drain_probe = drain_probe
        self._workers_started_at = time.time()
        self._notes_since = self._workers_started_at

    def workers_starting(self) -> None:
        """New workers must not see the previous drain request (nor the agent their predecessors'
        failure note)."""
        self._notes_since = time.time() - 1.0  # file times are coarser than time.time()
        for f in (self.drain_file, self.failure_file):
            try:
                f.unlink()
            except FileNotFoundError:
                pass

    def failure_noted(self) -> str | None:
        """What a current worker wrote when it began to fail (its error), while its process may
        still be exiting; None if none of them did."""
        try:
            # older: not these workers' (their start removed any note)
            if self.failure_file.stat().st_mtime < self._notes_since:
                return None
            body = json.loads(self.failure_file.read_text())
        except (OSError, ValueError):
            return None
        return str(body.get("error") or "?") if isinstance(body, dict) else None

    def failure_noted_at(self) -> float | None:
        """When a current worker wrote its failure note (its ``t``: the script raised); None if
        none did."""
        try:
            if self.failure_file.stat().st_mtime < self._notes_since:
                return None
            body = json.loads(self.failure_file.read_text())
            return float(body["t"]) if isinstance(body, dict) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def workers_started(self) -> None:
        self._workers_started_at = time.time()

    def uses_helper(self) -> bool:
        """Has any worker on this node ever reported progress? Then the script uses the helper
        (``petctl_agent.checkpoint``) and stops by itself at a drain checkpoint."""
        return self.progress_file.exists()

    def workers_progressed(self) -> bool:
        """Have the current workers reported a step? (If not, there is nothing to checkpoint.)"""
        try:
            return self.progress_file.stat().st_mtime > self._workers_started_at
        except OSError:
            return False

    def coordinated_stop(self, monitor: Monitor, timeout: float, leave: threading.Event) -> RunResult | None:
        """Ask the workers to checkpoint and stop (drain file); wait up to ``timeout``.

        Returns a RunResult only if the workers finished the job meanwhile.
        """
        self.drain_file.touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not leave.is_set():
            result = monitor()
            if result.state == WorkerState.SUCCEEDED:
                return result
            if result.state != WorkerState.HEALTHY:
                return None
            time.sleep(0.1)
        if not leave.is_set():
            log.warning("workers did not stop at a checkpoint within %.0fs; stopping them", timeout)
        return None

    def drain(self, monitor: Monitor, worker_pids: Iterable[Any], timeout: float) -> Drained:
        """Stop the workers for good: the drain file, then SIGTERM for what still runs.

        Workers that use the helper get the drain file and ``timeout``. Any other script (no
        progress within ``drain_probe`` s) -- and helper workers still running when ``timeout``
        is up -- gets SIGTERM, as torchrun does, and is waited for (the rest of ``timeout``, at
        least 5 s).
        """
        # "leave": this node's memory snapshot goes with it, so the workers wait for EFS when no
        # survivor can stand in for it (the rank-0 node, whose persister writes EFS, or every node
        # leaving; checkpointing/memory.py). A join's coordinated_stop leaves the file empty.
        # (a temp file renamed over it: a worker reading while write_text truncated would see an
        # empty file, i.e. a join's stop, and not wait for EFS)
        tmp = self.drain_file.with_name(f".{self.drain_file.name}.{os.getpid()}.tmp")
        tmp.write_text("leave\n")
        os.replace(tmp, self.drain_file)
        t0 = time.monotonic()
        deadline = t0 + timeout
        result = monitor()
        if not self.uses_helper():
            # nothing on this node ever reported progress: a plain script, or helper
            # workers that have not reached their first step yet. Give them a moment.
            probe_end = min(deadline, t0 + self.drain_probe)
            while time.monotonic() < probe_end and result.state == WorkerState.HEALTHY:
                if self.uses_helper():
                    break
                time.sleep(0.1)
                result = monitor()
        if self.uses_helper():
            while time.monotonic() < deadline and result.state == WorkerState.HEALTHY:
                time.sleep(0.1)
                result = monitor()
        sigterm = result.state == WorkerState.HEALTHY
        if sigterm:
            signal_workers(worker_pids, signal.SIGTERM)
            grace = max(deadline - time.monotonic(), 5.0)
            end = time.monotonic() + grace
            while time.monotonic() < end and result.state == WorkerState.HEALTHY:
                time.sleep(0.1)
                result = monitor()
        codes = [f.exitcode for f in result.failures.values()]
        if sigterm:  # a plain script: clean if every worker ended on our SIGTERM, not our SIGKILL
            clean = result.state != WorkerState.HEALTHY and -int(signal.SIGKILL) not in codes
        else:
            clean = result.state == WorkerState.SUCCEEDED or (
                result.state == WorkerState.FAILED and classify_exits(codes) == "drain"
            )
        return Drained(result, sigterm, clean, codes, t0)


def signal_workers(pids: Iterable[Any], sig: int) -> None:
    """Send ``sig`` to each worker pid (torch's ``Worker.id``; None before it started)."""
    for pid in pids:
        if pid is None:
            continue
        try:
            os.kill(int(pid), sig)
        except (ProcessLookupError, ValueError, TypeError):
            pass
