"""A hard loss seen from the data plane (petctl-etcd on a real etcd v3): when the
survivors' workers fail, the agent's explanation (``MembershipWatch.failure_explained``, what
``_on_workers_stopped`` calls before it decides on the restart budget) comes from the leader's
read of the participants' leases, in < 3.5 s, not from the dead node's 6 s lease expiring.
And a worker failure with every peer alive is *not* explained: it still spends the budget.

Handlers run in threads of this process (no torch workers); a SIGKILLed node is ``_crash()``:
no keepalive, no leave, its key left to expire.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_rendezvous import Group

from petctl_agent.elastic.membership import MembershipWatch
from petctl_agent.rendezvous import PetctlRendezvousHandler
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.settings import Settings

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


class _Events:
    """The status publisher's ``event`` (only an unreachable etcd publishes one here)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, **kw: Any) -> None:
        self.seen.append((kind, kw))


def _watch(h: PetctlRendezvousHandler, settings: Settings) -> MembershipWatch:
    w = MembershipWatch(settings, _Events(), lambda: None, 600.0)  # type: ignore[arg-type]
    w.started(h)
    return w


def _workers_failed(
    hs: list[PetctlRendezvousHandler], settings: Settings
) -> dict[PetctlRendezvousHandler, tuple[str | None, float]]:
    """Each agent's ``failure_explained`` at once, in its own thread: (explanation, seconds)."""
    out: dict[PetctlRendezvousHandler, tuple[str | None, float]] = {}
    watches = {h: _watch(h, settings) for h in hs}

    def run(h: PetctlRendezvousHandler) -> None:
        t = time.monotonic()
        why = watches[h].failure_explained(threading.Event())
        out[h] = (why, time.monotonic() - t)

    ts = [threading.Thread(target=run, args=(h,), daemon=True) for h in hs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert set(out) == set(hs), "failure_explained did not return"
    return out


# the settle window: _three's 3 handlers join from threads at once and must all be in round 1.
# With the default 0.5 s, a third registration slower than that on a loaded box makes round 1 a
# round of 2 (test_burst_settles_into_one_round failed so in CI). The rounds after a loss are of
# the previous round's nodes only, which skip the settle: the times measured here do not include it.
SETTLE = 3.0


def _three(g: Group) -> list[PetctlRendezvousHandler]:
    """3 nodes in round 1, in rank order (rank 0 leads), running for a few keepalives."""
    hs = [g.new() for _ in range(3)]
    res = g.rendezvous(*hs)
    assert {h.round for h in hs} == {1}
    time.sleep(1.5)
    return sorted(hs, key=lambda h: res[h].rank)


@pytest.mark.parametrize("who", [2, 0], ids=["a-follower", "the-leader"])
def test_a_hard_loss_is_explained_from_the_leases(group: Callable[..., Group], who: int) -> None:
    """One of 3 is SIGKILLed; the survivors' workers fail 0.2 s later (a broken collective).
    Both agents get "new round opened ... gone: <dead>" in < 3.5 s of the kill (before: the
    6 s lease + the round; about 6-7 s), then a round of 2 closes. ``who``: the dead node's
    rank (0: the leader, whose successor reads its lease and leads in its place)."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    dead = order[who]
    survivors = [h for h in order if h is not dead]
    held: list[bool] = []  # was the handler's lock held at a lease read (an etcd request)?
    for h in survivors:
        real = h._etcd.time_to_live  # noqa: SLF001

        def spy(*a: Any, _h: PetctlRendezvousHandler = h, _real: Any = real, **k: Any) -> Any:
            held.append(_h._cond._is_owned())  # noqa: SLF001
            return _real(*a, **k)

        h._etcd.time_to_live = spy  # noqa: SLF001
    dead._crash()  # noqa: SLF001
    t0 = time.monotonic()
    time.sleep(0.2)  # gloo: "Connection reset by peer" 0.19 s after the kill (docs/benchmarks.md)
    got = _workers_failed(survivors, Settings())
    took = {h.node_id: round(0.2 + s, 2) for h, (_, s) in got.items()}
    print(f"hard loss of rank {who}: explained after {took} s")
    for h, (why, _) in got.items():
        assert why is not None, f"{h.node_id}: no explanation (the fast path did not open a round)"
        assert "gone" in why and dead.node_id in why, why
    assert max(took.values()) < 3.5, f"explained after {took} s (the dead node's lease: 6 s)"
    # the lease reads ran without the lock the watchers and the agent's monitor need
    assert held and not any(held), held
    assert v3.Client(g.endpoint).get(dead.node_key) is not None, (
        "the dead node's key expired: this measured the TTL, not the lease read"
    )
    t1 = time.monotonic()
    res = g.rendezvous(*survivors, timeout=15)
    assert {i.world_size for i in res.values()} == {2}
    assert {h.round for h in survivors} == {2}
    print(f"then the round of 2 closed {time.monotonic() - t1:.2f}s after the re-joins")
    assert time.monotonic() - t0 < 5.0


def _gone_within(
    hs: list[PetctlRendezvousHandler], dead: PetctlRendezvousHandler, limit: float
) -> float | None:
    """Seconds until every handler of ``hs`` has a pending change naming ``dead`` gone (None: not
    within ``limit``). The agents' monitor loops read exactly this (``MembershipWatch.change``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        chs = [h.pending_change() for h in hs]
        if all(ch is not None and dead.node_id in (ch.get("gone") or []) for ch in chs):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("who", [2, 0], ids=["a-follower", "the-leader"])
def test_a_loss_while_the_workers_start_is_seen_from_the_leases(
    group: Callable[..., Group], who: int
) -> None:
    """A peer lost while the workers start (bench_elastic's "node lost during a re-rendezvous"):
    the survivors' workers do not fail, they wait at process-group init for the dead rank, so no
    agent calls workers_failed. The agents said their workers were starting (the agent does at
    each start): the leader, or the node next in line when the leader is the dead one, reads the
    leases and opens a round naming the dead node gone in < 3.5 s (before: its 6 s lease, 6.8 s
    in bench_elastic). Without the start-up window (workers that stepped) the same loss waits
    for the lease (the control: a pause while training must open nothing)."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    for h in order:
        h.workers_starting()
    dead = order[who]
    survivors = [h for h in order if h is not dead]
    dead._crash()  # noqa: SLF001
    took = _gone_within(survivors, dead, 5.0)
    print(f"loss of rank {who} while the workers start: a round named it gone after {took} s")
    assert took is not None and took < 3.5, took
    assert v3.Client(g.endpoint).get(dead.node_key) is not None, "the lease expired: this measured the TTL"
    res = g.rendezvous(*survivors, timeout=15)
    assert {i.world_size for i in res.values()} == {2}


def test_workers_that_stepped_read_no_lease_on_a_loss(group: Callable[..., Group]) -> None:
    """The control: the workers stepped (workers_running ends the start-up window), so nothing
    reads a lease and the loss is seen only when the dead node's lease expires (> 3.5 s)."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    for h in order:
        h.workers_starting()
        h.workers_running()
    dead, survivors = order[2], order[:2]
    dead._crash()  # noqa: SLF001
    assert _gone_within(survivors, dead, 3.5) is None


@pytest.mark.parametrize("who", [2, 0], ids=["a-follower", "the-leader"])
def test_a_vanished_peer_is_seen_from_the_leases_of_a_stall(group: Callable[..., Group], who: int) -> None:
    """A peer that vanishes without a reset (a real instance lost: no RST) fails nothing: the
    survivors' workers hang in a collective, their agents see no new step (elastic/stall.py) and
    call workers_stalled. The leader, or the node next in line when the leader vanished, reads
    the leases and opens a round naming it gone, before its key expires: silent > 4.5 s (the
    stall's threshold rides through a 3 s pause of an agent, decide.stall_lapse_after), i.e. with
    < 1 s of its 6 s TTL left: 3-4.3 s after a stall seen 1 s after the loss (without the stall:
    the lease expiry, test_workers_that_stepped_read_no_lease_on_a_loss)."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    dead = order[who]
    survivors = [h for h in order if h is not dead]
    dead._crash()  # noqa: SLF001
    t_crash = time.time()
    time.sleep(1.0)  # the agents' stall time for fast steps (STALL_MIN_S)
    for h in survivors:
        h.workers_stalled()
    took = _gone_within(survivors, dead, 8.0)
    print(f"vanish of rank {who}: a round named it gone {took} s after the stall")
    assert took is not None and took < 4.8, took
    # the lease read found it (not the expiry's delete, which names it gone too, ~1 s later)
    read = [e for h in survivors for _, e in h.events if f"lease of {dead.node_id} not kept alive" in e]
    assert read, (took, [(round(t - t_crash, 2), e) for h in survivors for t, e in h.events if t > t_crash])
    assert any("workers stalled in round 1" in e for h in survivors for _, e in h.events)
    res = g.rendezvous(*survivors, timeout=15)
    assert {i.world_size for i in res.values()} == {2}


def test_a_stall_with_every_peer_alive_opens_nothing_and_ends_at_the_next_step(
    group: Callable[..., Group],
) -> None:
    """A slow step, a long checkpoint: every agent sees a stall, the leader reads the leases,
    all kept alive: no round. A step ends the window (workers_running): no more reads. A stall
    while the window lasts opens no second one (one window per stall: O(N) reads)."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    leader = order[0]
    before = g.counter.snapshot().get("timetolive", 0)
    for h in order:
        h.workers_stalled()
        h.workers_stalled()  # the window is open: nothing more
    time.sleep(3.0)
    during = g.counter.snapshot().get("timetolive", 0) - before
    assert during >= 2, "the leader read no lease"
    assert during <= 2 * 6, f"{during} reads of 2 leases in 3 s: not rate-limited"
    assert sum("workers stalled in round 1" in e for _, e in leader.events) == 1
    assert all(h.pending_change() is None and h.round == 1 for h in order)
    for h in order:
        h.workers_running()  # they stepped
    time.sleep(0.3)
    mid = g.counter.snapshot().get("timetolive", 0)
    time.sleep(2.0)
    assert g.counter.snapshot().get("timetolive", 0) == mid, "leases read after the workers stepped"
    assert not any("not kept alive" in e for h in order for _, e in h.events)
    assert all(h.pending_change() is None for h in order)


class _LeaseReads:
    """Counts a handler's ``LeaseTimeToLive`` per lease, and how many were in flight at once (each
    read held 0.2 s after etcd answered: reads made one at a time never overlap)."""

    def __init__(self, h: PetctlRendezvousHandler) -> None:
        self.per_lease: dict[int, int] = {}
        self.in_flight = self.most = 0
        self._lock = threading.Lock()
        self._real = h._etcd.time_to_live  # noqa: SLF001
        h._etcd.time_to_live = self._read  # noqa: SLF001

    def _read(self, lease: int, *a: Any, **k: Any) -> Any:
        with self._lock:
            self.per_lease[lease] = self.per_lease.get(lease, 0) + 1
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            got = self._real(lease, *a, **k)
            time.sleep(0.2)
            return got
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.mark.parametrize("why", ["failed", "stalled"])
def test_a_window_reads_each_kept_alive_lease_once_and_together(
    group: Callable[..., Group], why: str
) -> None:
    """A window opened for a loss before it (the workers failed, or stalled: a slow job opens one
    at most steps), every peer alive: the leader reads each lease once, the reads together. A
    read that shows the lease renewed since the window opened says its node was not lost, so it
    is not read again in the window. It was read again whenever it could first lapse (in a 7.5 s
    window: 2-3 reads per lease of a stall, about 7 of a failure), one read at a time: 2,000-7,000
    serial reads per window at 1,000 nodes. A keepalive late at the read costs one more."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    leader = order[0]
    reads = _LeaseReads(leader)
    for h in order:
        getattr(h, f"workers_{why}")()
    time.sleep(8.5)  # the whole window (ttl + 1.5 s), and past it
    print(
        f"a window (workers {why}): the leader's LeaseTimeToLive per lease {reads.per_lease}, {reads.most} at once"
    )
    assert len(reads.per_lease) == 2, reads.per_lease  # the two other participants' leases
    assert max(reads.per_lease.values()) <= 2 and sum(reads.per_lease.values()) <= 3, reads.per_lease
    assert reads.most == 2, "the leases were read one at a time"
    assert all(h.pending_change() is None and h.round == 1 for h in order)
    assert not any("not kept alive" in e for h in order for _, e in h.events)


def test_the_round_a_loss_opens_does_not_read_again_the_leases_its_window_read(
    group: Callable[..., Group],
) -> None:
    """One of 4 is lost; the survivors' workers fail; two re-join at once and the third 3 s later
    (a node whose workers take seconds to stop). The failure window read each live lease once,
    and that read showed it renewed after the loss: the round the window opens does not read it
    again while it waits for the late node (a node lost after the window's read is seen when its
    key expires). Before, the late node's lease was read again each second it was waited for:
    about 70 extra reads per loss at 1,000 nodes (docs/rendezvous.md)."""
    g = group(2, 8, settle=SETTLE)
    hs = [g.new() for _ in range(4)]
    res = g.rendezvous(*hs)
    assert {h.round for h in hs} == {1}
    time.sleep(1.5)
    order = sorted(hs, key=lambda h: res[h].rank)
    leader, dead, late = order[0], order[3], order[2]
    survivors = order[:3]
    reads = _LeaseReads(leader)
    lost = dead._lease.id  # noqa: SLF001
    dead._crash()  # noqa: SLF001
    time.sleep(0.2)
    got = _workers_failed(survivors, Settings())
    assert all(why and dead.node_id in why for why, _ in got.values()), got
    on_time = [h for h in survivors if h is not late]
    g.join(*on_time)
    time.sleep(3.0)
    g.join(late)
    done = g.wait(*survivors, timeout=15)
    assert {i.world_size for i in done.values()} == {3}
    live = {lease: n for lease, n in reads.per_lease.items() if lease != lost}
    print(f"lease reads of the leader, window and round: {reads.per_lease} (lost: {lost})")
    assert len(live) == 2 and set(live.values()) == {1}, reads.per_lease
    assert reads.per_lease.get(lost, 0) <= 2, reads.per_lease


def test_a_3s_agent_pause_in_a_stall_window_opens_nothing(group: Callable[..., Group]) -> None:
    """The leases ride through a 3 s pause of an agent. The workers stalled (a long
    checkpoint: a window opens) and meanwhile another node's agent pauses 3 s (GC, I/O: no
    keepalive). With the failure window's 2 s rule the leader named it gone (a round: every node
    restarted, and the restart charged when it came back); the stall's threshold rides through."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    paused = order[2]
    stalled = _stall(paused)
    for h in order:
        h.workers_stalled()
    time.sleep(0.5)
    stalled.set()
    time.sleep(3.0)
    stalled.clear()
    time.sleep(4.5)  # the rest of the window
    assert all(h.pending_change() is None and h.round == 1 for h in order), [
        h.pending_change() for h in order
    ]
    assert not any("not kept alive" in e for h in order for _, e in h.events)


