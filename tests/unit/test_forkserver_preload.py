"""What the agent's forkserver preloads (worker/forkserver.py, PRELOAD) is imported once, in the
forkserver, and inherited by every worker forked from it. A petctl module there must therefore
neither start a thread at import (a fork keeps only the forking thread) nor read the environment
at import (it would see the agent's, not the worker's: RANK, PETCTL_SNAPSHOT_DIR, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from petctl_agent.worker import forkserver

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import collections.abc, json, os, sys, threading
mods = sys.argv[1:]
for m in [m for m in mods if not m.startswith("petctl_agent")]:
    __import__(m)  # torch's own: what torch reads and starts is torch's business


class Spy(collections.abc.MutableMapping):
    def __init__(self, real):
        self.real, self.read = real, []

    def __getitem__(self, k):
        self.read.append(k)
        return self.real[k]

    def __setitem__(self, k, v):
        self.real[k] = v

    def __delitem__(self, k):
        del self.real[k]

    def __iter__(self):
        self.read.append("<every variable>")
        return iter(self.real)

    def __len__(self):
        return len(self.real)


spy = Spy(os.environ)
os.environ = spy
before = {t.name for t in threading.enumerate()}
loaded = []
for m in [m for m in mods if m.startswith("petctl_agent")]:
    __import__(m)
    loaded.append(m)
started = sorted({t.name for t in threading.enumerate()} - before)
print(json.dumps({"read": spy.read, "started": started, "loaded": loaded}))
"""


def test_the_preloaded_petctl_modules_start_no_thread_and_read_no_environment() -> None:
    ours = [m for m in forkserver.PRELOAD if m.startswith("petctl_agent")]
    assert "petctl_agent.checkpoint" in ours  # the helper every restarted worker imports
    cp = subprocess.run(
        [sys.executable, "-c", PROBE, *forkserver.PRELOAD],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO / "agent"), "PATH": "/usr/bin:/bin", "PETCTL_SNAPSHOT_DIR": "/nowhere"},
    )
    assert cp.returncode == 0, cp.stderr
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got["loaded"] == ours
    assert got["started"] == [], got
    assert [
        k for k in got["read"] if k.startswith("PETCTL") or k in ("RANK", "LOCAL_RANK", "<every variable>")
    ] == [], got
