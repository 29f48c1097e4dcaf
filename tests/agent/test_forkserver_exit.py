"""Workers restarted from the torch-preloaded forkserver exit promptly ("Restarts
that never hang").

One forkserver with ``petctl_agent.worker.forkserver.PRELOAD`` serves every run, as in the agent; each
run starts 2 gloo ranks through torch's ``start_processes`` (start method ``forkserver``,
entry point ``worker.run_script``, output redirected as the agent does) and must finish,
with both ranks returning, within ``RUN_TIMEOUT``. Before the fix in ``run_script`` the
``tutorial`` script (``destroy_process_group()`` with DDP still alive) hung at exit in
about 1 run of 4 (see the module docstring of ``petctl_agent.worker.forkserver``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import time
from pathlib import Path

import pytest
from harness import free_port

from petctl_agent.worker.forkserver import PRELOAD, run_script

SCRIPT = Path(__file__).with_name("fs_exit_script.py")
RUNS = 20  # per mode
RUN_TIMEOUT = 20.0


def _run_once(restart: int, mode: str, log_dir: Path) -> str | None:
    """Start 2 ranks from the forkserver; None when both returned, else what went wrong."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    port = free_port()  # below the ephemeral range: no rank's outgoing connection takes it first
    envs = {
        r: {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCHELASTIC_RESTART_COUNT": str(restart),
        }
        for r in range(2)
    }
    pc = start_processes(
        name=f"{mode}{restart}",
        entrypoint=run_script,
        args={r: (str(SCRIPT), mode) for r in range(2)},
        envs=envs,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
        start_method="forkserver",
    )
    deadline = time.monotonic() + RUN_TIMEOUT
    result = None
    while result is None and time.monotonic() < deadline:
        result = pc.wait(0.2)
    if result is None:
        pids = pc.pids()
        pc.close()
        return f"{mode} restart {restart}: hung (no exit within {RUN_TIMEOUT:.0f}s), pids {pids}"
    if result.is_failed():
        return f"{mode} restart {restart}: failed {result.failures}"
    if result.return_values != {0: None, 1: None}:
        return f"{mode} restart {restart}: return values {result.return_values}"
    return None


@pytest.mark.timeout(300)
def test_forkserver_restarts_exit_without_hanging(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    problems: list[str] = []
    started = time.monotonic()
    for i in range(RUNS):
        for mode in ("plain", "tutorial"):
            problem = _run_once(i, mode, tmp_path / f"{mode}{i}")
            if problem and "EADDRINUSE" in problem:
                # another test process bound the port between free_port() and rank 0's bind: not
                # what this test is about, so once more on a fresh port (twice in a row still fails)
                problem = _run_once(i, mode, tmp_path / f"{mode}{i}-again")
            if problem:
                problems.append(problem)
    elapsed = time.monotonic() - started
    assert not problems, f"{len(problems)} of {2 * RUNS} runs bad ({elapsed:.0f}s): " + "; ".join(problems)
