"""Run one Python process per rank of a small torch job (gloo, ``env://``) and wait for them all.

A rank that fails does not leave the others to wait out the whole timeout, and a job that hangs
fails with every rank's Python stack: on the deadline each rank gets SIGABRT, which faulthandler
(``PYTHONFAULTHANDLER``) answers by printing every thread's stack to the rank's stderr. A job whose
store could not bind its port (another test took it between the check and the bind) runs again on
another port; that is the harness's race, not the code under test.

    from tests.ranks import run_ranks
    done = run_ranks([sys.executable, "rank.py"], [{"X": "1"}, {"X": "2"}], timeout=120)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import free_port  # noqa: E402

from tests.zygote import zygote  # noqa: E402

#: how long the other ranks may go on after one failed before the job is called stuck
AFTER_FAILURE = 60.0
_PORT_TAKEN = ("address already in use", "EADDRINUSE")


class RanksFailed(AssertionError):
    """The job hung, or a rank failed while others waited; the message holds every rank's stderr."""


def run_ranks(
    cmd: list[str], envs: list[dict], timeout: float = 120, drop: tuple[str, ...] = (), tries: int = 3
) -> list:
    """Start ``cmd`` once per entry of ``envs`` (rank r: ``RANK=r``, ``WORLD_SIZE``, a fresh
    ``MASTER_PORT``, then ``envs[r]`` over this process's environment less ``drop``) and return
    each rank's ``CompletedProcess`` (stdout and stderr as text), in rank order."""
    for attempt in range(tries):
        done = _once(cmd, envs, timeout, drop)
        if attempt + 1 < tries and any(
            p.returncode and any(s in p.stderr for s in _PORT_TAKEN) for p in done
        ):
            continue
        return done
    return done


def _start(cmd: list[str], env: dict, out, err):
    """A rank: forked from this process's zygote (torch already imported) when ``cmd`` is
    ``[sys.executable, script, args...]``, else a fresh process."""
    z = zygote() if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py") else None
    if z is not None:
        return z.spawn(cmd, env, out, err)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)


def _once(cmd: list[str], envs: list[dict], timeout: float, drop: tuple[str, ...]) -> list:
    port = free_port()
    procs, outs = [], []
    for r, extra in enumerate(envs):
        e = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(len(envs)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONFAULTHANDLER": "1",
            **extra,
        }
        for k in ("PETCTL_LOCAL_ADDR", *drop):
            e.pop(k, None)
        # files, not pipes: a rank that prints a lot never blocks on a pipe nobody reads yet
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        outs.append((out, err))
        procs.append(_start(cmd, e, out, err))
    deadline = time.monotonic() + timeout
    stuck = ""
    failed_at = None
    while [p.poll() for p in procs].count(None):  # every rank polled: a returncode is set by poll()
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline:
            stuck = f"still running after {timeout:.0f} s"
        elif failed_at is not None and now - failed_at > AFTER_FAILURE:
            stuck = f"still running {AFTER_FAILURE:.0f} s after a rank failed"
        if stuck:
            break
        time.sleep(0.2)
    if stuck:
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in running:
            procs[r].send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        time.sleep(2)
        for p in procs:
            p.kill()
            p.wait()
    done = []
    for p, (out, err) in zip(procs, outs):
        out.seek(0)
        err.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if stuck:
        tails = "\n".join(
            f"---- rank {r} (rc {cp.returncode}{', stuck' if r in running else ''}) stderr:\n{cp.stderr[-6000:]}"
            for r, cp in enumerate(done)
        )
        raise RanksFailed(f"ranks {running} {stuck}\n{tails}")
    return done
