"""The master port a round publishes comes from below the kernel's ephemeral range.

Rank 0's worker binds the published ``MASTER_PORT`` seconds after the rendezvous picked it. A port
from the ephemeral range (what binding port 0 gives) can meanwhile be taken by any outgoing
connection on the node, which costs a restart; none takes a port below the range.
"""

from __future__ import annotations

import socket

import pytest

from petctl_agent.rendezvous import joining


def test_the_master_port_is_below_the_ephemeral_range_and_bindable():
    low = joining._ephemeral_low()
    ports = {joining._free_port("127.0.0.1") for _ in range(50)}
    assert all(1024 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # picked at random, not one fixed port every node would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert joining._ephemeral_low(str(f)) == 40000
    assert joining._ephemeral_low(str(tmp_path / "missing")) == 32768


def test_a_taken_port_is_never_returned(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    busy = taken.getsockname()[1]
    real = joining.random.randint
    calls: list[int] = []

    def pick(a: int, b: int) -> int:
        # the taken port twice, then the real draws (a fixed third port could be taken too: CI
        # drew busy + 1 while another process held it, and the picks ran out)
        calls.append(1)
        return busy if len(calls) <= 2 else real(a, b)

    monkeypatch.setattr(joining.random, "randint", pick)
    try:
        assert joining._free_port("127.0.0.1") != busy
        assert len(calls) >= 3  # the taken port was tried, and refused, twice
    finally:
        taken.close()


def _pick_held_first(monkeypatch, module, held: int) -> list[int]:
    real = module.random.randint
    calls: list[int] = []

    def pick(a: int, b: int) -> int:
        calls.append(1)
        return held if len(calls) == 1 else real(a, b)

    monkeypatch.setattr(module.random, "randint", pick)
    return calls


def test_a_port_held_on_another_loopback_address_is_not_returned(monkeypatch):
    # A local-cloud node holds its store on its own 127.x.y.z; a worker's TCPStore that listens on
    # the wildcard fails on that port (EADDRINUSE), though 127.0.0.1 alone is free (seen in CI).
    import harness

    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        held = taken.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", held))  # the old check passed: 127.0.0.1 is free
        with pytest.raises(OSError):
            with socket.socket() as wild:
                wild.bind(("", held))  # ... but the wildcard bind a plain worker makes fails
        calls = _pick_held_first(monkeypatch, joining, held)
        assert joining._free_port("127.0.0.1") != held
        assert len(calls) >= 2
        monkeypatch.undo()
        calls = _pick_held_first(monkeypatch, harness, held)
        assert harness.free_port() != held
        assert len(calls) >= 2


def test_a_held_port_refuses_other_binders_and_takes_rank_0s_store():
    """From the join to rank 0's worker binding it, the agent holds the published port (bound on
    the wildcard, not listening, SO_REUSEADDR): a plain bind on any address fails, while torch's
    own TCPStore (a script's init_process_group) and the petctl helper's bound socket still
    listen on it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    held = joining._hold_port("127.0.0.1")
    port = held.getsockname()[1]
    try:
        assert 1024 <= port < joining._ephemeral_low()
        for host in ("127.0.0.1", "", "127.0.0.3"):
            with socket.socket() as other, pytest.raises(OSError):
                other.bind((host, port))
        with socket.socket() as helper:  # distributed.init_distributed's own bind, on the node address
            helper.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            helper.bind(("127.0.0.1", port))
            helper.listen(8)
        store = TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        store.set("k", "v")
        assert TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10)).get("k") == b"v"
    finally:
        held.close()
