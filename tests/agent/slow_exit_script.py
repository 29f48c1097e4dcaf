"""A worker whose process takes ``--exit-s`` seconds to exit, as one holding GiBs of state does
(the kernel frees it; 0.6 s for 1 GiB and its snapshot mappings on an idle box, seconds on a busy
one: docs/benchmarks.md).

- default: once a collective raised. A non-daemon thread holds the exit (``multiprocessing``
  joins such threads before the process ends). Steps through ``ckpt.step`` (the drain
  agreement, progress), so its agent sees it train.
- ``--on-sigterm``: once SIGTERM comes (the agent stopping it for a membership change). The
  collective is waited for in Python (``async_op``) so that the handler runs even while a frozen
  peer never answers; progress is reported without a collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from petctl_agent import checkpoint as ckpt
from petctl_agent.distributed import init_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--exit-s", type=float, default=6.0)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--on-sigterm", action="store_true")
    a = p.parse_args()
    if a.on_sigterm:

        def slow_exit(signum: int, frame: object) -> None:
            time.sleep(a.exit_s)
            os._exit(143)

        signal.signal(signal.SIGTERM, slow_exit)
    init_process_group("gloo")
    world = dist.get_world_size()
    t = torch.zeros(1)
    step = 0
    try:
        while True:
            step += 1
            if a.on_sigterm:
                work = dist.all_reduce(t, async_op=True)
                while not work.is_completed():
                    time.sleep(0.005)
                work.wait()
            else:
                dist.all_reduce(t)
            time.sleep(a.step_time)
            print(f"step={step} world_size={world} loss=0.0", flush=True)
            if a.on_sigterm:
                ckpt.report_progress(step, world)
            else:
                ckpt.step(step, dict, every=0, world_size=world)
    except Exception:
        threading.Thread(target=time.sleep, args=(a.exit_s,), name="slow-exit", daemon=False).start()
        raise


if __name__ == "__main__":
    main()
