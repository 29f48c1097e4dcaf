"""A joining node's snapshot fetched agent to agent (``checkpointing/fetch.py``, issue 20 stop 33).

Real stores on a tmpfs-like directory, real servers on 127.0.0.1 over TCP, the real receive into
the store (pages allocated per piece, CRCs checked on arrival). A peer that breaks is a socket
server of the test's own that speaks the protocol and then misbehaves: closes mid-stripe, sends
other bytes. What must hold: the newest step the most peers hold byte for byte is fetched, its
stripes from every holder; anything torn leaves no header and no file (the restore's own path,
gloo then EFS, takes over); the workers wait for a fetch under way, and never forever.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from petctl_agent import filelocks
from petctl_agent.checkpointing import fetch, peer
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.node import snapshots as node_snapshots

NAME = "replicated"
N = 1 << 18  # fp32 elements per tensor: 1 MiB


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": [torch.randn(N, generator=g) for _ in range(4)], "step": step}


def _holder(d: Path, *steps: int) -> fetch.Server:
    w = SnapshotStore(d, NAME)
    for s in steps:
        assert w.write(_state(s), s, wait=True) == "ok"
    w.close()
    return fetch.Server(SnapshotStore(d, NAME), "127.0.0.1").start()


class _Counting(fetch.Server):
    """A real server that counts the bytes it sent (stripes from every holder)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.sent = 0

    def _range(self, conn, req) -> None:
        super()._range(conn, req)
        self.sent += int(req["n"])


def test_the_newest_step_comes_from_every_holder_into_the_store_and_loads(tmp_path: Path) -> None:
    a = _holder(tmp_path / "a", 4, 8)
    b = _holder(tmp_path / "b", 8)
    old = _holder(tmp_path / "old", 4)  # a node that holds only an older step: never a source of 8
    counted = []
    for srv in (a, b):
        c = _Counting(srv.store, "127.0.0.1").start()
        counted.append(c)
    srcs = [("127.0.0.1", c.port) for c in counted] + [("127.0.0.1", old.port)]
    out = fetch.fetch(tmp_path / "new", NAME, srcs, streams=4)
    assert out["status"] == "ok" and out["step"] == 8 and out["holders"] == 2, out
    assert all(c.sent > 0 for c in counted), [c.sent for c in counted]  # both holders served stripes
    assert sum(c.sent for c in counted) == out["bytes"]
    store = SnapshotStore(tmp_path / "new", NAME)
    got = store.load(8)
    assert got is not None and got["step"] == 8
    assert all(torch.equal(x, y) for x, y in zip(got["w"], _state(8)["w"]))
    assert fetch.fetched(tmp_path / "new", store.newest().header)
    assert json.loads((tmp_path / "new" / fetch.FETCHED).read_text())["status"] == "ok"
    # once there, a second fetch moves nothing: the node holds the step
    assert fetch.fetch(tmp_path / "new", NAME, srcs)["status"] == "have"


def test_of_one_step_the_copy_most_peers_hold_is_taken(tmp_path: Path) -> None:
    """Two holders of step 8 with the same bytes, one with other bytes under the same step (its
    digest differs): the stripes come only from the two that agree."""
    a = _holder(tmp_path / "a", 8)
    b = _holder(tmp_path / "b", 8)
    w = SnapshotStore(tmp_path / "odd", NAME)
    assert w.write(_state(9), 8, wait=True) == "ok"  # step 8, other bytes
    w.close()
    odd = _Counting(SnapshotStore(tmp_path / "odd", NAME), "127.0.0.1").start()
    out = fetch.fetch(tmp_path / "new", NAME, [("127.0.0.1", s.port) for s in (odd, a, b)], streams=4)
    assert out["status"] == "ok" and out["holders"] == 2 and odd.sent == 0, out
    got = SnapshotStore(tmp_path / "new", NAME).load(8)
    assert all(torch.equal(x, y) for x, y in zip(got["w"], _state(8)["w"]))


