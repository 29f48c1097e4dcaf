"""ExitWatch (elastic/exitwatch.py): the agent's loop is woken when a worker has exited and torch
can see it, not before, and never by a watch that a newer one replaced or stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from petctl_agent.elastic.exitwatch import ExitWatch, exit_fds

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open on this platform")


def _waiter() -> subprocess.Popen[bytes]:
    """A process that lives until its stdin closes."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def _subprocesses(*procs: subprocess.Popen[bytes]) -> SimpleNamespace:
    """What torch's SubprocessContext offers: ``subprocess_handlers`` with a ``proc`` each."""
    return SimpleNamespace(subprocess_handlers={i: SimpleNamespace(proc=p) for i, p in enumerate(procs)})


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "petctl-exit-watch"]


def _no_watch_thread_left() -> bool:
    deadline = time.monotonic() + 30
    while _watch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _watch_threads()


def test_a_wake_comes_when_a_worker_exits_and_not_before() -> None:
    woke = threading.Event()
    w = ExitWatch(woke.set)
    a, b = _waiter(), _waiter()
    try:
        assert w.watch(exit_fds(_subprocesses(a, b)))
        assert not woke.wait(0.3)  # both alive
        b.stdin.close()  # one of them exits
        assert woke.wait(60)
        assert b.wait(10) == 0 and a.poll() is None
    finally:
        a.stdin.close()
        a.wait(10)
    assert _no_watch_thread_left()  # one wake per watch: the thread is done


def test_a_replaced_or_stopped_watch_never_wakes() -> None:
    woke = threading.Event()
    w = ExitWatch(woke.set)
    old, new = _waiter(), _waiter()
    try:
        assert w.watch(exit_fds(_subprocesses(old)))
        assert w.watch(exit_fds(_subprocesses(new)))  # the next generation of workers: the old watch ends
        old.stdin.close()
        old.wait(10)
        assert not woke.wait(0.3)
        w.stop()
        assert _no_watch_thread_left()
        new.stdin.close()
        new.wait(10)
        assert not woke.wait(0.3)
    finally:
        for p in (old, new):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_nothing_to_watch() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    w = ExitWatch(lambda: None)
    assert exit_fds(_subprocesses(p)) == []  # reaped: nothing to wait for
    assert exit_fds(SimpleNamespace()) == []
    assert not w.watch([])
    assert not _watch_threads()
    w.stop()  # nothing running: a no-op