def test_a_worker_crash_with_every_peer_alive_spends_the_budget(group: Callable[..., Group]) -> None:
    """Every node's workers fail (one crashed, the others' collectives broke) but every agent is
    alive: the leader reads the leases for the whole window and finds none lapsed, so no round
    opens and ``failure_explained`` returns None: ``_on_workers_stopped`` spends one restart."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    t0 = time.monotonic()
    before = g.counter.snapshot().get("timetolive", 0)
    got = _workers_failed(order, Settings())
    assert g.counter.snapshot().get("timetolive", 0) > before, "the leader read no lease"
    for h, (why, s) in got.items():
        assert why is None, f"{h.node_id}: explained by {why!r} with every peer alive"
        assert s >= 7.0, s  # the whole grace (TTL + 1.5 s) was waited
    assert all(h.pending_change() is None and h.round == 1 for h in order)
    leader = order[0]
    assert any("workers failed in round 1" in e for _, e in leader.events), "the leader read no lease"
    assert not any("not kept alive" in e for h in order for _, e in h.events)
    assert time.monotonic() - t0 < 20  # the 7.5 s grace and a loaded box: loose, not a speed test


def test_no_worker_failure_no_lease_reads(group: Callable[..., Group]) -> None:
    """At steady state (no worker failure) the leader reads no lease: 0 LeaseTimeToLive."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    before = g.counter.snapshot()
    time.sleep(2.0)
    after = g.counter.snapshot()
    assert after.get("timetolive", 0) == before.get("timetolive", 0), (before, after)
    assert all(h.pending_change() is None for h in order)
    # the agent's watch keeps the round only: the v3 record has no participant list to read
    # (it read a "participants" key the record no longer has: an always-empty set)
    w = _watch(order[0], Settings())
    assert w.round == 1 and w.members is None
    assert w.change() == (None, False)


