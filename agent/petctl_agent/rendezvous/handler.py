"""The torch ``RendezvousHandler`` of ``petctl-etcd``: the handler's state, and what torch and
the agent ask of it between rounds (pending changes, leaving, closing). Its threads and the
round protocol are its mixins: :mod:`.membership`, :mod:`.leader` (with :mod:`.leading` and
:mod:`.lapse`), :mod:`.fastloss`, :mod:`.joining`."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousHandler

from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.client import TRANSIENT, RequestCounter, make_client
from petctl_agent.rendezvous.config import BACKEND, DEFAULT_PORT, DEFAULT_PREFIX, Config
from petctl_agent.rendezvous.fastloss import FastLoss
from petctl_agent.rendezvous.joining import Joining
from petctl_agent.rendezvous.layout import Keys, Rounds, rounds_view
from petctl_agent.rendezvous.leader import Leadership
from petctl_agent.rendezvous.membership import Membership, MemberView
from petctl_agent.rendezvous.watcher import Watcher

log = logging.getLogger("petctl_agent.rendezvous")


class PetctlRendezvousHandler(Membership, Leadership, FastLoss, Joining, RendezvousHandler):
    """petctl's rendezvous handler (the package docstring, docs/rendezvous.md). Thread-safe;
    :meth:`next_rendezvous` runs in the caller's thread.

    ``expected_nodes``: optional hint (e.g. the worker group's desired capacity). While the
    current round plus the waiting nodes are below it, the leader holds off announcing a
    new round until no newcomer has become ready for ``hint_wait`` s (at most ``hint_max`` s)
    so that newcomers arriving over a spread become one round (the running workers keep
    training meanwhile); once it is met the round closes without the settle window.
    """

    def __init__(
        self,
        run_id: str,
        endpoint: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        *,
        config: Config | None = None,
        expected_nodes: Callable[[], int | None] | None = None,
        prefix: str = DEFAULT_PREFIX,
        node_id: str | None = None,
        counter: RequestCounter | None = None,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        self.run_id = run_id
        self.host, self.port = parse_rendezvous_endpoint(endpoint, DEFAULT_PORT)
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.addr = local_addr or socket.getfqdn()
        self.cfg = config or Config()
        self.expected_nodes = expected_nodes
        self.counter = counter or RequestCounter()
        safe = "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in self.addr)
        self.node_id = node_id or f"{safe}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.keys = Keys(prefix, run_id)
        self.node_key = self.keys.node(self.node_id)

        self._cond = threading.Condition(threading.RLock())
        self._version = 0
        self._stopping = False
        self._left = False
        self._woken = False  # wake(): a wait_for_change returns at once
        ep = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        #: one v3 client for every thread of this handler (each thread keeps its own connection)
        try:
            self._etcd = make_client(
                ep, self.counter, self.cfg.request_timeout, self.cfg.client_tls(), self.cfg.watch_silence
            )
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"etcd TLS files (cacert/cert/key) do not load: {e}") from None
        self._lease: v3.Lease | None = None  # our membership lease (kept alive by its thread)
        self._rereg = threading.Event()  # the keeper re-registers when set
        self._token: str | None = None  # the etcd boot token our views were read under
        self._opened_at: dict[int, float] = {}  # leader: round -> when it first saw it open
        #: leader: node -> when it first saw it registered while round _first_seen_for[1] formed
        self._first_seen: dict[str, float] = {}
        self._first_seen_for: tuple[int, int] | None = None  # (etcd generation, round)
        self._reg_index: int | None = None  # create_revision of our node key; None = not registered
        self._reg_epoch = 0
        self._generation = 0  # etcd replacements seen: each drops every view
        self._replaced_at = float("-inf")
        #: when we registered again after an outage (our old lease silent >= cfg.outage): _cut_off
        self._back_at = float("-inf")
        self._started = False
        self._rounds: Watcher | None = None
        self._members: Watcher | None = None  # only while we are the leader
        self._leader_w: Watcher | None = None  # the leader's key, while someone else leads
        self._joins: Watcher | None = None  # leader in a rendezvous: joins of the target round
        self._snap = MemberView()  # the last read of nodes/ (a non-leader's: membership.read_membership)
        self._round: int | None = None  # the round we run in (None while joining / before)
        #: the round we ran in when we left (None: we left while joining, or never): ``left_round``
        self._left_round: int | None = None
        self._record: dict[str, Any] | None = None
        self._last_record: dict[str, Any] | None = None  # survives etcd replacement: the head
        #: (seq, rank, etcd boot token) of the round we last ran in: put in our joins as ``prev``
        self._last_rank: tuple[int, int, str] | None = None
        self._seen_seq = 0  #: the newest round's seq we saw closed, on any etcd: put in our joins
        #: leader: (etcd generation, round) -> that round's full rank order (closed it, or read members/<r>)
        self._order: dict[tuple[int, int], list[str]] = {}
        #: leader: (node, lease) -> (when to read that lease again, inf: lapsed; the silence that
        #: time was set for), for round _lapse_target (lapse.py)
        self._lapse_memo: dict[tuple[str, int], tuple[float, float]] = {}
        #: leader: the (node, lease) a read showed renewed since the open window began (lapse.py)
        self._lapse_cleared: set[tuple[str, int]] = set()
        #: the master port our last join published, bound and held until the next (joining.py)
        self._port_hold: socket.socket | None = None
        #: rank 0 of our last round: the workers' TCPStore we serve on that port (joining.py)
        self._workers_store: Any = None
        self._old_stores: list[Any] = []  #: served for earlier starts, until the next (joining.py)
        #: the workers' store is ours (rank 0's agent), as torchrun's; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        #: (torchrun's own switch) leaves it to the script's rank 0
        self._agent_store = os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"
        self._lapse_target: int | None = None
        #: (threshold, window opened at) the memo's times were set for (lapse.py)
        self._lapse_window: tuple[float | None, float | None] | None = None
        self._lease_pool: ThreadPoolExecutor | None = None  # the leader's lease reads (lapse.py)
        #: (dead leader, latest closed round): not a candidate until a round closes (hard loss)
        self._lapsed_leader: tuple[str, int] | None = None
        #: follower: (round joining, since when): the leader's lease is read LAPSE_AFTER after it
        self._waiting_since: tuple[int, float] | None = None
        #: (round, until when, since when): our workers failed in that round; the leases are read
        #: (fastloss.py)
        self._failed: tuple[int, float, float] | None = None
        self._starting: int | None = None  # the round whose workers are starting (fastloss.py)
        self._stalled: int | None = None  # the round whose workers stalled (fastloss.py)
        self._said_lapsed: tuple[int, frozenset[str]] | None = None  # logged (fastloss.py)
        self._target: int | None = None  # the round we are joining
        self._expected_cache: tuple[float, int | None] = (float("-inf"), None)
        self._snapped_for: tuple[str, int] | None = None
        self._threads: list[threading.Thread] = []
        self._no_space: str | None = None  # etcd's NOSPACE alarm, one line (Membership.no_space)
        self._no_space_checked = 0.0
        #: called with that line when etcd starts refusing writes for space, None when it stops
        #: (from whichever handler thread saw it): the agent publishes it
        self.on_no_space: Callable[[str | None], None] | None = None
        #: (time.time(), what): the last few hundred steps, for tests, benchmarks and logs (the
        #: wall clock only labels events; no deadline reads it)
        self.events: deque[tuple[float, str]] = deque(maxlen=500)

    # ---- plumbing --------------------------------------------------------------------
    def _bump(self) -> None:  # caller holds _cond
        self._version += 1
        self._cond.notify_all()

    def _expected(self, fresh: bool = False) -> int | None:
        """The size hint, read at most once a second unless ``fresh``."""
        if self.expected_nodes is None:
            return None
        t, v = self._expected_cache
        if not fresh and time.monotonic() - t < 1.0:
            return v
        try:
            v = self.expected_nodes()
        except Exception as e:  # noqa: BLE001 - a hint only
            log.debug("expected_nodes hint failed: %s", e)
            v = None
        self._expected_cache = (time.monotonic(), v)
        return v

    def _expected_fresh(self, since: float) -> tuple[int | None, bool]:
        """The size hint read from its source at or after ``since`` (``time.monotonic``):
        ``(value, False)``; or ``(the cached value, True)`` while such a read is under way. A hint
        with a ``fresh(since)`` method (the agent's ``CapacityHint``, which caches the Auto
        Scaling API's answer and reads it in the background) is asked for one, never waited on;
        a plain callable is its source, so calling it is the fresh read."""
        fresh = getattr(self.expected_nodes, "fresh", None)
        if fresh is None:
            return self._expected(fresh=True), False
        try:
            done, v = fresh(since)
        except Exception as e:  # noqa: BLE001 - a hint only
            log.debug("expected_nodes hint failed: %s", e)
            return self._expected(), False
        if done:
            self._expected_cache = (time.monotonic(), v)
        return v, not done

    def _event(self, what: str) -> None:
        self.events.append((time.time(), what))
        log.debug("%s: %s", self.node_id, what)

    def _rounds_view(self) -> tuple[Rounds, bool]:
        """The rounds and the closed flag, from the rounds watcher (caller holds _cond)."""
        return rounds_view(self._rounds.items if self._rounds is not None else {})

    # ---- RendezvousHandler -------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # rank 0's agent serves the workers' TCPStore at the port in the round record (joining.py)
        return self._agent_store

    def get_run_id(self) -> str:
        return self.run_id

    def pending_change(self) -> dict[str, Any] | None:
        """Why the current round must end, or None: ``{"round", "reason", "waiting", "gone",
        "n_waiting", "n_gone"}`` (the lists hold the marker's first ids, the counts all of them).

        ``gone`` non-empty (or ``reason`` "round record gone") means a participant is missing:
        the workers cannot take a coordinated checkpoint. Reads local state only (no request).
        """
        with self._cond:
            if self._round is None or self._record is None or self._rounds is None or not self._rounds.synced:
                return None
            rounds, _ = self._rounds_view()
            newer = sorted(r for r in rounds if r > self._round)
            if newer:
                v = rounds[newer[0]][0]
                reason = "new round opened" if v.get("state") == "open" else "a newer round closed without us"
                if v.get("rejoin"):
                    reason = "a participant re-joined"
                waiting, gone = list(v.get("waiting", [])), list(v.get("gone", []))
                return {
                    "round": newer[0],
                    "reason": reason,
                    "waiting": waiting,  # the first MARKER_IDS ids; their number: n_waiting
                    "gone": gone,
                    "n_waiting": int(v.get("n_waiting", len(waiting))),
                    "n_gone": int(v.get("n_gone", len(gone))),
                }
            if self._round not in rounds and self._rounds.connected:
                return {
                    "round": self._round + 1, "reason": "round record gone",
                    "waiting": [], "gone": [], "n_waiting": 0, "n_gone": 0,
                }  # fmt: skip
            return None

    def wait_for_change(self, timeout: float) -> dict[str, Any] | None:
        """Block until :meth:`pending_change` is not None (returned) or ``timeout`` s passed (None).

        Lets a caller react the moment the watch brings a change instead of polling
        :meth:`num_nodes_waiting`.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                ch = self.pending_change()
                left = deadline - time.monotonic()
                if ch is not None or self._left or left <= 0 or self._woken:
                    self._woken = False
                    return ch
                self._cond.wait(left)

    def wake(self) -> None:
        """End the :meth:`wait_for_change` under way (or the next one) now: the agent has
        something else to look at (a worker exited: ``elastic/exitwatch.py``)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round, plus participants gone; >0 means re-rendezvous now.

        Never raises and never talks to etcd: it reads what the watches brought.
        """
        ch = self.pending_change()
        if ch is None:
            return 0
        return max(1, ch["n_waiting"] + ch["n_gone"])

    def is_closed(self) -> bool:
        with self._cond:
            if self._rounds is not None and self._rounds.synced:
                return self._rounds_view()[1]
        return self._etcd.get(self.keys.closed) is not None

    def set_closed(self) -> None:
        self._etcd.put(self.keys.closed, "1")

    def leave(self) -> None:
        """Leave now: revoke our lease (our member key and joins go at once), stop all threads.

        A :meth:`next_rendezvous` running in another thread raises :class:`RendezvousLeftError`.
        Does not close the rendezvous for the others.
        """
        with self._cond:
            if self._left:
                return
            self._left = True
            self._left_round = self._round
            self._round = self._target = None
            self._rereg.set()  # the keeper wakes and ends
            self._bump()
        lease = self._lease
        try:
            if lease is not None:
                lease.revoke()
            else:
                self._etcd.delete(self.node_key)
        except TRANSIENT as e:
            log.warning("could not revoke our membership lease (%s); peers will see it expire", e)
        self._stop_watchers()
        self._event("left")

    def _stop_watchers(self) -> None:
        with self._cond:
            for w in (self._rounds, self._members, self._leader_w, self._joins):
                if w is not None:
                    w.stop()
            pool, self._lease_pool = self._lease_pool, None
            self._bump()
        self._release_port()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> bool:
        """torch's contract: the job is over, close the rendezvous for everyone, release resources."""
        try:
            self.set_closed()
        except TRANSIENT as e:
            log.warning("could not close the rendezvous: %s", e)
        self.leave()
        self._stopping = True
        return True

    def _crash(self) -> None:
        """Tests: stop every thread without deleting the membership key (a SIGKILLed node)."""
        with self._cond:
            self._left = True
            self._stopping = True
            self._rereg.set()
            self._bump()
        if self._lease is not None:
            self._lease.stop()
        self._stop_watchers()

    def stats(self) -> dict[str, int]:
        return self.counter.snapshot()

    @property
    def rereads(self) -> int:
        """Re-reads of the rounds view after its first read (errors, compaction)."""
        with self._cond:
            return self._rounds.rereads if self._rounds is not None else 0

    @property
    def connected(self) -> bool:
        """Does the rounds watch currently reach etcd? (True before the first join.)"""
        with self._cond:
            return self._rounds is None or self._rounds.connected or self._stopping or self._left

    @property
    def round(self) -> int | None:
        return self._round

    @property
    def record(self) -> dict[str, Any] | None:
        return self._record

    @property
    def left_round(self) -> int | None:
        """The round we ran in when :meth:`leave` ran (``round`` is None from then on): the agent
        publishes the round that closed with us as the leave came (its peers count us in it).
        None: we left while joining, or have not left."""
        return self._left_round

    def records_since(self, after: int | None) -> list[tuple[int, dict[str, Any]]]:
        """The records of the closed rounds newer than ``after`` up to ours, oldest first, that
        the rounds watch still holds (a replaced record lives ``record_ttl`` more). Local state,
        no request: what ``MembershipWatch`` reads for who came back (``returned``, ``out``)."""
        with self._cond:
            if self._round is None or self._rounds is None:
                return []
            rounds, _ = self._rounds_view()
            return sorted(
                (n, v)
                for n, (v, _) in rounds.items()
                if v.get("state") == "closed" and (after is None or n > after) and n <= self._round
            )
