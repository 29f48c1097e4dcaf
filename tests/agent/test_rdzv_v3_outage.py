"""etcd paused or cut off for longer than the membership lease (6 s): every lease expires at
once, and nothing of it says who is alive. The leader must not read that as everyone's loss.

When etcd comes back (SIGCONT), each live node finds its lease ended and registers again
within about a second. A leader that itself lost etcd (its own keepalives silent for half the
TTL or more, or its own lease ended) acts on the membership only a TTL after it reaches etcd
again: by then every live node has re-registered, and a node that is still missing is gone
(docs/rendezvous.md, "etcd paused or cut off"). The same holds for a follower that finds the
leader's key gone.

Handlers run in threads of this process on their own etcd (SIGSTOP must not pause the other
tests' etcd); a killed node is a handler stopped without leaving (``_crash``: no keepalive, no
revoke), as a SIGKILLed agent.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import Etcd, FreezingProxy, wait_for
from test_rdzv_v3 import _drive
from test_rendezvous import Group

from petctl_agent.rendezvous import PetctlRendezvousHandler

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")

PAUSE = 10.0  # > the 6 s lease: every lease has expired when etcd runs again


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[Etcd]:
    e = Etcd(tmp_path / "etcd")
    e.start()
    yield e
    if e.proc is not None:
        os.kill(e.proc.pid, signal.SIGCONT)
    e.stop()


def _pause(e: Etcd, seconds: float, during: Callable[[], None] | None = None) -> float:
    """SIGSTOP etcd for ``seconds`` (``during`` runs right after the stop); returns when it runs again."""
    assert e.proc is not None
    os.kill(e.proc.pid, signal.SIGSTOP)
    try:
        if during is not None:
            during()
        time.sleep(seconds)
    finally:
        os.kill(e.proc.pid, signal.SIGCONT)
    return time.monotonic()


def _leading_flips(h: PetctlRendezvousHandler, since: float) -> int:
    return sum(1 for t, e in h.events if t >= since and e == "leading")


def test_etcd_paused_10s_opens_no_round(own_etcd: Etcd, group: Callable[..., Group]) -> None:
    """3 nodes run; etcd is SIGSTOPped for 10 s. After SIGCONT, for 9 s (the 6 s grace and
    some), no node sees a change, all stay in round 1, and leadership settles (no node flips
    between leading and following). Without the fix the leader opened a round naming gone the
    nodes whose old keys expired before they registered again."""
    g = group(2, 8, endpoint=own_etcd.endpoint)
    hs = [g.new() for _ in range(3)]
    g.rendezvous(*hs, timeout=20)
    time.sleep(1.0)
    wall0 = time.time()
    back = _pause(own_etcd, PAUSE)
    end = back + 9.0
    while time.monotonic() < end:
        for h in hs:
            ch = h.pending_change()
            assert ch is None, f"{h.node_id} after etcd came back: {ch}; events {list(h.events)[-8:]}"
        time.sleep(0.05)
    assert {h.round for h in hs} == {1}
    for h in hs:
        assert not [e for _, e in h.events if e.startswith("opened round")], list(h.events)
        assert _leading_flips(h, wall0) <= 2, f"{h.node_id} flipped leadership: {list(h.events)[-6:]}"
    assert sum("re-registered" in e for h in hs for _, e in h.events) >= 1, "no lease expired: not a test"


def test_a_10s_partition_from_etcd_opens_no_round(group: Callable[..., Group], etcd3: Etcd) -> None:
    """The same through a partition: 3 nodes reach etcd through a proxy that stops forwarding
    on every connection, open and new, for 10 s, then forwards again (``FreezingProxy.partition``,
    ``heal``). etcd runs on and ends every lease; the nodes register again once it answers. For
    9 s after the heal no node sees a change and all stay in round 1."""
    with FreezingProxy(etcd3.endpoint) as proxy:
        g = group(2, 8, endpoint=proxy.endpoint)
        try:
            hs = [g.new() for _ in range(3)]
            g.rendezvous(*hs, timeout=20)
            time.sleep(1.0)
            proxy.partition()
            time.sleep(PAUSE)
            proxy.heal()
            end = time.monotonic() + 9.0
            while time.monotonic() < end:
                for h in hs:
                    ch = h.pending_change()
                    assert ch is None, f"{h.node_id} after the partition: {ch}; events {list(h.events)[-8:]}"
                time.sleep(0.05)
            assert {h.round for h in hs} == {1}
            assert sum("re-registered" in e for h in hs for _, e in h.events) >= 1, "no lease expired"
        finally:
            g.close()  # while the proxy still forwards: each revokes its lease


@pytest.mark.parametrize("who", [2, 0], ids=["a-follower", "the-leader"])
def test_a_node_killed_during_the_pause_is_still_found_gone(
    own_etcd: Etcd, group: Callable[..., Group], who: int
) -> None:
    """4 nodes run; etcd is SIGSTOPped for 10 s and one node (``who``: its rank; rank 0 leads) is
    killed meanwhile. The next round names that node gone and no other, and the 3 others form it."""
    g = group(2, 8, endpoint=own_etcd.endpoint)
    hs = [g.new() for _ in range(4)]
    res = g.rendezvous(*hs, timeout=20)
    order = sorted(hs, key=lambda h: res[h].rank)
    dead = order[who]
    survivors = [h for h in order if h is not dead]
    time.sleep(1.0)
    back = _pause(own_etcd, PAUSE, during=dead._crash)  # noqa: SLF001 - a SIGKILLed node
    ch = None
    deadline = time.monotonic() + 20
    while ch is None and time.monotonic() < deadline:
        ch = next((c for c in (h.pending_change() for h in survivors) if c is not None), None)
        time.sleep(0.05)
    assert ch is not None, "the killed node was never found gone"
    found = time.monotonic() - back
    assert ch["gone"] == [dead.node_id], ch
    done = _drive(g, survivors, 3, 30) - back
    assert {h.round for h in survivors} == {2}
    print(f"killed rank {who} found gone {found:.1f}s after etcd ran again; round of 3 after {done:.1f}s")


def test_a_flapping_node_does_not_hold_a_round_open(group: Callable[..., Group]) -> None:
    """3 nodes run round 1; two re-join (round 2 opens), the third (a previous round's node, so
    it holds the round until its straggler deadline, 2 s here) never joins and flaps: its lease
    ends (revoked) and it registers again, over and over. Each time, the leader's control loop
    is busy (held here) until the watch has brought both the key's deletion and its return, as
    when it waits on a lease read or a slow etcd. The round still closes at the flapper's first
    deadline. Without the fix each return re-armed the deadline and the round stayed open."""
    from petctl_agent.rendezvous import etcdv3 as v3

    g = group(2, 8, ttl=2, refresh=0.2, straggler=2.0, settle=0.1)
    hs = [g.new() for _ in range(3)]
    res = g.rendezvous(*hs, timeout=20)
    lead, other, flapper = sorted(hs, key=lambda h: res[h].rank)
    gate = threading.Event()
    gate.set()
    step = lead._step

    def held_step(now: float) -> float | None:
        gate.wait()
        return step(time.monotonic())

    lead._step = held_step  # type: ignore[method-assign]
    c = v3.Client(g.endpoint)
    g.join(other, lead)  # round 2: the re-join opens it
    t0 = time.monotonic()
    flaps = 0
    while time.monotonic() - t0 < 10 and not (lead in g.results and other in g.results):
        kv = c.get(flapper.node_key)
        assert kv is not None
        gate.clear()
        try:
            c.revoke(kv.lease)
            before = kv.create_revision

            def back(before: int = before) -> int:
                k = c.get(flapper.node_key)
                return k.create_revision if k is not None and k.create_revision > before else 0

            rev = wait_for(back, 5, "the flapper registered again")

            def seen(rev: int = rev) -> bool:
                m = lead._members
                return m is not None and m.items.get(flapper.node_key, ("", 0, 0))[1] == rev

            wait_for(seen, 5, "the leader's watch saw it back")
        finally:
            gate.set()
        flaps += 1
        time.sleep(0.3)
    took = time.monotonic() - t0
    assert lead in g.results and other in g.results, f"round 2 still open {took:.1f}s on, {flaps} flaps"
    out = g.wait(lead, other, timeout=1)
    print(f"round 2 closed {took:.1f}s after it opened, through {flaps} flaps")
    assert {i.world_size for i in out.values()} == {2}
    assert flaps >= 2, "the round closed before the flapper flapped: not a test"
    assert took < 6.0, f"the flapping node held the round {took:.1f}s (straggler 2 s)"


class _LaggingView:
    """Holds what ``h``'s rounds watch brings before it reaches ``h``'s view: a view that lags
    (a paused agent, a slow watch) while etcd moves on. :meth:`release` lets through the events
    up to a revision (None: all, and from then on)."""

    def __init__(self, h: PetctlRendezvousHandler) -> None:
        w = h._rounds
        assert w is not None
        self._apply = w._apply
        self._pending: list = []
        self._upto: int | None = -1
        self._lock = threading.Lock()
        w._apply = self._held  # type: ignore[method-assign]

    def _held(self, evs: list) -> None:
        with self._lock:
            self._pending += evs
            self._flush()

    def _flush(self) -> None:
        upto = self._upto
        ready = [e for e in self._pending if upto is None or e.kv.mod_revision <= upto]
        self._pending = [e for e in self._pending if e not in ready]
        if ready:
            self._apply(ready)

    def release(self, upto: int | None = None) -> None:
        with self._lock:
            self._upto = upto
            self._flush()


def test_a_round_superseded_while_the_view_lagged_is_not_taken(group: Callable[..., Group]) -> None:
    """N joins round 2 and its view stops there; round 2 closes with it, then round 3 closes
    without it (N is a straggler, 1 s). N's view then catches up to round 2's close only: its
    rank key of round 2 still exists (deleted when round 4 closes), but round 3 has replaced
    round 2. N does not take round 2 (starting workers for a round its peers left); it joins
    the next round, and the three train in one. Without the fix N took round 2."""
    from petctl_agent.rendezvous import etcdv3 as v3

    g = group(2, 8, straggler=1.0, settle=0.1)
    hs = [g.new() for _ in range(3)]
    res = g.rendezvous(*hs, timeout=20)
    a, b, n = sorted(hs, key=lambda h: res[h].rank)  # a leads
    lag = _LaggingView(n)
    g.join(n)  # its re-join opens round 2
    wait_for(lambda: n._target == 2, 5, "N joined round 2")
    g.rendezvous(a, b, timeout=10)  # round 2, with N
    assert a.round == 2 and g.results[a].world_size == 3
    g.rendezvous(a, b, timeout=10)  # round 3, without N (left out at its straggler deadline)
    assert a.round == 3 and g.results[a].world_size == 2
    c = v3.Client(g.endpoint)
    lag.release(c.get(a.keys.round(3)).create_revision - 1)  # N's view: round 2 closed, no more
    time.sleep(1.0)
    assert n not in g.results, f"N took round {n.round}, which round 3 had replaced"
    lag.release()
    _drive(g, [a, b, n], 3, 20)
    assert not [e for _, e in n.events if e.startswith("round 2 rank")], list(n.events)


def test_a_lagging_view_opens_no_round_under_an_expired_record(group: Callable[..., Group]) -> None:
    """N runs round 1 and its view stops there; rounds 2 and 3 close without it, and round 2's
    record, on its 2 s lease, expires. N re-joins from its view: round 2, the one after its
    last. Its "a participant re-joins" marker is written only while the round it ran in is
    still etcd's latest: no open marker appears under round 2's expired key (nothing would
    ever delete it). Without the fix the marker was created there."""
    from petctl_agent.rendezvous import etcdv3 as v3

    g = group(2, 8, straggler=1.0, settle=0.1, record_ttl=2)
    hs = [g.new() for _ in range(3)]
    res = g.rendezvous(*hs, timeout=20)
    a, b, n = sorted(hs, key=lambda h: res[h].rank)
    lag = _LaggingView(n)
    g.rendezvous(a, b, timeout=10)  # round 2 without N (its straggler deadline)
    g.rendezvous(a, b, timeout=10)  # round 3: round 2's record gets its 2 s lease
    assert a.round == 3
    c = v3.Client(g.endpoint)
    wait_for(lambda: c.get(a.keys.round(2)) is None, 10, "round 2's record to expire")
    g.join(n)
    wait_for(lambda: n._target == 2, 5, "N joined round 2 from its lagging view")
    time.sleep(0.3)
    stray = c.get(a.keys.round(2))
    lag.release()
    _drive(g, [a, b, n], 3, 20)
    assert stray is None, f"an open marker under round 2's expired key: {stray.text}"
