"""A joining node's snapshot fetched agent to agent (``checkpointing/fetch.py``).

Real stores on a tmpfs-like directory, real servers on 127.0.0.1 over TCP, the real receive into
the store (pages allocated per piece, CRCs checked on arrival), the real fetch process started by
the agent's side (``SnapshotArea.after_round``) over a round store that is a dict (the real one,
etcd's, runs in ``test_memory_restore.py``'s agents). A peer that breaks is a socket server of the
test's own that speaks the protocol and then misbehaves: closes mid-stripe, sends other bytes.
What must hold: the newest step the most peers hold byte for byte is fetched, its stripes from
every holder; anything torn leaves no header and no file (the restore's own path, gloo then EFS,
takes over); a request without the node's token gets nothing; the workers wait for a fetch under
way, and never forever; the fetch never outlives that wait, nor the store.
"""

from __future__ import annotations

import json
import os
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
from petctl_agent.node.snapshots import SnapshotArea

NAME = "replicated"
N = 1 << 18  # fp32 elements per tensor: 1 MiB
TOKEN = "t0k3n"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": [torch.randn(N, generator=g) for _ in range(4)], "step": step}


def _write(d: Path, *steps: int, state_of=_state) -> None:
    w = SnapshotStore(d, NAME)
    for s in steps:
        assert w.write(state_of(s), s, wait=True) == "ok"
    w.close()


