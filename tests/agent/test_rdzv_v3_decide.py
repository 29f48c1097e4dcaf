"""The leader's close and open decisions (``petctl_agent.rendezvous.decide``): pure functions of
what it sees, so every deadline is checked here without etcd or sleeps."""

from __future__ import annotations

import math

from petctl_agent.rendezvous.decide import (
    CloseView,
    OpenView,
    clear_after,
    close,
    heard_since,
    lapse_recheck,
    lapsed,
    open_round,
    rank_order,
    stall_lapse_after,
)

LIVE = {"a": 10, "b": 11, "c": 12, "d": 13}


def view(**kw) -> CloseView:
    base = dict(now=100.0, opened_at=100.0, live=LIVE, seen_at={n: 90.0 for n in LIVE}, joined=set(),
                min_nodes=2, max_nodes=8, settle=0.5, join_window=5.0, straggler=10.0)  # fmt: skip
    base.update(kw)
    return CloseView(**base)


def test_rank_order_keeps_survivors_then_registration() -> None:
    assert rank_order(["c", "x", "a"], {"a", "b", "c", "d"}, LIVE.__getitem__) == ["c", "a", "b", "d"]


def test_below_min_waits_without_a_deadline() -> None:
    assert close(view(now=1000.0, joined={"a"})) == (None, None)


def test_settle_is_one_shot_from_the_opening() -> None:
    v = dict(live={"a": 1, "b": 2}, seen_at={"a": 90.0, "b": 90.0}, joined={"a", "b"})
    parts, again = close(view(now=100.2, **v))
    assert parts is None and 0.3 <= again <= 0.32
    # a node that registered (and joined) at 100.4 does not push the close past 100.5
    v = dict(
        live={"a": 1, "b": 2, "c": 3}, seen_at={"a": 90.0, "b": 90.0, "c": 100.4}, joined={"a", "b", "c"}
    )
    assert close(view(now=100.5, **v)) == (["a", "b", "c"], None)


def test_the_hint_met_skips_the_settle_window() -> None:
    v = dict(live={"a": 1, "b": 2}, joined={"a", "b"}, expected=2)
    assert close(view(now=100.01, **v)) == (["a", "b"], None)


def test_a_round_of_the_previous_rounds_nodes_only_skips_the_settle_window() -> None:
    # a drain or a loss without a hint (a spot reclaim keeps the desired capacity): the two
    # survivors of a, b, c rejoin and nobody else is registered -- nothing to batch, close now
    v = dict(base=["a", "b", "c"], live={"a": 1, "b": 2}, joined={"a", "b"})
    assert close(view(now=100.01, **v)) == (["a", "b"], None)
    # a worker's restart: the same nodes again
    v = dict(base=["a", "b"], live={"a": 1, "b": 2}, joined={"a", "b"})
    assert close(view(now=100.01, **v)) == (["a", "b"], None)
    # a survivor not yet re-joined still holds it (its straggler deadline), settle or not
    v = dict(base=["a", "b", "c"], live={"a": 1, "b": 2, "c": 3}, joined={"a", "b"})
    parts, again = close(view(now=100.01, **v))
    assert parts is None and 9.9 < again < 10.1
    # a newcomer among the joined: the settle applies as before
    v = dict(base=["a", "b"], live={"a": 1, "b": 2, "c": 3}, joined={"a", "b", "c"})
    parts, again = close(view(now=100.01, **v))
    assert parts is None and 0.4 < again < 0.51


def test_a_stale_hint_does_not_skip_the_settle_window() -> None:
    # the hint says 2 (read before the scale-out) while 2 survivors and a newcomer join
    v = dict(base=["a", "b"], live={"a": 1, "b": 2, "c": 3}, joined={"a", "b", "c"}, expected=2)
    parts, again = close(view(now=100.01, **v))
    assert parts is None and again is not None