def test_the_first_node_to_spend_its_restart_explains_no_other_nodes_failure(
    group: Callable[..., Group],
) -> None:
    """A genuine crash, every peer alive: the node whose grace runs out first spends its restart
    and re-joins, which opens a round ("a participant re-joined", nobody gone or waiting). The
    other nodes, still in their grace, must not take that for a membership change: each of them
    charges its restart too (docs/agent.md: every node whose workers failed charges it once)."""
    from petctl_agent.settings import Settings as S

    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    first, rest = order[2], order[:2]
    short = S.from_env({"PETCTL_AGENT_FAILURE_GRACE": "1"})
    got: dict[str, tuple[str | None, float]] = {}

    def run(h: PetctlRendezvousHandler, settings: Settings, rejoin: bool) -> None:
        t = time.monotonic()
        why = _watch(h, settings).failure_explained(threading.Event())
        got[h.node_id] = (why, time.monotonic() - t)
        if rejoin and why is None:
            h._event("re-joining after spending a restart")  # noqa: SLF001
            threading.Thread(target=lambda: g.rendezvous(h, timeout=20), daemon=True).start()

    ts = [threading.Thread(target=run, args=(first, short, True), daemon=True)]
    ts += [threading.Thread(target=run, args=(h, Settings(), False), daemon=True) for h in rest]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert got[first.node_id][0] is None, got
    assert any(
        h.pending_change() and h.pending_change()["reason"] == "a participant re-joined" for h in rest
    ), "the first node's re-join opened no round: this test checks nothing"
    for h in rest:
        why, took = got[h.node_id]
        assert why is None, f"{h.node_id}: a peer's re-join after its own crash was taken for a loss: {why!r}"
        assert took >= 7.0, took


