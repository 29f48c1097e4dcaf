"""Connections that die silently: a flow that a NAT or EC2's connection
tracking forgot (350 s idle on Nitro v6 types) carries nothing any more, and neither end hears a
FIN or a RST. A watch on it reports "connected" forever. ``FreezingProxy`` (bench/harness.py)
does the same on command to every connection open at that moment, while new ones go through.

The fix under test (docs/rendezvous.md, "Connections that die silently"): etcd sends progress
notifications on quiet watches every 10 s (``--experimental-watch-progress-notify-interval``,
the harness's etcd as the job's), every watch asks for them, and a watch silent for 30 s is
taken as dead: the watcher re-reads and watches again on a new connection. Unary calls have
timeouts, and a lease's keepalive one short enough to retry on a new connection well within
the TTL.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Etcd, FreezingProxy, wait_for
from test_rdzv_v3 import _drive
from test_rendezvous import Group

from petctl_agent.rendezvous import etcd_transport
from petctl_agent.rendezvous import etcdv3 as v3

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


def test_frozen_connections_heal_and_a_newcomer_joins_within_150s(
    group: Callable[..., Group], etcd3: Etcd
) -> None:
    """Two nodes run through the proxy; it freezes every open connection (their watches, their
    keepalives, their control loops'), then a third node joins (through new connections). All
    three reach one round of world 3 within 150 s, and neither old node lost its lease (no
    re-registration, same lease on its key). Without the fix the old nodes never see the
    newcomer (their watches hang), and the test times out."""
    with FreezingProxy(etcd3.endpoint) as proxy:
        g = group(2, 3, endpoint=proxy.endpoint)
        try:
            a, b = g.new(), g.new()
            g.rendezvous(a, b, timeout=20)
            c0 = v3.Client(etcd3.endpoint)  # direct, past the proxy
            leases = {h: c0.get(h.node_key).lease for h in (a, b)}
            time.sleep(1.0)  # steady state: nothing moves on the watches
            frozen = proxy.freeze()
            # per node at least: its rounds and members/leader watches, its lease, its control loop
            assert frozen >= 6, f"only {frozen} connections were open to freeze"
            t0 = time.monotonic()
            n = g.new()
            g.join(n)
            done = _drive(g, [a, b, n], 3, 150)
            took = done - t0
            resumes = sum(w.resumes for h in (a, b) for w in (h._rounds, h._members, h._leader_w) if w)
            print(f"froze {frozen} connections; a round of 3 {took:.1f}s after the newcomer joined; "
                  f"{resumes} silent watches made again")  # fmt: skip
            assert took < 150
            for h in (a, b):
                bad = [e for _, e in h.events if "lease lost" in e or "re-registered" in e]
                assert not bad, f"{h.node_id}: {bad}"
                kv = c0.get(h.node_key)
                assert kv is not None and kv.lease == leases[h], f"{h.node_id} lost its lease"
                assert h._lease is not None and not h._lease.lost.is_set()
        finally:
            g.close()  # while the proxy still forwards: each revokes its lease


def test_a_watch_on_a_frozen_connection_ends_after_its_silence(etcd3: Etcd) -> None:
    """The unit: a watch through the proxy, silence 1.5 s; the proxy freezes it. ``get`` raises
    ``Unavailable`` (not waits forever) within about the silence; a new watch works."""
    with FreezingProxy(etcd3.endpoint) as proxy:
        c = v3.Client(proxy.endpoint, timeout=2.0)
        key = f"/t-silent/{time.monotonic_ns()}"
        w = c.watch(key, silence=1.5)
        c.put(key, "1")
        evs = w.get(5)
        assert evs is not None and evs[0].kv.value == b"1"
        proxy.freeze()
        t0 = time.monotonic()
        with pytest.raises(v3.Unavailable, match="silent"):
            while time.monotonic() - t0 < 10:
                w.get(0.5)
        took = time.monotonic() - t0
        assert took < 4.0, f"the dead watch was noticed after {took:.1f}s (silence 1.5 s)"
        w.close()
        c.close()  # this thread's (frozen) keep-alive connection
        with c.watch(key, start_revision=c.get(key).mod_revision, silence=1.5) as w2:
            evs = w2.get(5)
            assert evs is not None and evs[0].kv.value == b"1"


def test_a_quiet_watch_gets_progress_and_lives(tmp_path: Path) -> None:
    """etcd with a 0.5 s progress interval: a watch on a key nothing writes gets progress
    notifications (headers, no events) and so outlives many times its 2 s silence; ``get``
    hands out no empty answers; the watch still delivers the next event."""
    e = Etcd(tmp_path / "progress", progress_interval=0.5)
    e.start()
    try:
        c = v3.Client(e.endpoint)
        w = c.watch("/t-quiet/k", silence=2.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6.0:
            assert w.get(0.5) is None  # raises if the watch ended
        assert w.progress >= 4, f"{w.progress} progress notifications in 6 s (interval 0.5 s)"
        assert time.monotonic() - w.last_message < 2.0
        c.put("/t-quiet/k", "v")
        evs = wait_for(lambda: w.get(0.5), 5, "the event after the quiet")
        assert evs[0].kv.value == b"v"
        w.close()
    finally:
        e.stop()


def test_every_etcd_socket_has_tcp_keepalive(etcd3: Etcd) -> None:
    """The unary calls' keep-alive connection and a watch's: SO_KEEPALIVE, first probe after
    30 s idle, then every 10 s, reset after 3 (a tracking entry refreshed long before 350 s)."""
    import socket

    c = v3.Client(etcd3.endpoint)
    c.status()
    with c.watch("/t-keepalive/k") as w:
        for sock in (c._local.conn.sock, w._conn.sock):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
                got = [sock.getsockopt(socket.IPPROTO_TCP, o) for o in
                       (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)]  # fmt: skip
                assert got == [
                    etcd_transport.KEEPALIVE_IDLE,
                    etcd_transport.KEEPALIVE_INTERVAL,
                    etcd_transport.KEEPALIVE_COUNT,
                ]
