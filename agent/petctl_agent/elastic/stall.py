"""Workers that stopped making progress: a hard loss on real AWS seen from the data plane.

An instance that vanishes (a spot reclaim whose notice was not honoured, a kernel panic, a
network partition, power) sends no RST: its peers' collectives do not fail, they hang (gloo
until its timeout, NCCL until its watchdog: minutes). Nothing fails, so the lease reads that a
worker failure starts (``rendezvous/fastloss.py``) never run, and the loss was seen only when the
dead node's lease expired (the TTL, 6 s). The agent reads the node's progress file
(``$PETCTL_PROGRESS_FILE``, written each step by ``report_progress``) on every pass of its
monitor loop; no new step for :func:`stall_after` seconds is a **stall**, and the agent then
asks its handler to read the running round's leases (``workers_stalled``), once per stall (a
new step re-arms it). A stall never restarts anything by itself: a slow step, a long
checkpoint, a paused agent or etcd find every lease kept alive and nothing happens.

The rule: no new step for ``max(STALL_MIN_S, STALL_FACTOR x the median of the last
STALL_SAMPLES step times)``, capped at ``STALL_MAX_S``; nothing before two step times are known.
- ``STALL_FACTOR`` (3): a loaded box, a GC pause, a data loader hiccup make single steps
  up to ~2x the median; 3x passes those. A false stall costs only O(N) lease reads on one node
  (every lease kept alive: no round), so the rule may be eager.
- ``STALL_MIN_S`` (1 s): in a stall's window a lease is read as lapsed only after 4.5 s of
  silence (``decide.stall_lapse_after``: it rides through a 3 s pause of another node's agent),
  so looking earlier than ~1 s after the loss gains nothing and turns every scheduling hiccup of
  a 10 ms step into lease reads.
- ``STALL_MAX_S`` (4 s): the dead node's key is deleted at the TTL (6 s, plus etcd's expiry
  sweep) and its lease reads lapsed from ~5 s; a stall seen later would open the round no
  sooner than the expiry does. Steps slower than 4/3 s are therefore read after 4 s of
  silence: one read per kept-alive lease per window (``decide.heard_since``), every lease kept
  alive (an agent paused up to 3 s too), no round.
- the median of the last ``STALL_SAMPLES`` (8): one slow step (a checkpoint) does not move it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

STALL_MIN_S = 1.0
STALL_FACTOR = 3.0
STALL_MAX_S = 4.0
STALL_SAMPLES = 8


def stall_after(step_times: Sequence[float]) -> float | None:
    """How long without a new step is a stall, given the times (s) of the last steps (oldest
    first, each the time one step took); None while fewer than two are known."""
    recent = [float(s) for s in step_times if s >= 0][-STALL_SAMPLES:]
    if len(recent) < 2:
        return None
    return min(STALL_MAX_S, max(STALL_MIN_S, STALL_FACTOR * statistics.median(recent)))


class StallWatch:
    """The current workers' steps, as the progress file shows them to the agent's monitor loop.

    :meth:`poll` (each pass of the loop) returns ``"stalled"`` once per stall (no new step for
    :func:`stall_after`), ``"resumed"`` at the first new step after one, else None.
    :meth:`reset` when new workers start (their first steps are not compared with the old ones').
    """

    def __init__(self, progress_file: Path) -> None:
        self.progress_file = Path(progress_file)
        self._times: deque[float] = deque(maxlen=STALL_SAMPLES)
        self._last: tuple[int, float, float] | None = None  # (step, its t, seen at: monotonic)
        self._stalled = False
        self._mtime = 0.0

    def reset(self) -> None:
        self._times.clear()
        self._last = None
        self._stalled = False

    @property
    def stalled(self) -> bool:
        return self._stalled

    def _read(self) -> tuple[int, float] | None:
        try:
            mtime = self.progress_file.stat().st_mtime
            if self._last is not None and mtime == self._mtime:
                return None  # unchanged: no read
            body = json.loads(self.progress_file.read_text())
            self._mtime = mtime
        except (OSError, ValueError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("step"), int):
            return None
        return body["step"], float(body.get("t") or mtime)

    def poll(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        got = self._read()
        if got is not None and (self._last is None or got[0] != self._last[0]):
            step, t = got
            if self._last is not None and step > self._last[0] and t > self._last[1]:
                # the time of one step, from the worker's clock: the loop samples the file (every
                # monitor_interval, 0.2 s), so fast steps are seen a few at a time
                self._times.append((t - self._last[1]) / (step - self._last[0]))
            self._last = (step, t, now)
            if self._stalled:
                self._stalled = False
                return "resumed"
            return None
        if self._last is None or self._stalled:
            return None
        limit = stall_after(self._times)
        if limit is not None and now - self._last[2] >= limit:
            self._stalled = True
            return "stalled"
        return None

    def silence(self, now: float | None = None) -> float | None:
        """Seconds since the last new step was seen (None before one)."""
        if self._last is None:
            return None
        return (time.monotonic() if now is None else now) - self._last[2]
