"""Light rendezvous participants for ``bench_rdzv_scale.py --light-nodes`` (at 1,000).

A *light node* speaks the petctl-etcd protocol of ``agent/petctl_agent/rendezvous`` with the
same keys and values as a ``PetctlRendezvousHandler`` that never leads, built with that
package's own helpers (``layout.Keys``, ``record.read_rank``, ``joining._free_port``, the
``etcdv3`` client, the ``watcher.Watcher`` of the rounds), but many of them share one process:

* **Membership**: a lease of ``ttl`` (``etcdv3.Client.grant``), ``nodes/<id>`` on it with the
  value ``{"addr", "pid", "lease", "ttl"}`` (``prev_kv``: a re-registration keeps its
  revision), then the bounded read of ``nodes/`` a real node makes per registration
  (``membership.read_membership``: the oldest few keys and the last record's head, keys only).
  A lost lease (etcd says not found, or no keepalive succeeded before its deadline) registers
  again, as the handler's keeper does.
* **Keepalives**: ``keepalive_threads`` threads per process send every node's keepalive every
  ``refresh`` on a fixed clock, ``lease.LEAD`` early (one lease id per request: the JSON gateway's ``lease/keepalive``), each on its
  own keep-alive HTTP connection, with ``etcdv3.Lease._run``'s deadline and loss rules.
* **Joins and rank reads**: ``workers`` threads run each node's requests: its join
  ``joins/<r>/<id>`` (``{"addr", "port", "reg"}`` and ``prev`` = its last ``[seq, rank, token]``, ``seen``,
  on its lease; the re-join marker when its workers stopped while no newer round was open),
  then, once the record of ``r`` is closed, its rank key ``ranks/<r>/<nonce>/<id>`` (one read:
  missing means left out, join the next round).
* **One rounds watch per process** (a real ``Watcher`` on ``rounds/``) instead of one per
  node; the nodes read their rounds view from it. The per-node watch of the leader's key is
  left out: a light node never leads (the bench registers its real handlers first, so one of
  them leads and closes every round). ``fanout_bytes`` counts what the per-node rounds watches
  would have received beyond the shared one (its bytes x the other nodes it serves), and
  ``rereads`` its full re-reads once per node it serves.
* **Workers**: one ticker per process counts each running node's steps every ``step_s`` and
  stops it when its rounds view shows a newer round (``pending_change``'s rule: the marker's
  ``gone`` list, or the round record gone, means lost steps), then the node joins again.

It reports to the bench queue what ``rdzv_sim._participant`` reports (``call``, ``ret``,
``end``, ``registered``, ``error``), so the bench reads both kinds of participants alike.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any

from petctl_agent.rendezvous.lease import LEAD

#: node states
WAIT, REG, STRAG, IDLE, JOINING, RUN, GONE = "wait", "reg", "strag", "idle", "joining", "run", "gone"


class Node:
    __slots__ = (
        "idx", "id", "spec", "state", "busy", "retry_at", "lease", "ttl", "deadline", "next_ka",
        "reg", "epoch", "target", "join_epoch", "round", "rec", "last_rank", "steps", "since_ckpt",
        "prev_round", "prev_rec",
    )  # fmt: skip

    def __init__(self, spec: Any) -> None:
        self.idx, self.spec = spec.idx, spec
        self.id = f"sim{spec.idx:05d}"
        self.state = WAIT
        self.busy = False  # a request of this node is queued or in flight
        self.retry_at = 0.0
        self.lease, self.ttl, self.deadline, self.next_ka = 0, 0, 0.0, 0.0
        self.reg = 0  # create_revision of nodes/<id>
        self.epoch = 0  # registrations: a join made under an older one is void (its lease is gone)
        self.target: int | None = None
        self.join_epoch = -1
        self.round: int | None = None
        self.rec: dict[str, Any] | None = None
        self.last_rank: tuple[int, int, str] | None = None
        self.steps = self.since_ckpt = 0
        self.prev_round: int | None = None
        self.prev_rec: dict[str, Any] | None = None


class _ViewOwner:
    """What ``watcher.Watcher`` needs of its owner (``watcher.Owner``)."""

    def __init__(self, etcd: Any) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._stopping = False
        self._etcd = etcd
        self._version = 0
        self.token: str | None = None
        self.token_changed = False

    def _bump(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def _client_error(self, e: BaseException) -> None:
        pass

    def _check_token(self, token: str | None) -> bool:
        # the real handlers create the token; a change (a replaced etcd) is not handled here
        if token is not None and self.token is not None and token != self.token:
            self.token_changed = True
        self.token = token or self.token
        return True


def make_config(conf: dict[str, Any]) -> Any:
    """The handler's ``Config`` from ``conf``, keeping only the keys this handler knows (the
    simulation's real handlers and the light nodes read the same configuration)."""
    import inspect

    from petctl_agent.rendezvous import Config

    known = set(inspect.signature(Config).parameters)
    return Config(**{k: v for k, v in conf.items() if k in known})