def _bad_peer(real: fetch.Server, mode: str) -> tuple[str, int]:
    """A peer that answers ``header`` as ``real`` would, then on ``range`` sends half the bytes and
    closes (``close``: it died mid-stripe) or sends the right count of wrong bytes (``flip``)."""
    ls = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            with conn:
                try:
                    while True:
                        req = fetch._recv(conn)
                        if req["op"] == "header":
                            fetch._send(conn, real.store.newest().header)
                            continue
                        n = int(req["n"])
                        conn.sendall(struct.pack(">q", n))
                        if mode == "close":
                            conn.sendall(b"\0" * (n // 2))
                            break
                        conn.sendall(b"\x5a" * n)
                except (OSError, fetch.Torn):
                    pass

    threading.Thread(target=run, daemon=True).start()
    return ls.getsockname()[:2]


@pytest.mark.parametrize("mode", ["close", "flip"])
def test_a_peer_that_dies_or_lies_mid_transfer_leaves_nothing_loadable(tmp_path: Path, mode: str) -> None:
    real = _holder(tmp_path / "a", 8)
    bad = _bad_peer(real, mode)
    # every stripe from the bad peer (it is the only holder named)
    out = fetch.fetch(tmp_path / "new", NAME, [bad], streams=2)
    assert out["status"].startswith("torn:"), out
    store = SnapshotStore(tmp_path / "new", NAME)
    assert store.newest() is None and store.load(8) is None
    assert not list((tmp_path / "new").glob(f"{NAME}.*.bin")), "a torn fetch left its pages in memory"
    assert not fetch.fetched(tmp_path / "new", real.store.newest().header)
    # the good holder still serves the next try
    assert fetch.fetch(tmp_path / "new", NAME, [("127.0.0.1", real.port)])["status"] == "ok"


def test_no_peer_answers_and_no_room_are_outcomes_not_errors(tmp_path: Path, monkeypatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[:2]
    assert fetch.fetch(tmp_path / "new", NAME, [dead])["status"] == "none"
    real = _holder(tmp_path / "a", 8)
    store = SnapshotStore(
        tmp_path / "full", NAME, meminfo=lambda: {"MemTotal": 8 << 30, "MemAvailable": 1 << 20}
    )
    monkeypatch.setattr(fetch, "SnapshotStore", lambda d, n: store)  # this node has no room for the step
    out = fetch.fetch(tmp_path / "full", NAME, [("127.0.0.1", real.port)])
    assert out["status"].startswith("no-fit"), out
    assert store.newest() is None


def test_the_workers_wait_for_a_fetch_under_way_and_not_longer_than_told(tmp_path: Path) -> None:
    assert fetch.wait_for_fetch(tmp_path, 5) == 0.0  # never fetched here: no wait
    fd = filelocks.hold(tmp_path / fetch.FETCH_LOCK)
    threading.Timer(0.3, lambda: __import__("os").close(fd)).start()
    waited = fetch.wait_for_fetch(tmp_path, 5)
    assert 0.25 <= waited < 3, waited
    fd = filelocks.hold(tmp_path / fetch.FETCH_LOCK)
    try:
        t = time.monotonic()
        fetch.wait_for_fetch(tmp_path, 0.3)  # a fetch that hangs: the restore goes on without it
        assert time.monotonic() - t < 2
    finally:
        __import__("os").close(fd)


def test_the_agent_side_names_match_the_fetch_module() -> None:
    """node/ may not import checkpointing/: the file names it uses are fetch.py's."""
    assert node_snapshots.SERVE_FILE == fetch.SERVE_FILE
    assert node_snapshots.FETCH_LOCK == fetch.FETCH_LOCK
    assert node_snapshots.NAME == NAME


def test_a_range_names_its_snapshot_by_step_and_content(tmp_path: Path) -> None:
    """A holder answers -1 for a step it does not hold, or holds with other bytes."""
    real = _holder(tmp_path / "a", 8)
    h = real.store.newest().header
    for step, dig in ((8, peer.digest(h) ^ 1), (7, peer.digest(h))):
        with socket.create_connection(("127.0.0.1", real.port), timeout=5) as s:
            fetch._send(s, {"op": "range", "step": step, "digest": dig, "lo": 0, "n": 16})
            assert struct.unpack(">q", fetch._exactly(s, 8))[0] == -1