class _Counting(fetch.Server):
    """A real server that counts the bytes it sent (stripes from every holder)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.sent = 0
        self._count = threading.Lock()

    def _range(self, conn, req) -> None:
        super()._range(conn, req)
        with self._count:
            self.sent += int(req["n"])


@pytest.fixture
def serve():
    """Start a (counting) server on a store directory; every one is closed after the test."""
    made: list[fetch.Server] = []

    def start(d: Path, token: str = TOKEN) -> _Counting:
        srv = _Counting(SnapshotStore(d, NAME), "127.0.0.1", token).start()
        made.append(srv)
        return srv

    yield start
    for srv in made:
        srv.close()


def _src(srv: fetch.Server, token: str = TOKEN) -> fetch.Source:
    return ("127.0.0.1", srv.port, token)


def _new(d: Path) -> Path:
    d.mkdir(mode=0o700)  # the agent made the store before its workers start
    return d


def test_the_newest_step_comes_from_every_holder_into_the_store_and_loads(tmp_path: Path, serve) -> None:
    _write(tmp_path / "a", 4, 8)
    _write(tmp_path / "b", 8)
    _write(tmp_path / "old", 4)  # a node that holds only an older step: never a source of 8
    a, b, old = serve(tmp_path / "a"), serve(tmp_path / "b"), serve(tmp_path / "old")
    srcs = [_src(a), _src(b), _src(old)]
    out = fetch.fetch(_new(tmp_path / "new"), NAME, srcs, streams=4)
    assert out["status"] == "ok" and out["step"] == 8 and out["holders"] == 2, out
    # the servers count a range once its last byte went: by then the fetch may have returned
    assert _eventually(lambda: a.sent + b.sent == out["bytes"]), (a.sent, b.sent, out["bytes"])
    assert a.sent > 0 and b.sent > 0 and old.sent == 0, (a.sent, b.sent, old.sent)
    store = SnapshotStore(tmp_path / "new", NAME)
    got = store.load(8)
    assert got is not None and got["step"] == 8
    assert all(torch.equal(x, y) for x, y in zip(got["w"], _state(8)["w"]))
    assert fetch.fetched(tmp_path / "new", store.newest().header)
    assert json.loads((tmp_path / "new" / fetch.FETCHED).read_text())["status"] == "ok"
    # once there, a second fetch moves nothing: the node holds the step
    assert fetch.fetch(tmp_path / "new", NAME, srcs)["status"] == "have"


def _eventually(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_of_one_step_the_copy_most_peers_hold_is_taken(tmp_path: Path, serve) -> None:
    """Two holders of step 8 with the same bytes, one with other bytes under the same step (its
    digest differs): the stripes come only from the two that agree."""
    _write(tmp_path / "a", 8)
    _write(tmp_path / "b", 8)
    _write(tmp_path / "odd", 8, state_of=lambda s: _state(9))  # step 8, other bytes
    odd, a, b = serve(tmp_path / "odd"), serve(tmp_path / "a"), serve(tmp_path / "b")
    out = fetch.fetch(_new(tmp_path / "new"), NAME, [_src(odd), _src(a), _src(b)], streams=4)
    assert out["status"] == "ok" and out["holders"] == 2 and odd.sent == 0, out
    got = SnapshotStore(tmp_path / "new", NAME).load(8)
    assert all(torch.equal(x, y) for x, y in zip(got["w"], _state(8)["w"]))


def test_a_request_without_the_nodes_token_gets_nothing(tmp_path: Path, serve) -> None:
    _write(tmp_path / "a", 8)
    a = serve(tmp_path / "a")
    assert fetch._header_of(_src(a, "wrong")) is None
    assert fetch.fetch(_new(tmp_path / "new"), NAME, [_src(a, "wrong")])["status"] == "none"
    assert a.sent == 0 and SnapshotStore(tmp_path / "new", NAME).newest() is None
    with pytest.raises(ValueError):  # never on every interface of the node
        fetch.Server(SnapshotStore(tmp_path / "a", NAME), "0.0.0.0", TOKEN)


def _bad_peer(real: fetch.Server, mode: str) -> fetch.Source:
    """A peer that answers ``header`` as ``real`` would, then on ``range`` sends half the bytes and
    closes (``close``: it died mid-stripe), sends the right count of wrong bytes (``flip``), or
    sends half and then nothing more (``stall``: a frozen peer)."""
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
                        if mode == "flip":
                            conn.sendall(b"\x5a" * n)
                            continue
                        conn.sendall(b"\0" * (n // 2))
                        if mode == "stall":
                            time.sleep(30)
                        break
                except (OSError, fetch.Torn):
                    pass

    threading.Thread(target=run, daemon=True).start()
    return (*ls.getsockname()[:2], TOKEN)


@pytest.mark.parametrize("mode", ["close", "flip"])
def test_a_peer_that_dies_or_lies_mid_transfer_leaves_nothing_loadable(
    tmp_path: Path, serve, mode: str
) -> None:
    _write(tmp_path / "a", 8)
    real = serve(tmp_path / "a")
    # every stripe from the bad peer (it is the only holder named)
    out = fetch.fetch(_new(tmp_path / "new"), NAME, [_bad_peer(real, mode)], streams=2)
    assert out["status"].startswith("torn:"), out
    store = SnapshotStore(tmp_path / "new", NAME)
    assert store.newest() is None and store.load(8) is None
    assert not list((tmp_path / "new").glob(f"{NAME}.*.bin")), "a torn fetch left its pages in memory"
    assert not fetch.fetched(tmp_path / "new", real.store.newest().header)
    # the good holder still serves the next try
    assert fetch.fetch(tmp_path / "new", NAME, [_src(real)])["status"] == "ok"


def test_a_frozen_peer_ends_the_fetch_at_its_deadline_with_nothing_kept(tmp_path: Path, serve) -> None:
    _write(tmp_path / "a", 8)
    real = serve(tmp_path / "a")
    t = time.monotonic()
    out = fetch.fetch(_new(tmp_path / "new"), NAME, [_bad_peer(real, "stall")], streams=2, deadline_s=1.5)
    assert time.monotonic() - t < 10 and out["status"].startswith("torn:"), out
    assert SnapshotStore(tmp_path / "new", NAME).newest() is None
    assert not list((tmp_path / "new").glob(f"{NAME}.*.bin"))


def test_no_peer_no_room_and_no_store_are_outcomes_not_errors(tmp_path: Path, serve, monkeypatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = (*s.getsockname()[:2], TOKEN)
    assert fetch.fetch(_new(tmp_path / "new"), NAME, [dead])["status"] == "none"
    _write(tmp_path / "a", 8)
    real = serve(tmp_path / "a")
    # the node's store was freed (it left) before the fetch began: never made again
    assert fetch.fetch(tmp_path / "gone", NAME, [_src(real)])["status"] == "no store"
    assert not (tmp_path / "gone").exists()
    store = SnapshotStore(
        _new(tmp_path / "full"), NAME, meminfo=lambda: {"MemTotal": 8 << 30, "MemAvailable": 1 << 20}
    )
    monkeypatch.setattr(fetch, "SnapshotStore", lambda d, n: store)  # this node has no room for the step
    out = fetch.fetch(tmp_path / "full", NAME, [_src(real)])
    assert out["status"].startswith("no-fit"), out
    assert store.newest() is None


def test_the_workers_wait_for_a_fetch_under_way_and_not_longer_than_told(tmp_path: Path) -> None:
    assert fetch.wait_for_fetch(tmp_path, 5) == 0.0  # never fetched here: no wait
    fd = filelocks.hold(tmp_path / fetch.FETCH_LOCK)
    threading.Timer(0.3, lambda: os.close(fd)).start()
    waited = fetch.wait_for_fetch(tmp_path, 5)
    assert 0.25 <= waited < 3, waited
    fd = filelocks.hold(tmp_path / fetch.FETCH_LOCK)
    try:
        t = time.monotonic()
        fetch.wait_for_fetch(tmp_path, 0.3)  # a fetch that hangs: the restore goes on without it
        assert time.monotonic() - t < 2
    finally:
        os.close(fd)


class _RoundStore:
    """The round's store as ``after_round`` uses it (set, check, get), over a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, k: str, v: str) -> None:
        self.kv[k] = v.encode() if isinstance(v, str) else v

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, k: str) -> bytes:
        return self.kv[k]