def _stall(h: PetctlRendezvousHandler) -> threading.Event:
    """While the returned event is set, ``h``'s keepalives hang (an agent stalled by memory
    pressure: its lease is not kept alive, but it lives and keeps its node id)."""
    stalled = threading.Event()
    real = h._etcd.keepalive_once  # noqa: SLF001

    def slow(*a: Any, **k: Any) -> Any:
        while stalled.is_set():
            time.sleep(0.05)
        return real(*a, **k)

    h._etcd.keepalive_once = slow  # noqa: SLF001
    return stalled


def _rejoin_until_together(
    g: Group, hs: list[PetctlRendezvousHandler], watches: dict[PetctlRendezvousHandler, MembershipWatch]
) -> dict[PetctlRendezvousHandler, list[str]]:
    """Act as the agents after a free restart: re-join, ``started`` after each round, re-join when
    a round opens, until all of ``hs`` run in one round. Returns what each ``take_charge`` gave."""
    charged: dict[PetctlRendezvousHandler, list[str]] = {h: [] for h in hs}
    g.join(*hs)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for h in hs:
            r = g.results.get(h)
            assert not isinstance(r, Exception), r
            if r is not None and watches[h].round != h.round:
                watches[h].started(h)
                charged[h] += watches[h].take_charge()
            if r is not None and h.num_nodes_waiting() > 0:
                g.join(h)
        if all(g.results.get(h) for h in hs) and len({h.round for h in hs}) == 1:
            if all(watches[h].round == h.round for h in hs) and hs[0].record["n"] == len(hs):
                return charged
        time.sleep(0.02)
    raise AssertionError(f"no round of {len(hs)}: {[(h.round, g.results.get(h)) for h in hs]}")


