"""The agent's SIGTERM/SIGINT handler only wakes the leave; the leave runs on a thread of its own.

A handler runs in the main thread, inside whatever that thread was doing. Run there, the leave
(which takes locks and joins threads) met a keepalive thread half-started and failed the agent
(``test_etcd_v3.py::test_a_revoke_from_a_signal_inside_the_keepalive_threads_start``), and it
would hang on any lock the main thread held at that moment.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from petctl_agent import main as agent_main


class Leaver:
    """The one method of the agent the handlers call, taking a lock as the real leave does."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.calls: list[tuple[str, bool]] = []

    def request_leave(self, reason: str) -> None:
        with self.lock:
            self.calls.append((reason, threading.current_thread() is threading.main_thread()))


@pytest.fixture
def handlers_restored() -> Iterator[None]:
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in old.items():
        signal.signal(s, h)


@pytest.mark.timeout(30)
def test_a_signal_while_the_main_thread_holds_a_lock_the_leave_takes(handlers_restored: None) -> None:
    lock = threading.Lock()
    agent = Leaver(lock)
    agent_main._install_signal_handlers(agent)
    with lock:
        signal.raise_signal(signal.SIGTERM)  # the handler runs now, here, with the lock held
        signal.raise_signal(signal.SIGINT)  # a second signal: the first reason stands
        time.sleep(0.3)
        assert agent.calls == []  # the leave waits for the lock; the main thread goes on
    deadline = time.monotonic() + 10
    while not agent.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert agent.calls == [("signal SIGTERM", False)]  # once, off the main thread
