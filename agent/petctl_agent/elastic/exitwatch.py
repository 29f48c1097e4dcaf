"""Wake the agent's loop the moment one of its workers has exited.

The loop (``PetctlElasticAgent._invoke_run``) looks at its workers once per ``monitor_interval``
(0.2 s) and waits in between for a membership change. A worker that exits at a coordinated stop
(a drain, a join) or on a failure its collective saw waited half an interval on average, up to
a whole one, before its agent opened the next round -- on every node, on the path of every
membership change. :class:`ExitWatch` waits on one file descriptor per worker and calls ``wake``
from a thread the moment one is readable.

Which descriptor: exactly what torch's own check reads, or the wake could come before torch can
see the exit (and be spent on a look that finds the workers healthy). A multiprocessing worker
(the forkserver's, the default) is seen through its ``sentinel``, a pipe that the forkserver makes
readable only once it has reaped the child and written its exit code: a duplicate of it is
watched (``poll`` only: never read, the exit code is torch's to read). A plain subprocess (a
binary entrypoint) is the agent's own child, seen through ``waitpid``: a pidfd (Linux 5.3),
readable once it has exited. Without either the loop polls as before.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any


def exit_fds(pc: Any) -> list[int]:
    """Descriptors that become readable when each of a torch ``PContext``'s workers has exited and
    torch can see it (the caller owns them): duplicates of the multiprocessing sentinels
    (``MultiprocessContext``), pidfds of the subprocesses (``SubprocessContext``)."""
    out: list[int] = []
    for proc in getattr(getattr(pc, "_pc", None), "processes", None) or []:
        try:
            out.append(os.dup(proc.sentinel))
        except (OSError, ValueError, AttributeError):
            pass  # closed already (joined), or not a multiprocessing process
    for handler in (getattr(pc, "subprocess_handlers", None) or {}).values():
        if hasattr(os, "pidfd_open") and handler.proc.poll() is None:
            try:
                out.append(os.pidfd_open(handler.proc.pid))
            except OSError:
                pass  # gone already: the loop's next look sees it
    return out


class ExitWatch:
    """One generation of workers at a time: :meth:`watch` ends the previous watch."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._gen = 0  # the running watch's; a replaced or stopped watch never wakes
        self._cancel: int | None = None  # write end of the running watch's pipe

    def watch(self, fds: list[int]) -> bool:
        """Call ``wake`` once, when the first of ``fds`` is readable, ending any earlier watch.
        The watch owns ``fds`` (closed when it ends). True when a thread now watches them."""
        self.stop()
        if not fds:
            return False
        try:
            r, w = os.pipe()
        except OSError:
            _close(fds)
            return False
        with self._lock:
            self._gen += 1
            gen, self._cancel = self._gen, w
        t = threading.Thread(target=self._run, args=(fds, r, gen), name="petctl-exit-watch", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread to be had: poll as before
            self.stop()
            _close([*fds, r])
            return False
        return True

    def _run(self, fds: list[int], cancel: int, gen: int) -> None:
        try:
            poll = select.poll()
            for fd in [*fds, cancel]:
                poll.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poll.poll()}
            with self._lock:
                current = gen == self._gen
            if current and cancel not in ready:
                self._wake()
        except Exception:  # noqa: BLE001 - only a speed-up: the loop polls anyway
            pass
        finally:
            _close([*fds, cancel])

    def stop(self) -> None:
        """End the running watch, if any, without a wake."""
        with self._lock:
            self._gen += 1
            w, self._cancel = self._cancel, None
        if w is None:
            return
        try:
            os.write(w, b"x")
        except OSError:
            pass  # the watch ended already (a worker exited): its read end is closed
        os.close(w)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
