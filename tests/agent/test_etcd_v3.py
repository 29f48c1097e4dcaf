"""The etcd v3 client (``petctl_agent.rendezvous.etcdv3``) against a real etcd 3.5.

Starts etcd: run under the heavy-test lock (``flock /tmp/petctl-heavy.lock``). About 35 s.
``PETCTL_TEST_ETCD34=/path/to/etcd`` (3.4, e.g. Debian's etcd-server) also runs the smoke test
against that binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from harness import Etcd, EtcdCerts, wait_for

from petctl_agent.rendezvous import etcd_ops, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    e = Etcd(tmp_path_factory.mktemp("etcd-v3"))
    e.start()
    yield e
    e.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[Etcd]:
    """An etcd of the test's own, for tests that stop or replace it."""
    e = Etcd(tmp_path)
    e.start()
    yield e
    e.resume()
    e.stop()


@pytest.fixture
def client(etcd: Etcd) -> v3.Client:
    return v3.connect(etcd.endpoint, timeout=5)


def raft_writes(c: v3.Client) -> tuple[int, int, float]:
    """(store revision, raft index, proposals committed): what moves on any raft write."""
    s = c.status()
    return s.revision, s.raft_index, c.metrics()["etcd_server_proposals_committed_total"]


def test_crud_prefix_and_revisions(client: v3.Client) -> None:
    p = "/t/crud/"
    r1 = client.put(p + "a", "1")
    r2 = client.put(p + "b", b"\x00\xff")
    client.put("/t/crud0", "outside the prefix")
    assert r2.revision == r1.revision + 1
    rng = client.range(p, prefix=True)
    assert [(kv.key, kv.value) for kv in rng.kvs] == [(p + "a", b"1"), (p + "b", b"\x00\xff")]
    assert rng.count == 2 and rng.revision >= r2.revision
    a = rng.get(p + "a")
    assert a is not None and a.create_revision == a.mod_revision == r1.revision and a.version == 1
    upd = client.put(p + "a", "2", prev_kv=True)
    assert upd.prev is not None and upd.prev.text == "1"
    kv = client.get(p + "a")
    assert kv is not None and kv.text == "2" and kv.version == 2 and kv.create_revision == r1.revision
    assert client.range(p + "a", revision=r1.revision).get(p + "a").text == "1"  # history
    assert client.get(p + "nope") is None
    d = client.delete(p, prefix=True, prev_kv=True)
    assert d.deleted == 2 and sorted(kv.key for kv in d.prev) == [p + "a", p + "b"]
    assert client.range(p, prefix=True).kvs == []
    assert client.get("/t/crud0").text == "outside the prefix"
    assert etcd_types.prefix_end("a\xff") == b"a\xc3\xc0" and etcd_types.prefix_end(b"\xff\xff") == b"\0"


