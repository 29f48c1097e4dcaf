"""ExitWatch (elastic/exitwatch.py) on the agent's real workers: torch's MultiprocessContext of
forkserver workers running ``run_script``."""

from __future__ import annotations

import os
import threading

import pytest

from petctl_agent.elastic.exitwatch import ExitWatch, exit_fds

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open on this platform")


def test_a_forkserver_worker_wakes_the_agent_once_torch_can_see_its_exit(tmp_path) -> None:
    """The agent's real case: torch's MultiprocessContext of forkserver workers (run_script). Its
    own check reads the worker's sentinel, which the forkserver makes readable only once it has
    reaped the child -- a pidfd is readable a moment earlier, and a wake then would be spent on
    a look that finds the workers healthy. So when the wake comes, torch already sees the exit;
    and the watch read nothing of the sentinel: torch still gets the exit code (75: a drain)."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    from petctl_agent.worker.forkserver import PRELOAD, run_script

    go = tmp_path / "go"
    script = tmp_path / "drain.py"
    script.write_text(
        f"import os, sys, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\nsys.exit(75)\n"
    )
    multiprocessing.set_forkserver_preload(PRELOAD)
    pc = start_processes(
        name="exitwatch",
        entrypoint=run_script,
        args={0: (str(script),), 1: (str(script),)},
        envs={r: {"RANK": str(r), "LOCAL_RANK": str(r)} for r in (0, 1)},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL),
        start_method="forkserver",
    )
    woke = threading.Event()
    w = ExitWatch(woke.set)
    try:
        fds = exit_fds(pc)
        assert len(fds) == 2  # one per worker, duplicates the watch owns
        assert w.watch(fds)
        assert not woke.wait(0.3) and pc.wait(0) is None  # both running
        go.touch()
        assert woke.wait(60)
        r = pc.wait(0)  # no waiting: torch sees the exit the moment the wake comes
        assert r is not None and r.is_failed()
        assert {f.exitcode for f in r.failures.values()} == {75}
    finally:
        w.stop()
        pc.close()