def test_a_node_named_gone_that_comes_back_charges_the_restart(group: Callable[..., Group]) -> None:
    """Every node's workers fail (one crashed) while that node's agent stalls 3 s (its keepalives
    too): the leader reads its lease as not kept alive and names it gone, so every agent's
    failure is explained and restarts for free. The node comes back with the same id in the
    next round or the one after: the record says it ``returned``, and every agent's watch asks
    for that restart to be charged (once). A crash loop thus spends the budget."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    x = order[2]
    stalled = _stall(x)
    stalled.set()
    watches = {h: _watch(h, Settings()) for h in order}
    got: dict[PetctlRendezvousHandler, str | None] = {}

    def fail(h: PetctlRendezvousHandler) -> None:
        if h is x:
            time.sleep(3.0)  # the stalled agent sees its workers' exit late
            stalled.clear()
        got[h] = watches[h].failure_explained(threading.Event())

    ts = [threading.Thread(target=fail, args=(h,), daemon=True) for h in order]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert all(got.get(h) and x.node_id in got[h] and "gone" in got[h] for h in order), got
    charged = _rejoin_until_together(g, order, watches)
    assert all(charged[h] == [x.node_id] for h in order), {h.node_id: c for h, c in charged.items()}
    assert {h.round for h in order} in ({2}, {3})


def test_a_node_named_gone_at_start_up_that_comes_back_charges_the_restart(
    group: Callable[..., Group],
) -> None:
    """The start-up window's version: no worker fails (they wait at process-group init), but a
    node's agent stalls 3 s while the workers start, so the leader's lease reads name it gone and
    every agent restarts for free from its monitor loop (``change``; the agent then calls
    ``restart_for_a_loss``). It comes back under its id: every agent is charged once, as after a
    failure. Without it a node stalling at every start would restart the job for ever, free."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    x = order[2]
    stalled = _stall(x)
    watches = {h: _watch(h, Settings()) for h in order}
    for h in order:
        h.workers_starting()
    stalled.set()
    t0 = time.monotonic()
    while not all(watches[h].change()[0] for h in order[:2]):
        assert time.monotonic() - t0 < 5.0, "the start-up lease reads named nobody gone"
        time.sleep(0.05)
    assert all(x.node_id in (h.pending_change() or {}).get("gone", []) for h in order[:2])
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
    stalled.clear()
    for h in order:  # what the agent's monitor loop does on that change while its workers start
        watches[h].restart_for_a_loss()
    charged = _rejoin_until_together(g, order, watches)
    assert all(charged[h] == [x.node_id] for h in order), {h.node_id: c for h, c in charged.items()}


