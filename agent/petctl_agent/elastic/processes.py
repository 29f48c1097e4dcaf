"""Our workers' processes, as the agent handles them beside torch: which are still running, a
signal sent without waiting, the SIGTERM before a restart's rendezvous and the SIGKILL
``LOSS_STOP_GRACE`` after it for a loss, the wake of the main loop when one exits, and our own
SIGTERM/SIGINT handlers put back over the ones torch installs.

A mixin of :class:`petctl_agent.elastic.agent.PetctlElasticAgent`, whose state it shares; torch's
stop itself (SIGTERM, then SIGKILL after 30 s) stays the agent's ``_stop_workers`` hook.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from petctl_agent.elastic.handlers import ours

log = logging.getLogger("petctl_agent.elastic")

#: seconds from the SIGTERM of a restart for a loss (nodes named gone) or of stalled workers to
#: the SIGKILL of workers still running (torch's own stop waits 30 s; a join keeps it): a process holding GiBs of state exits in 0.6 s/GiB idle, a few
#: seconds on a busy box (tests/agent/test_failing_worker.py: 6 s); one hung in a collective
#: whose Python SIGTERM handler cannot run never exits by itself
LOSS_STOP_GRACE = 10.0


def live_worker_pids(pc: Any) -> list[int]:
    """The pids of a torch ``PContext``'s workers that are still running (never one reaped, whose
    pid the kernel may have given to another process). Functions (the forkserver's
    ``run_script``): ``MultiprocessContext``; binaries: ``SubprocessContext``."""
    out: list[int] = []
    for proc in getattr(getattr(pc, "_pc", None), "processes", None) or []:
        if proc.is_alive():
            out.append(proc.pid)
    for handler in (getattr(pc, "subprocess_handlers", None) or {}).values():
        if handler.proc.poll() is None:
            out.append(handler.proc.pid)
    return out


def own_signal_handlers() -> dict[int, Any]:
    """Our SIGTERM/SIGINT handlers, as installed now (from the main thread only): torch 2.5-2.8
    install their own every time workers start (``PContext.start``); ours turn SIGTERM into a
    drain, and :meth:`WorkerProcesses._restore_signal_handlers` puts them back."""
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            h = signal.getsignal(sig)
            if callable(h) and h not in (signal.default_int_handler,):
                handlers[sig] = h
    return handlers


class WorkerProcesses:
    """The process side of :class:`~petctl_agent.elastic.agent.PetctlElasticAgent` (see the module
    docstring)."""

    _pcontext: Any
    _worker_group: WorkerGroup
    _exit_seen_at: float | None
    _exited: threading.Event
    _own_signal_handlers: dict[int, Any]
    #: when our workers were SIGTERMed for a membership change (the stop is then bounded)
    _sigterm_at: float | None
    _stop_bounded: bool

    def _wake_loop(self) -> None:
        """A worker exited (ExitWatch's thread): the loop looks at the workers now."""
        if self._exit_seen_at is None:
            self._exit_seen_at = time.time()
        self._exited.set()
        mine = ours(self._worker_group.spec.rdzv_handler)
        if mine is not None:
            mine.wake()

    def _restore_signal_handlers(self) -> None:
        """Put our SIGTERM/SIGINT handlers back if torch replaced them while starting workers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._own_signal_handlers.items():
            if signal.getsignal(sig) is not handler:
                log.info("torch replaced the %s handler; re-installing the agent's", signal.Signals(sig).name)
                signal.signal(sig, handler)

    def _sigterm_before_rendezvous(self) -> None:
        """SIGTERM our workers before joining the next round (they exit meanwhile); the stop is
        bounded (:meth:`_kill_after_grace`) only for a loss (the change names nodes gone) or workers
        that stalled (hung in a collective): a join, a drain, a re-join keep torch's 30 s, which
        a script's own SIGTERM handler (saving a checkpoint) may need, and a rendezvous longer
        than the grace must not SIGKILL them at once."""
        self._signal_workers(signal.SIGTERM)
        self._sigterm_at = time.monotonic() if self._stop_bounded else None
        self._stop_bounded = False

    def _kill_after_grace(self) -> None:
        """Before torch's stop (SIGTERM, then SIGKILL after 30 s): workers SIGTERMed before the
        rendezvous for a change that names nodes gone, or while they were stalled
        (:meth:`_sigterm_before_rendezvous`), get ``LOSS_STOP_GRACE`` from that SIGTERM, then
        SIGKILL. A worker hung in a collective with a lost peer (no reset on real AWS: gloo waits
        for its timeout, NCCL for its watchdog) whose script handles SIGTERM in Python never runs
        the handler (the main thread is inside the C++ wait): it held the restart for torch's 30 s."""
        at, self._sigterm_at = self._sigterm_at, None
        if at is not None:
            while live_worker_pids(self._pcontext) and time.monotonic() - at < LOSS_STOP_GRACE:
                time.sleep(0.05)
            if live_worker_pids(self._pcontext):
                log.warning(
                    "workers still running %.0fs after SIGTERM (hung in a collective?): SIGKILL",
                    LOSS_STOP_GRACE,
                )
                self._signal_workers(signal.SIGKILL)

    def _signal_workers(self, sig: signal.Signals) -> None:
        """Send ``sig`` to our live workers without waiting (torch's close() sends the same and
        waits, after the rendezvous)."""
        for pid in live_worker_pids(self._pcontext):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
