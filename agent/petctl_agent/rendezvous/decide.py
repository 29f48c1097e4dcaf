"""The leader's two decisions, as pure functions of what it sees (no etcd, no clock: ``now`` and
every time passed in are ``time.monotonic`` readings of the leader). Unit-tested in
tests/agent/test_rdzv_v3_decide.py; docs/rendezvous.md, "Closing a round", says why each rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


def rank_order(base: Sequence[str], nodes: set[str], reg: Callable[[str], int]) -> list[str]:
    """The last round's participants that are in ``nodes`` (in rank order), then the rest by
    registration revision (then id)."""
    survivors = [n for n in base if n in nodes]
    rest = sorted(nodes - set(survivors), key=lambda n: (reg(n), n))
    return survivors + rest


def effective_hint(expected: int | None, parts: int, survivors: int) -> int | None:
    """The size hint, unless it predates the newcomers now joining (a desired capacity read
    before a scale-out: it expects no growth while there is some). A stale hint is no hint."""
    if expected is not None and parts > survivors and expected <= survivors:
        return None
    return expected


@dataclass(frozen=True)
class CloseView:
    """What the leader sees of round ``T`` that it may close."""

    now: float
    opened_at: float  #: when the leader first saw round T open (its marker, or a first join)
    live: Mapping[str, int]  #: registered node -> registration (create) revision
    #: registered node -> when the leader first saw it registered while round T forms (a node
    #: whose key went and came back keeps its first time: a flapping lease holds no round open)
    seen_at: Mapping[str, float]
    joined: set[str]  #: nodes with a join for T
    base: Sequence[str] = ()  #: the previous round's participants, in rank order
    min_nodes: int = 1
    max_nodes: int = 1
    expected: int | None = None
    settle: float = 0.5
    join_window: float = 5.0
    straggler: float = 10.0
    #: how long a previous round's participant (alive, not joined) may take to stop its workers
    #: and join: the agent's coordinated stop (sync timeout) plus its reaction; 0: ``straggler``
    stop_wait: float = 0.0
    lapsed: frozenset[str] = frozenset()  #: registered, not joined, its lease not kept alive: dead


#: the keepalive silence (s) a stall window's lease reads ride through: an agent or etcd paused
#: this long (a GC, swap, I/O; "Lease TTLs ride through a 3 s pause")
RIDE_THROUGH = 3.0


def stall_lapse_after(refresh: float = 1.0) -> float:
    """The silence that reads a lease lapsed in a window opened by a *stall* (no failure: a weak
    signal, open for most of a slow job's steps): a pause of ``RIDE_THROUGH`` s plus the
    ``refresh`` the pause may have begun just before, plus 0.5 s margin: 4.5 s at refresh 1
    (etcd's whole seconds make it read lapsed only with < 1 s of a 6 s TTL left). A failure or
    the start-up window keeps ``refresh + 1`` (:func:`lapsed`'s default)."""
    return RIDE_THROUGH + refresh + 0.5


def lapsed(
    remaining: int, granted: int, own_silence: float, refresh: float = 1.0, after: float | None = None
) -> bool:
    """Whether a lease whose ``LeaseTimeToLive`` read ``remaining`` (of ``granted``) seconds was
    certainly not kept alive by its holder (which renews it every ``refresh``): etcd has heard
    no keepalive of it for at least ``after`` (default ``refresh + 1``, 2 s: a whole second past
    a missed keepalive; a stall window passes :func:`stall_lapse_after`) and for ``refresh + 0.5``
    longer than the leader's own lease (``own_silence``: now - when the leader's last successful
    keepalive was sent).

    etcd rounds the remaining TTL *down* to whole seconds, so the silence is more than
    ``granted - remaining - 1``. The margin over our own silence keeps an etcd pause (SIGSTOP,
    a stall: the remaining TTLs run down meanwhile, every lease's alike, and our own keepalive
    was stuck too) from reading as everyone's loss. ``remaining < 0`` (the lease ended) is no
    lapse: its keys are deleted and the membership watch says so.
    """
    if remaining < 0:
        return False
    silent = granted - remaining - 1
    need = refresh + 1.0 if after is None else after
    return silent >= max(need, own_silence + refresh + 0.5)


def lapse_recheck(remaining: int, granted: int, refresh: float = 1.0, after: float | None = None) -> float:
    """When a lease read not lapsed can first read lapsed (by its silence, :func:`lapsed`'s
    ``after``): a read must show at most ``R = floor(granted - 1 - after)`` s left; the lease has
    at least ``remaining`` left now, so that is ``remaining - R - 1`` s away at the earliest
    (0: it could already, only our own silence held it). A kept-alive lease (5 of 6 left) is read
    again in 1 s at ``after`` 2, in 4 s at 4.5: 1-2 reads per lease in a 7.5 s stall window."""
    need = refresh + 1.0 if after is None else after
    most = math.floor(granted - 1 - need + 1e-9)
    return float(max(0, remaining - most - 1))


def clear_after(refresh: float = 1.0) -> float:
    """How long after a window opens for a loss before it (a failure, a stall) the leader first
    reads the leases: the earliest a read can show (:func:`heard_since`) that a lease kept alive
    every ``refresh`` was renewed since: 1.05 s at refresh 1 (a renewal at most 1 s old reads
    5 of 6; rounded down, 5 says renewed within 1 s)."""
    return math.ceil(refresh - 1e-9) + 0.05


def heard_since(remaining: int, granted: int, sent: float, since: float) -> bool:
    """Whether a ``LeaseTimeToLive`` sent at ``sent`` that read ``remaining`` (of ``granted``)
    shows etcd renewed the lease at ``since`` or later: etcd rounds down, so the lease ends
    ``remaining`` s or more after the read (which etcd answered after ``sent``), and was last
    renewed ``granted`` s before it ends. Such a lease was alive after ``since``: a window opened
    for a loss before ``since`` need not read it again. An ended lease (-1) was not."""
    return remaining >= 0 and sent + remaining - granted >= since


def close(v: CloseView) -> tuple[list[str] | None, float | None]:
    """``(participants, None)``: close now with them, in rank order. ``(None, s)``: look again
    in ``s`` seconds (or at the next change). ``(None, None)``: wait for a change.

    * Fewer than MIN live nodes joined: wait (no deadline applies below MIN).
    * MAX joined: close now (more would wait for the next round anyway).
    * ``settle`` after the opening, once (never re-armed by an arrival); skipped when the hint
      is met, and when every joined node was in the previous round (nothing arrives to batch).
    * Every live registered node that has not joined holds the round until its straggler
      deadline, ``straggler`` after it registered or after the round opened, whichever is
      later; then it is left out (it joins the next round when it is ready). A node that
      registered more than ``join_window`` after the round opened is not waited for at all.
    * A node of the previous round (``base``) is stopping its workers: it holds the round until
      ``stop_wait`` after the opening, or its straggler deadline if later (one that registered
      again meanwhile: ``straggler`` after the leader first saw it registered, join window or
      not; registering again later never moves it: ``seen_at``). A running node's coordinated stop (a
      checkpoint of GiBs, a script that does not honour the drain file) can outlast the
      straggler window; left out, it joins the next round and stops everyone again, and two
      such nodes could take turns training alone forever.
    * A ``lapsed`` node (registered, not joined, and its lease no longer kept alive: a hard
      loss whose key has not expired yet) is not waited for either.
    """
    joined = {n for n in v.joined if n in v.live}
    if len(joined) < v.min_nodes:
        return None, None
    order = rank_order(v.base, joined, lambda n: v.live[n])
    parts = order[: v.max_nodes]
    if len(joined) >= v.max_nodes:
        return parts, None
    survivors = sum(1 for n in v.base if n in joined)
    exp = effective_hint(v.expected, len(parts), survivors)
    hinted = exp is not None and len(parts) >= min(exp, v.max_nodes)
    # the settle batches arrivals; a round of the previous round's nodes only (a drain, a loss, a
    # worker's restart) has none to batch: a newcomer registering now joins the next round anyway
    # (hint_wait batches those), and every live node not yet joined still holds it below
    shrink = bool(v.base) and joined <= set(v.base)
    due: list[float] = []
    if not hinted and not shrink and v.now < v.opened_at + v.settle:
        due.append(v.opened_at + v.settle)
    was_in = set(v.base)
    for n in v.live:
        if n in joined or n in v.lapsed:
            continue
        at = v.seen_at.get(n, v.opened_at)
        if n in was_in:
            # stopping its workers; one that registered again meanwhile (its lease lapsed in a
            # pause) is still the last round's node, not a newcomer: no join window for it
            deadline = max(max(at, v.opened_at) + v.straggler, v.opened_at + v.stop_wait)
        elif at > v.opened_at + v.join_window:
            continue  # registered after the round's one-shot window: the next round's
        else:
            deadline = max(at, v.opened_at) + v.straggler
        if v.now < deadline:
            due.append(deadline)
    if due:
        return None, max(0.0, min(due) - v.now) + 0.01
    return parts, None


@dataclass(frozen=True)
class OpenView:
    """What the leader of a running round sees."""

    now: float
    participants: Sequence[str]  #: the running round's, in rank order
    live: Mapping[str, int]  #: registered node -> registration revision
    ready: Mapping[str, float]  #: nodes with a join for the next round -> when the leader saw it
    max_nodes: int
    expected: int | None = None
    hint_wait: float = 5.0
    hint_max: float = 60.0


def open_round(v: OpenView) -> tuple[tuple[list[str], list[str]] | None, float | None]:
    """``((waiting, gone), None)``: open the next round now. ``(None, s)``: look again in ``s``
    seconds. ``(None, None)``: nothing to do.

    A participant gone opens it at once. Newcomers count only once they are *ready* (joined the
    next round: booted, registered, called next_rendezvous); a node that registered but never
    joins never opens a round. While the hint says more are coming, ready newcomers are
    batched until none has become ready for ``hint_wait`` (the rest are not coming soon), and
    at most ``hint_max`` from the first of them. The running round keeps training meanwhile, so
    the wait costs the running nodes nothing; a one-shot ``hint_wait`` from the first newcomer
    split newcomers that trickle in over a longer spread into one round (one stall of every
    running node) per ``hint_wait``.
    """
    parts = list(v.participants)
    gone = [p for p in parts if p not in v.live]
    waiting = sorted((n for n in v.ready if n in v.live and n not in parts), key=lambda n: (v.live[n], n))
    if len(parts) - len(gone) >= v.max_nodes:
        waiting = []
    if gone:
        return (waiting, gone), None
    if not waiting:
        return None, None
    if v.expected is not None and len(parts) + len(waiting) < min(v.expected, v.max_nodes):
        first = min(v.ready[n] for n in waiting)
        last = max(v.ready[n] for n in waiting)
        until = min(first + v.hint_max, last + v.hint_wait)
        if v.now < until:
            return None, until - v.now + 0.01
    return (waiting, gone), None