def test_a_straggler_is_left_out_at_its_deadline() -> None:
    # d registered long ago and never joins: it holds the round until opened_at + straggler
    v = dict(joined={"a", "b", "c"})
    parts, again = close(view(now=105.0, **v))
    assert parts is None and 4.9 < again < 5.1
    assert close(view(now=110.0, **v)) == (["a", "b", "c"], None)


def test_a_late_registration_gets_its_own_straggler_deadline() -> None:
    seen = {"a": 90.0, "b": 90.0, "c": 90.0, "d": 104.0}  # d registered 4 s after the opening
    parts, again = close(view(now=110.0, seen_at=seen, joined={"a", "b", "c"}))
    assert parts is None and 3.9 < again < 4.1
    assert close(view(now=114.0, seen_at=seen, joined={"a", "b", "c"}))[0] == ["a", "b", "c"]


def test_newcomers_after_the_join_window_are_not_waited_for() -> None:
    seen = {"a": 90.0, "b": 90.0, "c": 90.0, "d": 105.5}  # registered after opened_at + join_window
    assert close(view(now=105.6, seen_at=seen, joined={"a", "b", "c"})) == (["a", "b", "c"], None)
    # ...but one that already joined is in
    assert close(view(now=105.6, seen_at=seen, joined={"a", "b", "c", "d"}))[0] == ["a", "b", "c", "d"]


def test_max_closes_at_once_and_extras_wait() -> None:
    parts, again = close(view(max_nodes=2, joined={"c", "a", "d"}, now=100.0))
    assert parts == ["a", "c"] and again is None


def test_a_gone_participant_opens_at_once() -> None:
    v = OpenView(now=0.0, participants=["a", "b", "x"], live=LIVE, ready={}, max_nodes=8, expected=10)
    assert open_round(v) == (([], ["x"]), None)


def test_registered_but_not_ready_never_opens_a_round() -> None:
    # c and d are registered (booting, stuck) but have not joined the next round
    assert open_round(OpenView(now=0.0, participants=["a", "b"], live=LIVE, ready={}, max_nodes=8)) == (
        None,
        None,
    )


def test_ready_newcomers_are_batched_by_the_hint_until_a_quiet_gap() -> None:
    parts = ["a", "b"]
    v = OpenView(
        now=3.0, participants=parts, live=LIVE, ready={"c": 1.0}, max_nodes=8, expected=4, hint_wait=5.0
    )
    got, again = open_round(v)
    assert got is None and 2.9 < again < 3.1
    # a second newcomer at 5.5: more are coming, keep batching (until 5.5 + 5.0)
    v = OpenView(now=6.0, participants=parts, live={**LIVE, "e": 14}, ready={"c": 1.0, "e": 5.5},
                 max_nodes=8, expected=5, hint_wait=5.0)  # fmt: skip
    got, again = open_round(v)
    assert got is None and 4.4 < again < 4.6
    # none for hint_wait: the rest are not coming soon, open with those ready
    v = OpenView(now=10.6, participants=parts, live={**LIVE, "e": 14}, ready={"c": 1.0, "e": 5.5},
                 max_nodes=8, expected=5, hint_wait=5.0)  # fmt: skip
    assert open_round(v) == ((["c", "e"], []), None)
    # the hint met: at once
    v = OpenView(now=1.1, participants=parts, live=LIVE, ready={"c": 1.0, "d": 1.1}, max_nodes=8, expected=4)
    assert open_round(v) == ((["c", "d"], []), None)
    # no hint: at once
    v = OpenView(now=1.0, participants=parts, live=LIVE, ready={"c": 1.0}, max_nodes=8)
    assert open_round(v) == ((["c"], []), None)


