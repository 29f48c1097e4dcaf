"""A rank that starts before rank 0's store listens connects as soon as it listens
(``distributed.await_listener``), and the probe it makes leaves the store whole.

torch's ``TCPStore`` client meets a refused connection with an exponential backoff: started
0.3-0.6 s before rank 0, it connected 0.29-0.82 s after rank 0 began its init (torch 2.13, this
box; ``bench/bench_store_connect.py`` measures both side by side). These tests check the
behaviour (when the wait returns, that the group works), not the time.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import threading
import time

import pytest
from harness import free_port

from petctl_agent.distributed import await_listener


def test_the_wait_returns_once_something_listens_and_not_before():
    port = free_port()
    listening = threading.Event()
    srv = socket.socket()

    def listen_later() -> None:
        time.sleep(0.3)
        srv.bind(("127.0.0.1", port))
        listening.set()  # before listen(): no connect can succeed before it, so no race with the assert
        srv.listen(8)

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        assert await_listener("127.0.0.1", port, 30)
        assert listening.is_set()  # it returned because the port listens, not at a deadline
    finally:
        t.join()
        srv.close()


def test_the_wait_tries_every_address_of_a_name(monkeypatch):
    # a name may resolve to ::1 first (localhost on many hosts) while the store listens on IPv4
    # only: the wait must try every address, as torch's client does, not poll the first for 60 s
    port = free_port()
    v4 = socket.getaddrinfo("127.0.0.1", port, type=socket.SOCK_STREAM)
    v6 = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: v6 + v4)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", port))
        srv.listen(8)
        assert await_listener("a-name", port, 2)


def test_the_wait_gives_up_at_its_deadline():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    assert not await_listener("127.0.0.1", port, 0.3)
    assert time.monotonic() - t0 >= 0.3


def test_the_wait_is_bounded_apart_from_the_stores_timeout(monkeypatch):
    # a rank 0 that never comes: the poll gives up at AWAIT_LISTENER_MAX, not after a whole store
    # timeout on top of the client's own; a name that does not resolve is not polled at all
    from petctl_agent import distributed

    monkeypatch.setattr(distributed, "AWAIT_LISTENER_MAX", 0.3)
    t0 = time.monotonic()
    assert not distributed.await_listener("127.0.0.1", free_port(), 1800)
    assert time.monotonic() - t0 < 30
    assert not distributed.await_listener("no-such-host.invalid", free_port(), 1800)


def test_rank_zero_never_waits_for_its_own_store(monkeypatch):
    """Rank 0 whose MASTER_ADDR is written otherwise than its node address (a name) makes its store
    without a pre-bound socket; it must not poll its own port, which nothing listens on yet."""
    dist = pytest.importorskip("torch.distributed")
    from petctl_agent import distributed

    calls: list[tuple] = []
    monkeypatch.setattr(distributed, "await_listener", lambda *a: calls.append(a) or True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("PETCTL_LOCAL_ADDR", "127.0.0.1")
    distributed.init_process_group("gloo", timeout_s=30)
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert calls == []


def test_the_probe_leaves_the_store_usable():
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    timeout = datetime.timedelta(seconds=20)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False,
                           master_listen_fd=sock.detach())  # fmt: skip
    for _ in range(5):  # several probes, as several ranks make
        assert await_listener("127.0.0.1", port, 10)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    client.set("k", "v")
    assert server.get("k") == b"v"
    server.set("back", "1")
    assert client.get("back") == b"1"


def _rank(rank: int, port: int, delay: float, q) -> None:  # noqa: ANN001
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), PETCTL_LOCAL_ADDR="127.0.0.1")  # fmt: skip
    import torch
    import torch.distributed as dist

    from petctl_agent.distributed import init_process_group

    time.sleep(delay)
    init_process_group("gloo", timeout_s=30)
    x = torch.ones(2) * (rank + 1)
    dist.all_reduce(x)
    q.put((rank, x.tolist()))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_that_starts_first_joins_rank_zero_that_starts_late():
    pytest.importorskip("torch.distributed")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, 1.0 if r == 0 else 0.0, q), daemon=True) for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        got = sorted(q.get(timeout=90) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    assert got == [(0, [3.0, 3.0]), (1, [3.0, 3.0])]
    assert [p.exitcode for p in procs] == [0, 0]


def test_a_plain_scripts_store_client_waits_through_the_forkserver_wrapper(monkeypatch):
    """``run_script`` installs ``connect_when_listening``: torch's own ``env://`` store creation
    (a plain script's ``init_process_group()``) then waits for rank 0's store as the helper does."""
    import importlib

    from petctl_agent.worker import forkserver

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setattr(rdzv, "_create_c10d_store", rdzv._create_c10d_store)  # undone after the test
    calls: list[tuple[str, int, bool]] = []

    def spy(addr: str, port: int, timeout_s: float) -> bool:
        got = await_listener(addr, port, timeout_s)
        calls.append((addr, port, got))
        return got

    monkeypatch.setattr("petctl_agent.distributed.await_listener", spy)
    assert forkserver.connect_when_listening()
    assert forkserver.connect_when_listening()  # idempotent: one wrapper
    assert not getattr(rdzv._create_c10d_store.__wrapped__, "_petctl_waits", False)

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    box: dict[str, object] = {}

    def rank0_late() -> None:
        time.sleep(0.3)
        box["server"] = rdzv._create_c10d_store("127.0.0.1", port, 0, 2, timeout)

    t = threading.Thread(target=rank0_late)
    t.start()
    client = rdzv._create_c10d_store("127.0.0.1", port, 1, 2, timeout)  # rank 1, before rank 0
    t.join()
    assert calls == [("127.0.0.1", port, True)]  # rank 1 waited, and found the store listening
    client.set("k", "v")
    assert box["server"].get("k") == b"v"  # type: ignore[attr-defined]