class LightPool:
    """The light nodes of one process (``specs``), reporting to ``plan.q``; ``io`` counts."""

    def __init__(
        self, plan: Any, specs: list[Any], io: Any, keepalive_threads: int = 4, workers: int = 8
    ) -> None:
        from petctl_agent.rendezvous import etcd_transport
        from petctl_agent.rendezvous import etcdv3 as v3
        from petctl_agent.rendezvous.config import DEFAULT_PREFIX
        from petctl_agent.rendezvous.layout import Keys
        from petctl_agent.rendezvous.watcher import Watcher

        self.v3 = v3
        self.plan, self.io = plan, io
        self.cfg = make_config(plan.conf)
        self.keys = Keys(DEFAULT_PREFIX, plan.run_id)
        self.addr = "127.0.0.1"
        self.etcd = v3.Client(plan.endpoint, timeout=self.cfg.request_timeout)
        self.watch_stats = etcd_transport.Stats()
        self.snap_stats = etcd_transport.Stats()
        self.snap = v3.Client(plan.endpoint, timeout=self.cfg.request_timeout, stats=self.snap_stats)
        self.owner = _ViewOwner(
            v3.Client(plan.endpoint, timeout=self.cfg.request_timeout, stats=self.watch_stats)
        )
        self.nodes = [Node(s) for s in specs]
        self.lock = threading.Lock()
        self.tasks: queue.Queue[Any] = queue.Queue()
        self.ka_threads = max(1, keepalive_threads)
        self.n_workers = max(1, workers)
        self.rounds = Watcher(self.owner, self.keys.rounds, True, self.cfg.watch_timeout)

    # ---- threads ----
    def start(self) -> None:
        self.rounds.start()
        for i in range(self.ka_threads):
            mine = self.nodes[i :: self.ka_threads]
            threading.Thread(target=self._keepalives, args=(mine,), name=f"light-ka{i}", daemon=True).start()
        for i in range(self.n_workers):
            threading.Thread(target=self._work, name=f"light-w{i}", daemon=True).start()
        threading.Thread(target=self._drive, name="light-drive", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, n = self.tasks.get()
            try:
                fn(n)
            except self.v3.EtcdError as e:
                with self.lock:
                    n.busy = False
                    n.retry_at = time.monotonic() + 0.2
                self.io.add("task_errors")
                if isinstance(e, self.v3.LeaseNotFound):  # the lease ended under the request: register again
                    self._lost(n)
            except Exception as e:  # noqa: BLE001 - reported, the bench decides
                with self.lock:
                    n.busy = False
                    n.state = GONE
                if not self.plan.stop.is_set():
                    self.plan.q.put(("error", n.idx, time.monotonic(), f"{type(e).__name__}: {e}"))

    def _submit(self, fn: Any, n: Node) -> None:
        n.busy = True
        self.tasks.put((fn, n))

    # ---- membership ----
    def _register(self, n: Node) -> None:
        lid, ttl = self.etcd.grant(self.cfg.ttl)
        value = json.dumps({"addr": self.addr, "pid": os.getpid(), "lease": lid, "ttl": ttl})
        sent = time.monotonic()
        r = self.etcd.put(self.keys.node(n.id), value, lease=lid, prev_kv=True)
        created = r.prev.create_revision if r.prev is not None else r.revision
        # the read of nodes/ a real node makes once per registration (Membership._snapshot): the
        # handler's own helper, with the head of the newest record this process has seen
        from petctl_agent.rendezvous.layout import head, latest_closed
        from petctl_agent.rendezvous.membership import read_membership

        with self.owner._cond:
            base = head(latest_closed(self._view()[0])[1])
        read_membership(self.snap, self.keys, base)
        with self.lock:
            n.lease, n.ttl, n.deadline = lid, ttl, sent + ttl
            n.next_ka = time.monotonic() + self.cfg.refresh * (1.0 - LEAD)  # the product's first (lease.py)
            n.reg, n.epoch = created, n.epoch + 1
            first = n.state == REG
            if first:
                n.state = STRAG if n.spec.straggler else IDLE
            n.busy = False  # last: the driver reads a node only when it is not busy
        if first and n.spec.straggler:
            self.plan.q.put(("registered", n.idx, time.monotonic()))
        self._poke()

    def _lost(self, n: Node) -> None:
        """The lease ended: register again (the handler's keeper), unless the node is gone."""
        self.io.add("leases_lost")
        with self.lock:
            if n.state == GONE or not n.lease:
                return
            n.lease = 0
            n.retry_at = 0.0
        self._poke()

    def _keepalives(self, mine: list[Node]) -> None:
        v3 = self.v3
        refresh = self.cfg.refresh
        period = refresh * (1.0 - LEAD)
        while not self.plan.stop.is_set():
            now = time.monotonic()
            nxt = now + 0.1
            for n in mine:
                if not n.lease or n.state == GONE:
                    continue
                if n.next_ka <= now:
                    late = now - n.next_ka
                    if late > refresh:
                        self.io.add("ka_late")
                    if late > refresh * LEAD:  # past the product's margin: etcd may hear a gap > refresh
                        self.io.add("ka_behind")
                    lid = n.lease
                    sent = time.monotonic()
                    budget = max(0.1, min(self.cfg.request_timeout, n.deadline - sent))
                    try:
                        ttl = self.etcd.keepalive_once(lid, timeout=budget)
                    except v3.LeaseNotFound:
                        if n.lease == lid:
                            self._lost(n)
                        continue
                    except v3.EtcdError:
                        if time.monotonic() >= n.deadline and n.lease == lid:
                            self._lost(n)
                            continue
                    else:
                        if n.lease == lid:
                            n.deadline = sent + ttl
                    # the product's schedule (lease.Lease._run): a fixed clock, LEAD early
                    n.next_ka += period
                    if n.next_ka <= sent:
                        n.next_ka = sent + period
                    now = time.monotonic()
                nxt = min(nxt, n.next_ka)
            time.sleep(max(0.005, nxt - time.monotonic()))

    # ---- joining ----
    def _join(self, n: Node, target: int, latest: int, rounds: dict[int, Any]) -> None:
        from petctl_agent.rendezvous import etcd_ops
        from petctl_agent.rendezvous.joining import _free_port

        value: dict[str, Any] = {"addr": self.addr, "port": _free_port(self.addr), "reg": n.reg}
        if n.last_rank is not None:
            value["seen"] = n.last_rank[0]
            value["prev"] = list(n.last_rank)
        self.etcd.put(self.keys.join(target, n.id), json.dumps(value), lease=n.lease)
        if (
            n.prev_round is not None
            and n.prev_round == latest
            and n.prev_rec is not None
            and target not in rounds
        ):
            marker = {"state": "open", "by": n.id, "waiting": [], "gone": [], "rejoin": True}
            key = self.keys.round(target)
            self.etcd.txn(
                [etcd_ops.compare(key, "create", "==", 0)], [etcd_ops.put_op(key, json.dumps(marker))]
            )

    def _join_task(self, n: Node) -> None:
        with self.lock:
            target, epoch = n.target, n.epoch
            with self.owner._cond:
                rounds = self._view()[0]
        from petctl_agent.rendezvous.layout import latest_closed

        assert target is not None
        self._join(n, target, latest_closed(rounds)[0], rounds)
        with self.lock:
            if n.target == target:
                n.join_epoch = epoch
            n.busy = False
        self._poke()

    def _rank_task(self, n: Node) -> None:
        from petctl_agent.rendezvous.record import read_rank

        with self.lock:
            target, rec = n.target, n.rec
        assert target is not None and rec is not None
        rank = read_rank(self.etcd, self.keys, target, rec, n.id)
        t = time.monotonic()
        with self.lock:  # busy goes last: the driver reads a node only when it is not busy
            if n.target != target or n.state != JOINING:
                n.busy = False
                return
            if rank is None:  # closed without us: join the next round
                n.state, n.rec, n.target = IDLE, None, None
                n.busy = False
                return
            # [seq, rank, boot token] as the handler's joins carry it (light nodes never see etcd
            # replaced: no token), and the newest seq seen closed
            seq = int(rec.get("seq", target))
            n.state, n.round, n.last_rank, n.target = RUN, target, (seq, rank, ""), None
            n.steps = 0
            n.prev_round, n.prev_rec = None, None
            n.busy = False
        self.plan.q.put(("ret", n.idx, t, target, rank, int(rec["n"])))
        self._poke()

    # ---- the driver: arrivals, joins, rank reads, the workers' steps ----
    def _view(self) -> tuple[dict[int, Any], bool]:
        from petctl_agent.rendezvous.layout import rounds_view

        return rounds_view(self.rounds.items)

    def _poke(self) -> None:
        with self.owner._cond:
            self.owner._bump()

    def _drive(self) -> None:
        from petctl_agent.rendezvous.layout import latest_closed

        plan = self.plan
        next_step = time.monotonic() + plan.step_s
        seen = -1
        while not plan.stop.is_set():
            with self.owner._cond:
                if self.owner._version == seen:
                    self.owner._cond.wait(timeout=0.05)
                seen = self.owner._version
                rounds, closed = self._view()
                synced = self.rounds.current
                connected = self.rounds.connected
            latest, _ = latest_closed(rounds)
            now = time.monotonic()
            step = now >= next_step
            if step:
                next_step = now + plan.step_s
            starts = [plan.t0.value, *plan.phases[1:]]
            released = plan.release.is_set()
            pending: dict[int, tuple[bool, str] | None] = {}
            for n in self.nodes:
                if n.busy or n.state == GONE or now < n.retry_at:
                    continue
                try:
                    self._advance(n, now, step, rounds, latest, synced, connected, pending, starts, released)
                except Exception as e:  # noqa: BLE001 - a defect of this simulation: reported, never silent
                    n.state = GONE
                    plan.q.put(("error", n.idx, now, f"light node: {type(e).__name__}: {e}"))
        self._shutdown()

    def _advance(
        self,
        n: Node,
        now: float,
        step: bool,
        rounds: dict[int, Any],
        latest: int,
        synced: bool,
        connected: bool,
        pending: dict[int, tuple[bool, str] | None],
        starts: list[float],
        released: bool,
    ) -> None:
        """One look at node ``n`` by the driver: arrive, register again, join, read its rank, or
        count a step of its workers (and stop them when a newer round shows)."""
        plan = self.plan
        flag = plan.crash[n.idx]
        if flag and n.state != WAIT:
            self._crash_or_leave(n, flag)
            return
        st = n.state
        if st == WAIT:
            base = starts[n.spec.phase]  # 0: its phase has not begun
            if not base or now < base + n.spec.arrive:
                return
            n.state = REG
            if not n.spec.straggler:
                plan.q.put(("call", n.idx, now))
            self._submit(self._register, n)
            return
        if not n.lease:  # lost: register again (a join under the old lease went with it)
            if st == REG:
                self._submit(self._register, n)
            else:
                self._submit(self._reregister, n)
            return
        if st == STRAG:
            if released:
                n.state = IDLE
                plan.q.put(("call", n.idx, now))
            return
        if st == RUN:
            if not step:
                return
            assert n.round is not None
            if n.round not in pending:
                pending[n.round] = _pending(n.round, rounds, connected)
            n.steps += 1
            n.since_ckpt += 1
            if n.since_ckpt >= plan.ckpt_steps:
                n.since_ckpt = 0
            ch = pending[n.round]
            if ch is None:
                return
            gone, why = ch
            lost = n.since_ckpt if gone else 0
            n.since_ckpt = 0
            plan.q.put(("end", n.idx, now, n.round, n.steps, lost, why))
            plan.q.put(("call", n.idx, now))
            n.prev_round, n.prev_rec = n.round, n.rec
            n.state, n.round, n.rec, n.target = IDLE, None, None, None
            st = IDLE
        if st == JOINING and synced:
            assert n.target is not None
            got = rounds.get(n.target)
            if got is not None and got[0].get("state") == "closed" and n.join_epoch == n.epoch:
                n.rec = got[0]
                self._submit(self._rank_task, n)
                return
            if latest >= n.target or n.join_epoch != n.epoch:
                n.state, n.target = IDLE, None
                st = IDLE
        if st == IDLE and synced:
            n.state, n.target = JOINING, latest + 1
            self._submit(self._join_task, n)

    def _reregister(self, n: Node) -> None:
        self._register(n)

    def _crash_or_leave(self, n: Node, flag: int) -> None:
        now = time.monotonic()
        lid = n.lease
        n.state = GONE
        if flag == 2:
            if lid:
                try:
                    self.etcd.revoke(lid)
                except self.v3.EtcdError:
                    pass
            self.plan.q.put(("end", n.idx, now, n.round, n.steps, 0, "left"))
        else:  # a hard loss: no keepalive, its key left to expire
            self.plan.q.put(("end", n.idx, now, n.round, n.steps, n.since_ckpt, "crashed"))

    def _shutdown(self) -> None:
        """The job is over: every node leaves (its lease revoked), bounded by a few seconds."""
        leases = [n.lease for n in self.nodes if n.lease and n.state != GONE]
        for n in self.nodes:
            n.state = GONE
        done = threading.Event()

        def revoke(part: list[int]) -> None:
            for lid in part:
                if done.is_set():
                    return
                try:
                    self.etcd.revoke(lid, timeout=1.0)
                except self.v3.EtcdError:
                    pass

        ts = [
            threading.Thread(target=revoke, args=(leases[i :: self.n_workers],), daemon=True)
            for i in range(self.n_workers)
        ]
        for t in ts:
            t.start()
        deadline = time.monotonic() + 8.0
        for t in ts:
            t.join(max(0.0, deadline - time.monotonic()))
        done.set()
        self.rounds.stop()

    # ---- counters ----
    def served(self) -> int:
        """Nodes of this process that arrived and are not gone (what its shared watch serves)."""
        return sum(1 for n in self.nodes if n.state not in (WAIT, GONE))

    def fanout(self) -> tuple[float, float]:
        """(bytes the per-node rounds watches would have received beyond the shared one,
        full re-reads counted once per node)."""
        served = sum(1 for n in self.nodes if n.state != WAIT)
        with self.watch_stats._lock:  # noqa: SLF001
            got = self.watch_stats.bytes_in
        return float(got * max(0, served - 1)), float(self.rounds.rereads * served)


def _pending(rnd: int, rounds: dict[int, Any], connected: bool) -> tuple[bool, str] | None:
    """``PetctlRendezvousHandler.pending_change``'s answer for a node running round ``rnd``:
    None, or (a participant is gone, why)."""
    newer = sorted(r for r in rounds if r > rnd)
    if newer:
        v = rounds[newer[0]][0]
        reason = "new round opened" if v.get("state") == "open" else "a newer round closed without us"
        if v.get("rejoin"):
            reason = "a participant re-joined"
        return bool(v.get("gone")), reason
    if rnd not in rounds and connected:
        return True, "round record gone"
    return None