def test_newcomers_trickling_over_a_long_spread_are_one_round_at_most_hint_max() -> None:
    """8 running, the hint 16, a newcomer every 4 s (hint_wait 5): never a quiet gap, so no
    round until the hint is met (one stall of the running nodes, not one per hint_wait); and
    never past hint_max from the first newcomer."""
    parts = [f"p{i}" for i in range(8)]
    live = {n: i for i, n in enumerate(parts)} | {f"n{i}": 100 + i for i in range(8)}
    for k in range(1, 8):  # n0..n(k-1) ready, at 0, 4, 8, ...
        ready = {f"n{i}": 4.0 * i for i in range(k)}
        v = OpenView(now=4.0 * (k - 1) + 3.9, participants=parts, live=live, ready=ready,
                     max_nodes=16, expected=16, hint_wait=5.0, hint_max=60.0)  # fmt: skip
        assert open_round(v)[0] is None, k
    ready = {f"n{i}": 4.0 * i for i in range(8)}
    v = OpenView(now=28.0, participants=parts, live=live, ready=ready, max_nodes=16, expected=16)
    assert open_round(v) == (([f"n{i}" for i in range(8)], []), None)
    # a newcomer every 4 s for ever (the hint 100): the batch opens at hint_max
    ready = {f"n{i}": 4.0 * i for i in range(8)}
    v = OpenView(now=27.0, participants=parts, live=live, ready=ready, max_nodes=200, expected=100,
                 hint_wait=5.0, hint_max=20.0)  # fmt: skip
    assert open_round(v)[0] == ([f"n{i}" for i in range(8)], [])


def test_at_max_newcomers_do_not_open_a_round() -> None:
    v = OpenView(now=0.0, participants=["a", "b"], live=LIVE, ready={"c": 0.0}, max_nodes=2)
    assert open_round(v) == (None, None)


def test_a_lapsed_node_is_not_waited_for() -> None:
    # d registered long ago, never joined; its lease is no longer kept alive: close at once
    v = dict(joined={"a", "b", "c"})
    assert close(view(now=101.0, lapsed=frozenset({"d"}), **v)) == (["a", "b", "c"], None)
    # lapsed is only about waiting: a lapsed node below MIN does not close the round
    assert close(view(now=101.0, joined={"a"}, lapsed=frozenset({"b", "c", "d"}))) == (None, None)
    # another live straggler still holds it
    parts, again = close(view(now=101.0, lapsed=frozenset({"d"}), joined={"a", "b"}))
    assert parts is None and 8.9 < again < 9.1


def test_lapsed_reads_etcd_whole_seconds_and_our_own_silence() -> None:
    # TTL 6, keepalive every 1 s: etcd reads 5 or 4 (rounded down) for a live lease
    assert not lapsed(5, 6, 0.1) and not lapsed(4, 6, 0.1)
    # 3 left: silent for more than 2 s: lapsed, unless our own keepalive is as late
    assert lapsed(3, 6, 0.1) and lapsed(3, 6, 0.5)
    assert not lapsed(3, 6, 0.6), "our own silence 0.6 s: 2 s is not 1.5 s more"
    assert lapsed(2, 6, 1.0) and not lapsed(2, 6, 1.6)
    # etcd paused 2.5 s: every remaining TTL ran down, ours too (our keepalive was stuck): no lapse
    assert not lapsed(2, 6, 2.6)
    # the lease ended (-1): the watch deletes the key, no lapse is decided on it
    assert not lapsed(-1, 6, 0.0)
    # a lease just extended by a new etcd leader (remaining above the granted TTL)
    assert not lapsed(8, 6, 0.0)


def test_lapse_recheck_is_when_it_could_first_lapse() -> None:
    assert lapse_recheck(5, 6) == 1.0  # silent at most 1 s: 1 s to reach 2 s
    assert lapse_recheck(4, 6) == 0.0 and lapse_recheck(3, 6) == 0.0


def test_a_longer_keepalive_interval_needs_a_longer_silence() -> None:
    # refresh=2 (ttl 6): a live lease reads 5 or 4 (3 when a keepalive is late): silent > 2 s is
    # not enough, > 3 s is (a keepalive missed by a whole second)
    assert not lapsed(3, 6, 0.1, refresh=2.0) and lapsed(2, 6, 0.1, refresh=2.0)
    assert not lapsed(2, 6, 0.6, refresh=2.0), "our own silence 0.6 s: 3 s is not 2.5 s more"
    assert lapse_recheck(5, 6, refresh=2.0) == 2.0


