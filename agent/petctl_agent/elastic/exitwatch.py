"""Wake the agent's loop the moment one of its workers exits.

The loop (``PetctlElasticAgent._invoke_run``) looks at its workers once per ``monitor_interval``
(0.2 s) and waits in between for a membership change. A worker that exits at a coordinated stop
(a drain, a join) or on a failure its collective saw waited half an interval on average, up to
a whole one, before its agent opened the next round -- on every node, on the path of every
membership change. :class:`ExitWatch` holds a pidfd per worker (Linux 5.3, Python 3.9: readable
once the process has exited; the forkserver's children are not the agent's, which a pidfd does
not mind) and calls ``wake`` from a thread the moment one is readable. Where pidfds are missing
it watches nothing and the loop polls as before.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Iterable


class ExitWatch:
    """One generation of workers at a time: :meth:`watch` ends the previous watch."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._cancel: int | None = None  # write end of the running watch's pipe

    def watch(self, pids: Iterable[int]) -> bool:
        """Call ``wake`` once, when the first of ``pids`` exits (ending any earlier watch). True
        when a thread now watches them; False: no pidfd here, or every one had exited already
        (the loop's next look sees it)."""
        self.stop()
        if not hasattr(os, "pidfd_open"):
            return False
        fds = []
        for pid in pids:
            try:
                fds.append(os.pidfd_open(int(pid)))
            except OSError:
                pass  # gone already, or a kernel without pidfds
        if not fds:
            return False
        r, w = os.pipe()
        with self._lock:
            self._cancel = w
        threading.Thread(target=self._run, args=(fds, r), name="petctl-exit-watch", daemon=True).start()
        return True

    def _run(self, fds: list[int], cancel: int) -> None:
        try:
            poll = select.poll()
            for fd in [*fds, cancel]:
                poll.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poll.poll()}
            if cancel not in ready:
                self._wake()
        except Exception:  # noqa: BLE001 - only a speed-up: the loop polls anyway
            pass
        finally:
            for fd in [*fds, cancel]:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def stop(self) -> None:
        """End the running watch, if any, without a wake."""
        with self._lock:
            w, self._cancel = self._cancel, None
        if w is None:
            return
        try:
            os.write(w, b"x")
        except OSError:
            pass  # the watch ended already (a worker exited): its read end is closed
        os.close(w)
