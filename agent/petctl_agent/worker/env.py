"""What this node's workers get: their paths, environment and entry point, and what they report.

The agent writes the worker side of the contract here (docs/agent.md, "Environment": the
variables ``petctl_agent.checkpoint``/``distributed`` read in the workers) and reads back what
the workers report (the progress file, the checkpoint pointer) for the status document.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, checkpoint_dir

log = logging.getLogger("petctl_agent")

# Exec'd in each worker before the user script: die with the agent (SIGKILL on
# parent death). torch starts workers with start_new_session=True, so killing an
# agent (or its process group) would otherwise orphan its workers, and they would
# keep a dead node's ranks alive.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None).prctl(1,signal.SIGKILL);"
    "p=int(os.environ.get('PETCTL_AGENT_PID','0'));"
    "(p and os.getppid()!=p) and os._exit(70);"
    "os.execv(sys.executable,[sys.executable,'-u']+sys.argv[1:])"
)
#: how many [t, step] samples the status document keeps (``progress``)
PROGRESS_SAMPLES = 300


class Paths:
    """The node-local agent directory (``PETCTL_AGENT_DIR``)."""

    def __init__(self, agent_dir: Path) -> None:
        agent_dir = agent_dir.absolute()  # workers run in the job's work dir, not here
        self.root = agent_dir
        self.code = agent_dir / "code"
        self.logs = agent_dir / "logs"
        self.drain = agent_dir / "drain"
        self.progress = agent_dir / "progress.json"
        self.failed = agent_dir / "failed.json"


def job_checkpoint_dir(efs: Path, spec: JobSpec) -> Path:
    """The job's checkpoints on the shared filesystem (the spec's, else the contract's default)."""
    return efs / (spec.checkpoint_dir or checkpoint_dir(spec.job_name))


def job_work_dir(efs: Path, spec: JobSpec) -> Path:
    """Where workers start: ``<efs>/petctl/jobs/<job>/work``, shared by every node of the job."""
    return efs / "petctl" / "jobs" / spec.job_name / "work"


def omp_num_threads(env: Any, nproc: int) -> str | None:
    """What torchrun does: OMP_NUM_THREADS=1 when unset and more than one worker per node."""
    if "OMP_NUM_THREADS" not in env and nproc > 1:
        return "1"
    return None


def export_worker_env(
    env: MutableMapping[str, str],
    spec: JobSpec,
    paths: Paths,
    ckpt_dir: Path,
    work_dir: Path,
    local_addr: str,
    nproc: int,
    backend: str,
    settings: Settings,
    snapshot_dir: Path | None = None,
) -> None:
    """Worker env = agent env (``env``, updated in place) + torchrun's vars (set by torch) + these."""
    from petctl_agent.elastic.handlers import torch_workaround  # torch: only once the internals check passed

    env.update(spec.env)
    omp = omp_num_threads(env, nproc)
    if omp is not None:
        log.warning(
            "Setting OMP_NUM_THREADS environment variable for each process to be %s in default, "
            "to avoid your system being overloaded, please further tune the variable for optimal "
            "performance in your application as needed.",
            omp,
        )
        env["OMP_NUM_THREADS"] = omp
    env["PETCTL_WORK_DIR"] = str(work_dir)
    env["PETCTL_JOB_NAME"] = spec.job_name
    env["PETCTL_CHECKPOINT_DIR"] = str(ckpt_dir)
    env["PETCTL_DRAIN_FILE"] = str(paths.drain)
    env["PETCTL_PROGRESS_FILE"] = str(paths.progress)
    env["PETCTL_FAILURE_FILE"] = str(paths.failed)
    env["PETCTL_LOCAL_ADDR"] = local_addr
    env["PETCTL_AGENT_PID"] = str(os.getpid())
    if snapshot_dir is not None:  # the node's memory-snapshot store (node/snapshots.py)
        env["PETCTL_SNAPSHOT_DIR"] = str(snapshot_dir)
    else:
        env.pop("PETCTL_SNAPSHOT_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    # our SIGTERM/SIGINT handlers start a drain; torch's would raise SignalException.
    # (torch 2.5-2.8 ignore this variable and install theirs anyway: the agent puts
    # its own back after every worker start, PetctlElasticAgent._restore_signal_handlers.)
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP,SIGQUIT")
    if torch_workaround("SPLIT_STORE", backend, settings):
        # etcd-v2 + shared agent TCPStore: a node joining a running job waits
        # forever for MASTER_ADDR of the new round (DESIGN §4). Workers get
        # their own store on rank 0's node instead. (petctl-etcd's agent store
        # is not its rendezvous: the round record carries MASTER_ADDR/PORT.)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if settings.enabled("IDENTICAL_RANKS"):
        # homogeneous nodes: ranks = group_rank * nproc + local_rank, computed
        # locally instead of rank 0 collecting every node's role info through
        # the store (another place a lost node blocks the store timeout).
        env["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"


def worker_entrypoint(
    script: Path, args: tuple[str, ...], settings: Settings, python: str | None = None
) -> tuple[Any, tuple[str, ...], str]:
    """``(entrypoint, args, start_method)`` of torch's ``WorkerSpec`` for the user's script.

    With ``FORKSERVER`` every worker forks from a forkserver that imported torch once
    (``petctl_agent.worker.forkserver``; the caller warms it first); else a fresh interpreter, behind the
    ``PDEATHSIG`` shim unless that is off. ``python``: the job's environment's interpreter
    (node/jobenv.py), else the agent's.
    """
    if settings.enabled("FORKSERVER"):
        from petctl_agent.worker.forkserver import run_script

        return run_script, (str(script), *args), "forkserver"
    exe = python or sys.executable
    if settings.enabled("PDEATHSIG"):
        return exe, ("-c", _PDEATHSIG_SHIM, str(script), *args), "spawn"
    return exe, ("-u", str(script), *args), "spawn"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class StepInfo:
    """What the workers report, for the status document: ``last_step``, ``last_step_at``,
    ``progress`` (the last :data:`PROGRESS_SAMPLES` ``[t, step]`` pairs, one per step change
    seen) and ``last_checkpoint_step``. Called from the status thread and the main one."""

    def __init__(self, progress_file: Path, ckpt_dir: Path | None = None) -> None:
        self.progress_file = progress_file
        self.ckpt_dir = ckpt_dir
        self._samples: deque[list[float | int]] = deque(maxlen=PROGRESS_SAMPLES)
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        prog = _read_json(self.progress_file)
        if prog:
            step = prog.get("step")
            out["last_step"] = step
            t = prog.get("t")
            if t is None:
                try:
                    t = self.progress_file.stat().st_mtime
                except OSError:
                    t = None
            out["last_step_at"] = t
            with self._lock:
                if (
                    isinstance(step, int)
                    and t is not None
                    and (not self._samples or self._samples[-1][1] != step)
                ):
                    self._samples.append([round(float(t), 3), step])
                out["progress"] = list(self._samples)
        if self.ckpt_dir is not None:
            latest = _read_json(self.ckpt_dir / "latest")
            if latest:
                out["last_checkpoint_step"] = latest.get("step")
        return out
