"""Where a machine's CPU went over a window: every process's CPU seconds, sampled from ``/proc``
a few times a second, summed by what the process is (its role in a local-cloud run).

A bench on one machine emulates several; when its cores are all busy over a membership change,
the change's time is the emulator's CPU, not what one node of the product would take on its own
cores. :class:`CpuAccount` says which it was: the busy cores over the window and the CPU seconds
of each role in it.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
#: a process's role, by the first of these its command line holds (in this order)
ROLES = (
    ("fetch", "checkpointing.fetch"),
    ("persister", "checkpointing.persist"),
    ("worker", "state_train.py"),
    ("worker", "elastic_train.py"),
    ("agent", "petctl-agent"),
    ("agent", "petctl_agent"),
    ("etcd", "etcd"),
    ("cloud", "petctl.local"),
    ("cloud", "moto"),
    ("cloud", "petctl"),
    ("worker", "multiprocessing"),
)


def role(cmd: str) -> str:
    """A command line's role (``""`` for none: a kernel thread or a zombie; ``other`` when none of
    :data:`ROLES` names it)."""
    if not cmd.strip():
        return ""  # a kernel thread, or a process that has exited (a zombie): named by its past
    for name, needle in ROLES:
        if needle in cmd:
            return name
    return "other"


def _snapshot() -> tuple[float, dict[int, tuple[str, float]], float]:
    """Now: every process's role and CPU seconds so far, and the machine's busy CPU seconds."""
    t = time.monotonic()
    procs: dict[int, tuple[str, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        r = role(cmd)
        if r != "persister":
            procs[int(d)] = (r, (int(st[11]) + int(st[12])) / TICK)
            continue
        for tid in os.listdir(f"/proc/{d}/task"):  # its serving threads apart from its nice writer
            try:
                with open(f"/proc/{d}/task/{tid}/stat") as f:
                    ts = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(tid)] = (f"{r} nice {ts[16]}", (int(ts[11]) + int(ts[12])) / TICK)
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    idle = cpu[3] + cpu[4]  # idle + iowait
    return t, procs, (sum(cpu[:8]) - idle) / TICK


class CpuAccount:
    """Samples every ``interval`` s in a thread until :meth:`close`; :meth:`window` sums a span."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._samples: list[tuple[float, dict[int, tuple[str, float]], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _snapshot()
            self._samples.append(s)
            del self._samples[: max(0, len(self._samples) - 3000)]  # the last 5 minutes at 0.1 s
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> dict[str, Any] | None:
        """From the sample at or before ``t0`` to the one at or after ``t1`` (monotonic times):
        ``seconds``, ``busy_cores`` (the machine's), ``cores``, and ``by_role`` (CPU seconds of
        each role: a process born inside the span counts from zero, one that ended inside it up
        to its last sample)."""
        s = list(self._samples)
        ts = [x[0] for x in s]
        i, j = max(0, bisect_left(ts, t0) - 1), bisect_left(ts, t1)
        if not s or j >= len(s) or i >= j:
            return None
        (ta, pa, ba), (tb, _, bb) = s[i], s[j]
        first: dict[int, float] = {pid: c for pid, (_, c) in pa.items()}
        named: dict[int, str] = {pid: r for pid, (r, _) in pa.items() if r}
        last: dict[int, float] = {}
        for _, procs, _ in s[i + 1 : j + 1]:  # a process that ended inside the span: its last sample
            for pid, (r, c) in procs.items():
                last[pid] = c
                if r:
                    named.setdefault(pid, r)
        by: dict[str, float] = {}
        for pid, c in last.items():
            r = named.get(pid, "kernel")
            by[r] = by.get(r, 0.0) + c - first.get(pid, 0.0)
        span = tb - ta
        return {"seconds": round(span, 2), "busy_cores": round((bb - ba) / span, 2), "cores": os.cpu_count(),
                "by_role": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.01}}  # fmt: skip