def test_txn_on_mod_revision_exactly_one_racer_wins(client: v3.Client) -> None:
    key = "/t/txn/round"
    client.put(key, "open")
    for rnd in range(15):
        kv = client.get(key)
        assert kv is not None
        gate = threading.Barrier(2)
        results: dict[str, etcd_types.TxnResult] = {}

        def race(name: str, seen: int = kv.mod_revision, gate=gate, results=results) -> None:
            gate.wait()
            results[name] = client.txn(
                [etcd_ops.compare(key, "mod", "==", seen)],
                [etcd_ops.put_op(key, name)],
                [etcd_ops.range_op(key)],
            )

        ts = [threading.Thread(target=race, args=(n,)) for n in (f"a{rnd}", f"b{rnd}")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        winners = [n for n, r in results.items() if r.succeeded]
        assert len(results) == 2 and len(winners) == 1, results
        loser = next(r for r in results.values() if not r.succeeded)
        current = loser.responses[0]
        assert isinstance(current, etcd_types.RangeResult) and current.kvs[0].text == winners[0]
        assert client.get(key).text == winners[0]
    # the other targets: create (absent), version, value
    fresh = "/t/txn/fresh"
    ok = client.txn([etcd_ops.compare(fresh, "create", "==", 0)], [etcd_ops.put_op(fresh, "x")])
    again = client.txn([etcd_ops.compare(fresh, "create", "==", 0)], [etcd_ops.put_op(fresh, "y")])
    assert ok.succeeded and not again.succeeded and client.get(fresh).text == "x"
    assert client.txn([etcd_ops.compare(fresh, "version", "==", 1), etcd_ops.compare(fresh, "value", "==", "x")],
                      [etcd_ops.delete_op(fresh)]).succeeded  # fmt: skip
    assert client.get(fresh) is None
    with pytest.raises(ValueError, match="target must be one of"):
        etcd_ops.compare(fresh, "modified", "==", 1)


def test_lease_expiry_removes_its_keys(client: v3.Client) -> None:
    t0 = time.monotonic()  # before the grant: a put that fsyncs for a second on a loaded box is inside
    lid, ttl = client.grant(2)
    assert ttl == 2
    client.put("/t/exp/k", "v", lease=lid)
    assert client.time_to_live(lid, keys=True)[1] == ["/t/exp/k"]
    left: list[int] = []
    while client.get("/t/exp/k") is not None:
        assert time.monotonic() - t0 < 10, "a lease of 2 s kept its key for 10 s without keepalives"
        left.append(client.time_to_live(lid)[0])
        time.sleep(0.1)
    # its last second reads 0 (the gateway's JSON omits a zero TTL): not -1, which is an ended lease
    assert 0 in left and -1 not in left[: left.index(0)], left
    assert time.monotonic() - t0 >= 1.5  # removed by the lease's expiry (2 s after the grant), not at once
    assert client.time_to_live(lid)[0] == -1
    with pytest.raises(v3.LeaseNotFound):
        client.keepalive_once(lid)
    with pytest.raises(v3.LeaseNotFound):
        client.put("/t/exp/k2", "v", lease=lid)


def test_keepalive_keeps_keys_with_zero_raft_writes(client: v3.Client) -> None:
    lost: list[int] = []
    lease = client.lease(2, on_lost=lambda le: lost.append(le.id))
    client.put("/t/ka/k", "v", lease=lease.id)
    renewed0 = client.metrics()["etcd_debugging_lease_renewed_total"]
    before = raft_writes(client)
    t0 = time.monotonic()
    time.sleep(7)  # 3.5 x TTL
    # every ttl/3: about 10 by now; on a loaded box the keepalive thread may lag a few (bounded)
    wait_for(lambda: lease.keepalives >= 7, 30, "7 keepalives")
    wait_for(lambda: client.metrics()["etcd_debugging_lease_renewed_total"] - renewed0 >= 7, 30, "7 renewals")
    after = raft_writes(client)
    assert client.get("/t/ka/k") is not None and not lost and not lease.lost.is_set()
    assert time.monotonic() - t0 >= 7
    # revision, raft index and committed proposals did not move while keepalives ran
    assert after == before
    lease.revoke()
    assert client.get("/t/ka/k") is None
    assert raft_writes(client)[0] == before[0] + 1  # a revoke is a write (the key's deletion)


def test_a_revoke_from_a_signal_inside_the_keepalive_threads_start(
    client: v3.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM whose handler revokes the lease (the agent leaving) can land while ``start`` is
    still starting the keepalive thread. The revoke ends the lease at once and the thread, when it
    runs, sends no keepalive; it used to raise "cannot join thread before it is started", and the
    agent exited FAILED instead of leaving."""
    lid, ttl = client.grant(6)
    client.put("/t/sig/k", "v", lease=lid)
    lease = v3.Lease(client, lid, ttl, interval=0.2)
    real_start = threading.Thread.start

    def start_after_a_signal(thread: threading.Thread) -> None:
        if thread.name.startswith("etcd-lease-"):
            lease.revoke()  # what the handler does, between the thread's creation and its run
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_after_a_signal)
    lease.start()
    monkeypatch.undo()
    assert client.get("/t/sig/k") is None and client.time_to_live(lid)[0] == -1
    lease._thread.join(5)
    assert not lease._thread.is_alive() and lease.keepalives == 0 and not lease.lost.is_set()


def test_watch_from_revision_gets_every_event_in_order(client: v3.Client) -> None:
    p = "/t/watch/"
    first = client.put(p + "0", "0").revision
    for i in range(1, 30):
        client.put(p + str(i % 3), str(i))
    client.delete(p + "1")
    with client.watch(p, prefix=True, start_revision=first, prev_kv=True) as w:
        got = list(w.events(1.0))
        assert [e.kv.mod_revision for e in got] == list(range(first, first + 31))
        assert [e.type for e in got] == ["PUT"] * 30 + ["DELETE"]
        assert [e.kv.text for e in got[:30]] == [str(i) for i in range(30)]
        assert got[-1].kv.key == p + "1" and got[-1].prev is not None and got[-1].prev.text == "28"
        # and live: a new event arrives; nothing for a quiet key returns None in time
        client.put(p + "live", "x")
        assert [e.kv.key for e in w.get(5)] == [p + "live"]
        t0 = time.monotonic()
        assert w.get(0.3) is None and time.monotonic() - t0 < 3.0  # bounded (loose: a loaded box)
        assert w.revision == first + 31


def test_watch_from_compacted_revision_reports_it_and_reread_works(client: v3.Client) -> None:
    p = "/t/compact/"
    old = client.put(p + "a", "1").revision
    client.put(p + "a", "2")
    rev = client.put(p + "b", "3").revision
    client.compact(rev)
    with pytest.raises(v3.Compacted) as exc:
        client.watch(p, prefix=True, start_revision=old).get(5)
    assert exc.value.compact_revision == rev
    with pytest.raises(v3.Compacted):
        client.range(p, prefix=True, revision=old)
    # the caller re-reads once, then watches from the read's revision + 1: nothing is missed
    now = client.range(p, prefix=True)
    assert {kv.key: kv.text for kv in now.kvs} == {p + "a": "2", p + "b": "3"}
    with client.watch(p, prefix=True, start_revision=now.revision + 1) as w:
        client.put(p + "c", "4")
        evs = w.get(5)
        assert evs is not None and [(e.kv.key, e.kv.text) for e in evs] == [(p + "c", "4")]


OWNER = """
import sys, time
from petctl_agent.rendezvous import etcdv3 as v3
c = v3.connect(sys.argv[1])
lease = c.lease(10)
c.put("/t/owner/k", "v", lease=lease.id)
print(lease.id, flush=True)
while True:
    time.sleep(0.2)
    print(lease.keepalives, lease.lost.is_set(), flush=True)
"""


def test_a_slow_keepalive_answer_never_widens_the_gap_between_renewals(client: v3.Client, etcd: Etcd) -> None:
    """Keepalives go out on a fixed clock, not ``interval`` after each answer: with every answer
    0.25 s slow (a loaded etcd, a slow network), etcd still hears a renewal at least every
    ``interval``, so each lease read asking "renewed since 1.05 s ago?" (the first read of a
    loss window, ``decide.heard_since``) says yes. Timed from the answer, one renewal came every
    1.25 s and about one read in five said no: a second read of a live lease."""
    from petctl_agent.rendezvous import decide

    sends: list[float] = []
    real = client.keepalive_once

    def slow(lease: int, timeout: float | None = None) -> int:
        sends.append(time.monotonic())
        ttl = real(lease, timeout=timeout)
        time.sleep(0.25)
        return ttl

    client.keepalive_once = slow  # type: ignore[method-assign]
    reader = v3.connect(etcd.endpoint, timeout=5)
    lid, ttl = client.grant(6)
    lease = v3.Lease(client, lid, ttl, interval=1.0).start()
    try:
        time.sleep(1.2)
        missed = []
        for _ in range(12):
            sent = time.monotonic()
            remaining, _ = reader.time_to_live(lid)
            if not decide.heard_since(remaining, ttl, sent, sent - decide.clear_after(1.0)):
                missed.append(round(sent - sends[0], 2))
            time.sleep(0.37)
    finally:
        lease.revoke()
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    assert len(gaps) >= 3 and max(gaps) <= 1.0, [round(g, 3) for g in gaps]
    assert not missed, f"reads that saw no renewal in the last 1.05 s, at {missed} s"


def test_lease_survives_a_3s_sigstop_of_its_owner(client: v3.Client, etcd: Etcd) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, etcd.endpoint],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert owner.stdout is not None
        lid = int(owner.stdout.readline())
        time.sleep(1)
        owner.send_signal(signal.SIGSTOP)  # over its keepalive due at ttl/3 = 3.3 s
        time.sleep(3)
        ttl_paused = client.time_to_live(lid)[0]
        owner.send_signal(signal.SIGCONT)
        assert 0 < ttl_paused <= 7  # counted down through the pause: no keepalive in it
        # renewed after the pause: its overdue keepalive goes out at once (bounded: a loaded box
        # may take a second or more to run the resumed owner and etcd)
        wait_for(lambda: client.time_to_live(lid)[0] >= 8, 5, "the lease renewed after the pause")
        assert client.get("/t/owner/k") is not None
        # the owner's own count, from its next report (printed every 0.2 s, after etcd saw the renewal)
        deadline = time.monotonic() + 10
        kept, lost = "0", "?"
        while int(kept) < 1 and time.monotonic() < deadline and owner.poll() is None:
            kept, lost = owner.stdout.readline().split() or ("0", "?")
        assert int(kept) >= 1 and lost == "False"
    finally:
        owner.send_signal(signal.SIGCONT)
        owner.kill()
        owner.wait(10)


def test_tls_with_client_certificate(tls_etcd: tuple[Etcd, EtcdCerts]) -> None:
    e, certs = tls_etcd
    c = v3.connect(e.endpoint, "https", str(certs.ca), str(certs.client_cert), str(certs.client_key))
    assert c.url.startswith("https://")
    lease = c.lease(5)
    c.put("/tls/k", "v", lease=lease.id)
    with c.watch("/tls/", prefix=True, start_revision=1) as w:
        assert [e.kv.key for e in w.get(5)] == ["/tls/k"]
    lease.revoke()
    assert c.get("/tls/k") is None
    # refused without a client certificate, with another CA, and over plain http
    no_cert = v3.Client(e.endpoint, "https", cacert=str(certs.ca), timeout=3)
    with pytest.raises(v3.Unavailable):
        no_cert.range("/tls/", prefix=True)
    with pytest.raises(v3.Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
        v3.Client(e.endpoint, "https", timeout=3).status()  # the system CAs: not etcd's
    with pytest.raises(v3.EtcdError):
        v3.Client(e.endpoint, "http", timeout=3).status()
    with pytest.raises(ValueError, match="need https"):
        v3.Client(e.endpoint, "http", cacert=str(certs.ca))


def test_calls_fail_within_their_timeout_when_etcd_stops(own_etcd: Etcd) -> None:
    c = v3.connect(own_etcd.endpoint, timeout=1.0)
    lease = c.lease(2)
    w = c.watch("/t/stop/", prefix=True)
    own_etcd.pause()  # returns once every etcd thread has stopped, not when the signal is queued
    calls = {
        "range": lambda: c.range("/t/stop/", prefix=True),
        "put": lambda: c.put("/t/stop/k", "v"),
        "txn": lambda: c.txn(
            [etcd_ops.compare("/t/stop/k", "create", "==", 0)], [etcd_ops.put_op("/t/stop/k", "v")]
        ),
        "keepalive": lambda: c.keepalive_once(lease.id),
        "status": lambda: c.status(),
        "watch": lambda: c.watch("/t/stop/", timeout=1.0),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            got = call()
        except v3.Timeout:
            pass
        else:
            pytest.fail(f"{name} returned {got!r} with etcd stopped")
        assert time.monotonic() - t0 < 3.0, name  # its 1 s timeout, not etcd's stop (loose bound)
    t0 = time.monotonic()
    assert w.get(0.5) is None and time.monotonic() - t0 < 2.5  # a running watch: get is bounded
    # the kept-alive lease is reported lost once its deadline (last renewal + TTL) has passed
    assert lease.lost.wait(3.0)
    own_etcd.resume()
    assert c.put("/t/stop/k", "after").revision > 0  # the client recovers with etcd
    w.close()
    with pytest.raises(v3.Unavailable, match="watch closed"):
        list(w.events(1))  # what came before the close, then the end


def test_a_new_etcd_on_the_same_address_is_reported_once(own_etcd: Etcd, tmp_path: Path) -> None:
    c = v3.connect(own_etcd.endpoint)
    for i in range(5):
        c.put("/t/cluster/k", str(i))
    old = c.cluster_id
    # a fresh data dir, same name and peer URL: the same cluster id, the revision starts over
    own_etcd.stop()
    shutil.rmtree(own_etcd.data_dir)
    own_etcd.start()
    with pytest.raises(v3.ClusterChanged, match="revision went back"):
        c.get("/t/cluster/k")
    assert c.get("/t/cluster/k") is None and c.cluster_id == old  # then it follows the new one
    # another cluster (another peer URL) on the same client address
    own_etcd.stop()
    other = Etcd(tmp_path / "other")
    other.port, other.endpoint = own_etcd.port, own_etcd.endpoint
    other.start()
    try:
        with pytest.raises(v3.ClusterChanged, match="another cluster") as exc:
            c.status()
        assert exc.value.old == old and exc.value.new == c.cluster_id != old
        c.status()
    finally:
        other.stop()


def test_connect_refuses_an_etcd_without_the_v3_gateway_path() -> None:
    class OldEtcd(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"etcdserver":"3.3.27","etcdcluster":"3.3.0"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), OldEtcd)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(v3.EtcdError, match="3.3.27: its gateway has no /v3/ API; run etcd 3.4 or newer"):
            v3.connect(f"127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(ValueError, match="give host:port"):
        v3.Client("etcd-without-port")


@pytest.mark.skipif(
    not os.environ.get("PETCTL_TEST_ETCD34"), reason="PETCTL_TEST_ETCD34 (an etcd 3.4 binary) not set"
)
def test_etcd_34_serves_what_the_client_uses(tmp_path: Path) -> None:
    e = Etcd(tmp_path, binary=os.environ["PETCTL_TEST_ETCD34"])
    e.start()
    try:
        c = v3.connect(e.endpoint)
        assert c.version().startswith("3.4.")
        lease = c.lease(2)
        rev = c.put("/t/34/k", "v", lease=lease.id).revision
        t = c.txn(
            [etcd_ops.compare("/t/34/k", "mod", "==", rev)], [etcd_ops.put_op("/t/34/k", "w", lease=lease.id)]
        )
        assert t.succeeded
        with c.watch("/t/34/", prefix=True, start_revision=rev) as w:
            assert [x.kv.text for x in w.get(5)] == ["v", "w"]
        c.compact(t.revision)
        with pytest.raises(v3.Compacted):
            c.watch("/t/34/", prefix=True, start_revision=rev).get(5)
        time.sleep(1)
        assert lease.keepalives >= 1 and c.status().revision == t.revision
        lease.revoke()
        assert c.get("/t/34/k") is None
    finally:
        e.stop()