def _reads(silence_at, window: float, after: float | None, poll: float = 0.25) -> list[tuple[float, int]]:
    """The leader's reads of one lease in a lease-read window, as ``lapse.LeaseReads._lapsed`` times them
    (the next at ``max(LAPSE_POLL, lapse_recheck)``), until the window ends or a read is lapsed:
    [(t, remaining read)]. ``silence_at(t)``: etcd's silence of the lease at t (it reads
    ``floor(6 - silence)``, whole seconds rounded down)."""
    out: list[tuple[float, int]] = []
    t = 0.0
    while t <= window:
        remaining = math.floor(6 - silence_at(t))
        out.append((t, remaining))
        if lapsed(remaining, 6, 0.1, after=after):
            break
        t += max(poll, lapse_recheck(remaining, 6, after=after))
    return out


def test_a_stall_window_rides_through_a_3s_pause_of_another_agent() -> None:
    """A stall (no failure: a slow step, a checkpoint) opens a 7.5 s window for most of a slow
    job's steps; a node whose agent pauses 3 s in it (GC, I/O) was read lapsed after 2 s of
    silence: a round, every node restarted, the restart charged. The stall's threshold is
    3 s + refresh + 0.5 s: the pause is ridden through, a vanished node still reads lapsed."""
    after = stall_lapse_after(1.0)
    assert after == 4.5
    # the failure window's rule reads 3 left lapsed (> 2 s silent); the stall's does not
    assert lapsed(3, 6, 0.1) and not lapsed(3, 6, 0.1, after=after)
    assert not lapsed(1, 6, 0.1, after=after), "silent > 4 s: a 3 s pause begun just before a keepalive"
    assert lapsed(0, 6, 0.1, after=after), "silent > 5 s: no 3 s pause explains it"
    assert not lapsed(0, 6, 4.6, after=after), "our own silence still counts (etcd paused)"
    for start in [i / 20 for i in range(60)]:  # when the pause begins in the window
        for phase in [i / 10 for i in range(10)]:  # and where in its keepalive period

            def paused(t: float, start: float = start, phase: float = phase) -> float:
                last = math.floor(t - phase) + phase  # the last keepalive, every 1 s
                if start <= t < start + 3.0:
                    last = math.floor(start - phase) + phase  # none during the pause
                return t - last + 0.05  # and a keepalive's trip to etcd

            reads = _reads(paused, 7.5, after)
            assert not lapsed(reads[-1][1], 6, 0.1, after=after), (start, phase, reads)
            # the failure window's 2 s rule names it gone (what the stall window did)
            assert lapsed(_reads(paused, 7.5, None)[-1][1], 6, 0.1), (start, phase)


def test_a_stall_window_reads_a_kept_alive_lease_at_most_3_times() -> None:
    """lapse_recheck times the next read at the first moment it could read lapsed: a kept-alive
    lease (5 or 4 left) is read again in 4 or 3 s with the stall's threshold, so 2-3 reads in the
    7.5 s window (the 2 s rule: every 0.25-1 s, 8-30). A vanished one still reads lapsed before
    its TTL (6 s of silence) ends."""
    after = stall_lapse_after(1.0)
    for phase in [i / 10 for i in range(10)]:

        def alive(t: float, phase: float = phase) -> float:
            return t - (math.floor(t - phase) + phase) + 0.05

        assert len(_reads(alive, 7.5, after)) <= 3, phase
        assert len(_reads(alive, 7.5, None)) >= 8, phase
        for silent0 in (1.0, 1.5, 2.0):  # the stall is seen 1-2 s after the loss

            def gone(t: float, silent0: float = silent0) -> float:
                return silent0 + t

            reads = _reads(gone, 7.5, after)
            assert lapsed(reads[-1][1], 6, 0.1, after=after), (silent0, reads)
            assert silent0 + reads[-1][0] < 6.0, (silent0, reads)  # before the lease expires
            assert len(reads) <= 6, reads  # near the threshold: every LAPSE_POLL, once