def test_a_real_loss_stays_free(group: Callable[..., Group]) -> None:
    """The same failure with the node really lost (SIGKILLed: it never comes back): explained,
    and no charge after the survivors' round, nor after the next one."""
    g = group(2, 8, settle=SETTLE)
    order = _three(g)
    dead = order[2]
    survivors = order[:2]
    watches = {h: _watch(h, Settings()) for h in survivors}
    dead._crash()  # noqa: SLF001
    time.sleep(0.2)
    got = {h: watches[h].failure_explained(threading.Event()) for h in survivors[:1]}
    got.update({h: watches[h].failure_explained(threading.Event()) for h in survivors[1:]})
    assert all(w and dead.node_id in w for w in got.values()), got
    charged = _rejoin_until_together(g, survivors, watches)
    assert charged == {h: [] for h in survivors}
    newcomer = g.new()
    charged = _rejoin_until_together(
        g, [*survivors, newcomer], {**watches, newcomer: _watch(newcomer, Settings())}
    )
    assert all(c == [] for c in charged.values()), charged


def test_a_real_loss_beside_a_stall_stays_free(group: Callable[..., Group]) -> None:
    """Node X is SIGKILLed while node Y's agent stalls 3 s (its keepalives too), at the same
    moment: every survivor's workers fail, the leader names both gone, every agent restarts for
    free. Y comes back under its id, X never does: X's loss alone explains the restart, so no
    agent is charged, in the survivors' round nor in the next. (The charge was per round: Y's
    ``returned`` charged every agent for a real loss.)"""
    g = group(2, 8, settle=SETTLE)
    hs = [g.new() for _ in range(4)]
    res = g.rendezvous(*hs)
    time.sleep(1.5)
    order = sorted(hs, key=lambda h: res[h].rank)
    x, y = order[3], order[2]
    survivors = order[:3]
    stalled = _stall(y)
    stalled.set()
    x._crash()  # noqa: SLF001
    watches = {h: _watch(h, Settings()) for h in survivors}
    got: dict[PetctlRendezvousHandler, str | None] = {}
    named: dict[PetctlRendezvousHandler, list[str]] = {}

    def fail(h: PetctlRendezvousHandler) -> None:
        if h is y:
            time.sleep(3.0)  # the stalled agent sees its workers' exit late
            stalled.clear()
        got[h] = watches[h].failure_explained(threading.Event())
        named[h] = list((h.pending_change() or {}).get("gone") or [])

    ts = [threading.Thread(target=fail, args=(h,), daemon=True) for h in survivors]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert all(got.get(h) and "gone" in (got[h] or "") for h in survivors), got
    # the case under test: one change names both, the real loss and the stall
    assert all(set(named[h]) == {x.node_id, y.node_id} for h in survivors), named
    charged = _rejoin_until_together(g, survivors, watches)
    assert {h.round for h in survivors} in ({2}, {3})
    assert any(y.node_id in (h.record or {}).get("returned", []) for h in survivors) or any(
        y.node_id in (rec.get("returned") or []) for _, rec in survivors[0].records_since(1)
    ), "Y did not come back under its id: this test did not make the case"
    assert charged == {h: [] for h in survivors}, {h.node_id: c for h, c in charged.items()}
    newcomer = g.new()
    charged = _rejoin_until_together(
        g, [*survivors, newcomer], {**watches, newcomer: _watch(newcomer, Settings())}
    )
    assert all(c == [] for c in charged.values()), charged


def test_charging_a_false_loss_spends_the_budget_then_fails() -> None:
    """The agent's side: each charge takes one restart from torch's budget; with none left the
    agent fails (run() returns FAILED with this reason), as after max_restarts worker failures."""
    from types import SimpleNamespace

    from petctl_agent.elastic.agent import PetctlElasticAgent, RestartBudgetSpent

    agent = PetctlElasticAgent.__new__(PetctlElasticAgent)  # only the budget's state is needed
    agent._remaining_restarts, agent._free_restarts = 2, 2  # noqa: SLF001
    wg = SimpleNamespace(spec=SimpleNamespace(max_restarts=2))
    agent._charge_false_loss(wg, ["n1"])  # noqa: SLF001
    agent._charge_false_loss(wg, ["n1"])  # noqa: SLF001
    assert (agent._remaining_restarts, agent._free_restarts) == (0, 0)  # noqa: SLF001
    with pytest.raises(RestartBudgetSpent, match="after 2 restarts.*n1.*came back"):
        agent._charge_false_loss(wg, ["n1"])  # noqa: SLF001