def _area(d: Path) -> SnapshotArea:
    d.mkdir(mode=0o700, parents=True)
    area = SnapshotArea(d, serve_addr="127.0.0.1")
    area.start()  # the real persister process, serving the store on 127.0.0.1
    assert _eventually(lambda: (d / node_snapshots.SERVE_FILE).exists(), 30)
    return area


def test_a_joining_nodes_agent_fetches_as_the_round_closes_and_its_workers_wait(tmp_path: Path) -> None:
    """The agent's side, with real persisters serving: the survivor publishes (address, token,
    step), the empty node takes fetch.lock at once (before its workers start), hands it to the
    fetch process and the lock is free only once the step is in its store."""
    old, new = _area(tmp_path / "old"), _area(tmp_path / "new")
    try:
        _write(old.dir, 8)
        rs = _RoundStore()
        old.after_round(rs, 0, 2)  # the survivor: holds step 8, fetches nothing
        assert not (old.dir / node_snapshots.FETCH_LOCK).exists()
        pub = json.loads(rs.kv[f"{node_snapshots.SERVER_KEY}0"])
        assert pub["step"] == 8 and pub["token"] == old.token and pub["addr"] == "127.0.0.1"
        new.after_round(rs, 1, 2)
        assert filelocks.held(new.dir / fetch.FETCH_LOCK)  # taken before after_round returned
        waited = fetch.wait_for_fetch(new.dir, 30)  # what the workers' resume does
        got = SnapshotStore(new.dir, NAME).load(8)
        assert got is not None and got["step"] == 8, waited
        assert json.loads((new.dir / fetch.FETCHED).read_text())["status"] == "ok"
        # the next round: the node holds the step now, nothing is fetched again
        new.after_round(rs, 1, 2)
        assert not filelocks.held(new.dir / fetch.FETCH_LOCK)
    finally:
        old.close()
        new.close()
    assert not (tmp_path / "new").exists() and not (tmp_path / "old").exists()


def test_no_fetch_when_no_peer_holds_a_step_and_none_after_the_store_is_freed(tmp_path: Path) -> None:
    a, b = _area(tmp_path / "a"), _area(tmp_path / "b")
    try:
        rs = _RoundStore()
        a.after_round(rs, 0, 2)  # a cold start: neither holds anything
        t = time.monotonic()
        b.after_round(rs, 1, 2)
        assert fetch.wait_for_fetch(b.dir, 30) < 5 and b.fetcher is None  # nothing to fetch: no process
        assert time.monotonic() - t < 5
        # the agent closes the store (the node leaves) while its fetch thread still gathers the
        # servers; a now holds a step and publishes it: without the check a fetch would start
        _write(a.dir, 8)
        a.after_round(rs, 0, 2)
        b.close()
        b.dir.mkdir()  # only for the lock file below: the thread's own view of the store
        b._fetch(rs, [0], filelocks.hold(b.dir / fetch.FETCH_LOCK))
        assert b.fetcher is None and not list(b.dir.glob(f"{NAME}.*")), "a fetch filled a freed store"
    finally:
        a.close()
        b.close()