def _window_reads(
    silence_at, window: float, after: float | None, poll: float = 0.25
) -> list[tuple[float, int]]:
    """The leader's reads of one lease in a window opened at 0 for a loss before it (a failure,
    a stall), as ``lapse.LeaseReads._lapsed`` times them: the first at ``clear_after``, none after one that
    shows the lease renewed since 0 (``heard_since``), the others when they could first lapse."""
    out: list[tuple[float, int]] = []
    t = clear_after(1.0)
    while t <= window:
        remaining = math.floor(6 - silence_at(t))
        out.append((t, remaining))
        if lapsed(remaining, 6, 0.1, after=after) or heard_since(remaining, 6, t, 0.0):
            break
        t += max(poll, lapse_recheck(remaining, 6, after=after))
    return out


def test_heard_since_is_a_renewal_after_the_window_opened() -> None:
    assert clear_after(1.0) == 1.05 and clear_after(2.0) == 2.05
    # read 1.05 s after the window opened: 5 of 6 left ends >= 6.05: renewed at >= 0.05
    assert heard_since(5, 6, 1.05, 0.0) and not heard_since(4, 6, 1.05, 0.0)
    assert not heard_since(5, 6, 0.9, 0.0), "5 left read before 1 s: renewed up to 1 s before"
    assert heard_since(4, 6, 2.05, 0.0) and not heard_since(-1, 6, 5.0, 0.0)


def test_a_window_for_a_loss_before_it_reads_a_kept_alive_lease_once() -> None:
    """A window opened by a failure or a stall follows the loss, so a lease renewed since it
    opened was not lost: one read of each kept-alive lease per window (a keepalive late at the
    read: two), however long the window; a lease silent since before it still reads lapsed
    before its TTL ends, with either threshold; a 3 s pause of an agent in a stall's still does
    not."""
    after = stall_lapse_after(1.0)
    for phase in [i / 20 for i in range(20)]:

        def alive(t: float, phase: float = phase) -> float:
            return (t - phase) % 1.0  # renewed every 1 s

        for a in (None, after):
            assert len(_window_reads(alive, 7.5, a)) == 1, (phase, a)

        def late(t: float, phase: float = phase) -> float:
            return 1.02 if abs(t - clear_after(1.0)) < 1e-9 else (t - phase) % 1.0

        assert len(_window_reads(late, 7.5, after)) == 2, phase
        for silent0 in (0.0, 0.2, 0.5, 1.0, 1.5, 2.0):  # its last keepalive, before the window

            def gone(t: float, silent0: float = silent0) -> float:
                return silent0 + t

            for a, by in ((None, 3.1), (after, 6.0)):
                reads = _window_reads(gone, 7.5, a)
                assert lapsed(reads[-1][1], 6, 0.1, after=a), (silent0, a, reads)
                assert silent0 + reads[-1][0] < by, (silent0, a, reads)  # before its TTL (6 s) ends
        for start in [i / 10 for i in range(-20, 50)]:  # a 3 s pause of an agent, in a stall's window

            def paused(t: float, start: float = start, phase: float = phase) -> float:
                last = math.floor(t - phase) + phase
                if start <= t < start + 3.0:
                    last = math.floor(start - phase) + phase
                return t - last

            reads = _window_reads(paused, 7.5, after)
            assert not lapsed(reads[-1][1], 6, 0.1, after=after), (start, phase, reads)


