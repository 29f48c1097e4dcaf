"""Run a user script inside a worker process forked from a pre-loaded forkserver.

Restart time of an elastic job is dominated by worker start-up: every restart
used to re-import torch (and ``torch._dynamo``, which ``torch.optim`` pulls in on
first use) in fresh interpreters -- 15-30 s per restart on a loaded 2-core box.
With ``PETCTL_AGENT_FORKSERVER`` (default on) the agent starts torch's workers
with the ``forkserver`` start method and a forkserver that has already imported
torch; each worker is a fork of it that runs the script with ``runpy`` as
``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python script.py args``
would set them.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.optim",
    "torch.nn.parallel",
    "torch._dynamo",
    "petctl_agent.worker",
]


def run_script(script: str, *args: str) -> None:
    """Entry point torch calls in each worker (must be importable/picklable)."""
    if os.environ.get("PETCTL_AGENT_NO_PDEATHSIG", "") != "1":
        # parent = the forkserver, which exits when the agent dies
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code in (None, 0):
            return  # torch waits for a return value from a successful worker
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    sys.stdout.flush()
    sys.stderr.flush()