def test_the_agent_side_names_match_the_fetch_module() -> None:
    """node/ may not import checkpointing/: the file names it uses are fetch.py's."""
    assert node_snapshots.SERVE_FILE == fetch.SERVE_FILE
    assert node_snapshots.FETCH_LOCK == fetch.FETCH_LOCK
    assert node_snapshots.NAME == NAME


def test_a_range_names_its_snapshot_by_step_and_content(tmp_path: Path, serve) -> None:
    """A holder answers -1 for a step it does not hold, or holds with other bytes."""
    _write(tmp_path / "a", 8)
    real = serve(tmp_path / "a")
    h = real.store.newest().header
    for step, dig in ((8, peer.digest(h) ^ 1), (7, peer.digest(h))):
        with socket.create_connection(("127.0.0.1", real.port), timeout=5) as s:
            fetch._send(s, {"op": "range", "token": TOKEN, "step": step, "digest": dig, "lo": 0, "n": 16})
            assert struct.unpack(">q", fetch._exactly(s, 8))[0] == -1


def _big(step: int) -> dict:
    """64 MiB: more than the loopback's socket buffers hold, so a reader that stops stalls the send."""
    return {"w": [torch.full((1 << 22,), float(i + step)) for i in range(4)], "step": step}


def test_the_persisters_efs_write_waits_while_a_peer_fetches_and_not_longer_than_its_bound(
    tmp_path: Path, serve, monkeypatch
) -> None:
    """The agent's persister (``persist.serve``, its request written as a worker writes it) holds
    its EFS write while this node's server sends a range, and writes once the range is sent; with
    a peer that never reads, it writes anyway after ``YIELD_MAX`` seconds."""
    from petctl_agent.checkpointing import persist

    _write(tmp_path / "a", 5, state_of=_big)
    srv = serve(tmp_path / "a")
    h = srv.store.newest().header
    monkeypatch.setattr(persist, "YIELD_MAX", 60.0)

    def reader() -> socket.socket:  # a peer's stripe of the whole snapshot, not read yet
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        fetch._send(s, {"op": "range", "token": TOKEN, "step": 5, "digest": peer.digest(h), "lo": 0,
                        "n": int(h["size"])})  # fmt: skip
        assert struct.unpack(">q", fetch._exactly(s, 8))[0] == h["size"]
        assert srv.wait_quiet(0.3) >= 0.3  # the server is sending (stalled: nobody reads)
        return s

    def persisted(efs: Path, stop: threading.Event) -> threading.Thread:
        persist.request(tmp_path / "a", 5, efs, keep=2)
        t = threading.Thread(target=persist.serve, args=(tmp_path / "a", NAME), daemon=True,
                             kwargs={"stop": stop, "server": srv, "poll": 0.02})  # fmt: skip
        t.start()
        return t

    s, stop = reader(), threading.Event()
    t = persisted(tmp_path / "efs", stop)
    time.sleep(1.5)  # unheld, 64 MiB reach EFS in a fraction of that
    assert persist.state(tmp_path / "a") == {} and not (tmp_path / "efs" / "latest").exists()
    got = 0
    buf = bytearray(8 << 20)
    while got < h["size"]:  # the peer reads its stripe: the persist goes on
        k = s.recv_into(buf)
        assert k
        got += k
    s.close()
    assert _eventually(lambda: persist.state(tmp_path / "a").get("step") == 5, 20)
    stop.set()
    t.join(10)

    # a peer that never reads holds the write back YIELD_MAX seconds in all, no longer
    monkeypatch.setattr(persist, "YIELD_MAX", 0.5)
    _write(tmp_path / "a", 6, state_of=_big)
    s, stop = reader(), threading.Event()
    t0 = time.monotonic()
    t = persisted(tmp_path / "efs", stop)
    assert _eventually(lambda: persist.state(tmp_path / "a").get("step") == 6, 20)
    assert time.monotonic() - t0 >= 0.5
    stop.set()
    t.join(10)
    s.close()