def test_with_no_closed_round_the_order_comes_from_what_the_joins_remember() -> None:
    """etcd replaced (no record on the new etcd): each join's ``prev`` ([round, rank]) keeps the
    survivors' order; only the newest round's count (an older ``prev`` is a node that was left
    out since), and a join without one is a newcomer (ordered after, by registration)."""
    from petctl_agent.rendezvous.record import _order_from_joins

    joins = {
        "c": {"prev": [7, 0]},
        "a": {"prev": [7, 2]},
        "b": {"prev": [7, 1]},
        "old": {"prev": [5, 0]},
        "new": {},
        "junk": {"prev": "x"},
    }
    assert _order_from_joins(joins) == ["c", "b", "a"]
    assert _order_from_joins({"new": {}}) == []
    order = rank_order(
        _order_from_joins(joins), set(joins), lambda n: {"new": 3, "old": 1, "junk": 2}.get(n, 9)
    )
    assert order == ["c", "b", "a", "old", "junk", "new"]


def test_the_order_across_two_etcd_replacements_is_the_newest_rounds() -> None:
    """x ran rounds 1-3 on etcd A with a and b, then sat out while B replaced A: a and b ran
    B's round 1 (which numbers from 1 again). C replaces B and all three join. By round number
    x's A-round 3 beats B's round 1, and x alone would set the order (a and b after it, by
    registration); by ``seq`` (a Lamport clock over every round seen, on any etcd) B's round is
    the newest and its order is kept, x after it."""
    from petctl_agent.rendezvous.record import _order_from_joins, next_seq

    a_round3 = {"seq": 3}
    assert next_seq(a_round3, 3, {}) == 4  # no replacement: seq == round number
    assert next_seq(None, 0, {}) == 1
    # B's first round: a and b ran A's round 3 (and saw it closed); x did not join
    b_joins = {"a": {"prev": [3, 1, "A"], "seen": 3}, "b": {"prev": [3, 2, "A"], "seen": 3}}
    seq_b1 = next_seq(None, 0, b_joins)
    assert seq_b1 == 4
    # B's round 1 put b first (say), a second; C's first round:
    c_joins = {
        "x": {"prev": [3, 0, "A"], "seen": 3},
        "a": {"prev": [seq_b1, 1, "B"], "seen": seq_b1},
        "b": {"prev": [seq_b1, 0, "B"], "seen": seq_b1},
    }
    assert _order_from_joins(c_joins) == ["b", "a"]
    assert next_seq(None, 0, c_joins) == seq_b1 + 1
    # x sat out B's rounds but saw one close: its next join says so, and the seq moves past it
    assert next_seq(None, 0, {"x": {"prev": [3, 0, "A"], "seen": 9}}) == 10


def test_two_rounds_with_one_seq_on_two_etcds_the_larger_group_wins() -> None:
    """Two rounds got the same seq on two etcds (no node of one saw the other close): their
    ranks conflict, so only one round's order is kept: the one most joined nodes ran in."""
    from petctl_agent.rendezvous.record import _order_from_joins

    joins = {
        "x": {"prev": [5, 0, "A"]},
        "y": {"prev": [5, 1, "B"]},
        "z": {"prev": [5, 0, "B"]},
        "w": {"prev": [4, 0, "B"]},
    }
    assert _order_from_joins(joins) == ["z", "y"]


def _charged(marker: dict, rounds: list[list[str]], named: list[str], n_named: int | None = None) -> bool:
    """Records written by the leader (``_came_back``) for the round a marker opened and the
    next ones (``rounds``: each round's participants), read by an agent's ``_Loss`` as
    ``MembershipWatch.started`` does: is the free restart for ``named`` charged?"""
    import json

    from petctl_agent.elastic.membership import _Loss
    from petctl_agent.rendezvous.record import _came_back

    loss = _Loss(5, named, len(named) if n_named is None else n_named)
    prev: str | None = None
    m: str | None = json.dumps(marker)
    for i, parts in enumerate(rounds):
        rec = {"state": "closed", **_came_back(m, prev, parts)}
        loss.see(5 + i, rec)
        prev, m = json.dumps(rec), None
    return loss.all_back()


def test_a_restart_is_charged_only_when_every_node_named_gone_came_back() -> None:
    gone = {"state": "open", "gone": ["x", "y"], "n_gone": 2}
    # a stall alone, back at once or a round later: charged (a crash loop spends the budget)
    assert _charged({"gone": ["y"], "n_gone": 1}, [["a", "y"]], ["y"])
    assert _charged({"gone": ["y"], "n_gone": 1}, [["a"], ["a", "y"]], ["y"])
    # both stalled, both back (in different rounds): charged
    assert _charged(gone, [["a", "y"], ["a", "x", "y"]], ["x", "y"])
    # x really lost, y stalled and back: x's loss explains the restart: free
    assert not _charged(gone, [["a", "y"]], ["x", "y"])
    assert not _charged(gone, [["a", "y"], ["a", "y", "n"]], ["x", "y"])
    # nobody back yet: free so far
    assert not _charged(gone, [["a"]], ["x", "y"])


def test_more_gone_than_a_marker_lists_is_never_charged() -> None:
    """17 named gone, 16 listed: the one not listed may be a real loss, so even if all 16 listed
    come back, nothing is charged (the leader counts the unlisted one out: ``n_out``)."""
    listed = [f"n{i:02d}" for i in range(16)]
    marker = {"state": "open", "gone": listed, "n_gone": 17}
    assert not _charged(marker, [["a", *listed]], listed, 17)


def test_a_node_of_the_previous_round_is_waited_for_as_long_as_its_stop_may_take() -> None:
    # a and b ran round r; c is new. b's coordinated stop (a checkpoint of GiBs, or a script that
    # does not honour the drain file: the agent's sync timeout, 30 s) outlasts the straggler
    # window: left out at 10 s, it would join the next round and stop a and c again (seen in CI:
    # two nodes took turns training alone for 180 s).
    v = dict(base=["a", "b"], live={"a": 1, "b": 2, "c": 3}, joined={"a", "c"}, stop_wait=36.0)
    parts, again = close(view(now=110.0, **v))
    assert parts is None and 25.9 < again < 26.1
    assert close(view(now=136.0, **v)) == (["a", "c"], None)  # then left out, as a straggler is
    # without stop_wait (torchrun with petctl-etcd: no coordinated stop) the straggler deadline
    assert close(view(now=110.0, **{**v, "stop_wait": 0.0})) == (["a", "c"], None)
    # a newcomer that registered and never joins still gets the straggler window only
    v = dict(base=["a", "b"], live={"a": 1, "b": 2, "c": 3, "d": 4}, joined={"a", "b", "c"}, stop_wait=36.0)
    assert close(view(now=110.0, **v)) == (["a", "b", "c"], None)
    # a previous participant whose lease lapsed (a hard loss) is not waited for at all
    v = dict(base=["a", "b"], live={"a": 1, "b": 2, "c": 3}, joined={"a", "c"}, stop_wait=36.0)
    assert close(view(now=101.0, lapsed=frozenset({"b"}), **v)) == (["a", "c"], None)
    # one that registered again meanwhile (its lease lapsed in a pause) is no newcomer: waited
    # for past the join window, stop_wait after the opening or straggler after it came back
    v = dict(base=["a", "b"], live={"a": 1, "b": 5, "c": 3}, joined={"a", "c"}, stop_wait=36.0)
    seen = {"a": 90.0, "b": 130.0, "c": 90.0}  # b: 30 s after the opening, past join_window (5)
    parts, again = close(view(now=131.0, seen_at=seen, **v))
    assert parts is None and 8.9 < again < 9.1  # 130 + 10
    assert close(view(now=140.0, seen_at=seen, **v)) == (["a", "c"], None)
    # a stop_wait shorter than the straggler window does not shorten it
    parts, again = close(view(now=105.0, **{**v, "stop_wait": 2.0}))
    assert parts is None and 4.9 < again < 5.1
