"""Simulated rendezvous participants for ``bench_rdzv_scale.py``: the real handler, no torch.

A *participant* is one ``PetctlRendezvousHandler`` (whatever ``petctl_agent.rendezvous``
exports: the bench measures the handler of the checkout it runs in) driven from a thread the
way torch's elastic agent drives it: ``next_rendezvous``, then a *worker* that is a sleep loop
counting steps and, at each step, asks ``num_nodes_waiting`` (torch's monitor loop); when that
is > 0 the worker stops and the participant calls ``next_rendezvous`` again. ``shutdown`` (or
``leave``) at the end. A *hard loss* is a participant whose handler stops without leaving
(``_crash``: no keepalive, key left to expire) and whose worker fails.

Steps and losses, the model: a round that ends on a pending change whose ``gone`` list is empty
is a coordinated stop (the workers checkpoint first: 0 steps lost); one that ends with a
participant gone (or the round record gone) is not, and loses the steps since the last
periodic checkpoint (every ``ckpt_steps`` steps).

Participants live as threads in forked *pool* processes (``per_proc`` each) so that N=1,000
fits in a few processes of one machine; a participant that the bench pauses (SIGSTOP) gets a
process of its own. Every process counts, for all its sockets, the application bytes sent and
received (``socket.socket.send/sendall/recv/recv_into`` wrapped: HTTP headers and bodies; no
TCP/IP or TLS framing) and every HTTP request (``http.client.HTTPConnection.putrequest``, which
urllib3 and ``http.client`` users both go through), by kind from its path: etcd v2
``/v2/keys`` (a GET with ``wait=true`` is a watch, else a read; PUT/POST a write; DELETE a
delete) and etcd v3 ``/v3/...`` (``kv/range`` read, ``watch``, ``lease/keepalive``,
``lease/timetolive`` a lease read, the other calls writes), and the events its watches deliver
(``etcd_watch.Watch.get`` wrapped). The counts go to shared memory every 0.1 s; the bench reads
them at any moment.

Arrivals come in phases: phase 0 counts ``Spec.arrive`` from the scenario's start, phase k >= 1
from the bench's ``Sim.go(k)``. ``Sim.workers_fail(at)`` makes every real participant's workers
fail at ``at`` (a peer lost: its agent calls the handler's ``workers_failed``, as the elastic
agent does, and its workers make no step until the next round).

*Light nodes* (``Sim(light=...)``, the bench's ``--light-nodes``; ``bench/rdzv_light.py``)
follow the same protocol with the rendezvous package's own key and value helpers, many to a
process, sharing keepalive threads and one rounds watch per process: what lets N = 1,000 run
on 2 cores. The real handlers' processes start first and register before any light node
arrives, so one of them leads.

Every participant reports to the bench (a queue): ``call`` (next_rendezvous called), ``ret``
(returned: round, rank, world size), ``end`` (its worker stopped: steps of the round, steps
lost, why), ``registered`` (a straggler registered without joining), ``error``.
"""

from __future__ import annotations

import http.client
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "agent"))

#: per-process I/O counters, in this order, in shared memory (one row per process)
IO_KINDS = (
    "requests",
    "bytes_out",
    "bytes_in",
    "read",
    "watch",
    "write",
    "keepalive",
    "delete",
    "other",
    "v2",
    "v3",
    # gauges (set, not added): full re-reads of the rounds watches (a light process's shared
    # watch counts once per node it serves), and the bytes the light nodes' per-node rounds
    # watches would have received beyond their process's shared one (rdzv_light.py)
    "rereads",
    "fanout_bytes",
    # light nodes only: keepalives sent more than ``refresh`` late, and more than the product's
    # margin (``lease.LEAD`` of it: etcd may then hear a gap over ``refresh``), leases lost
    # (registered again), requests that failed (retried)
    "ka_late",
    "ka_behind",
    "leases_lost",
    "task_errors",
    # light nodes: the JSON bytes of their reads of nodes/ (one per registration, as a real node
    # makes: Membership._snapshot), part of bytes_in
    "snapshot_bytes",
    # v3 ``lease/timetolive`` requests (a leader's lease reads; not counted as "write")
    "lease_read",
    # events handed out by the watches of the process (``etcd_watch.Watch.get``): every watch of
    # a real handler; a light process's one shared rounds watch
    "watch_events",
    # light nodes: the shared rounds watch's events once per node it serves (what per-node
    # rounds watches would have delivered)
    "watch_events_equiv",
    # lease reads of a lease this process read less than REREAD_S before; lease reads that
    # found 0-4 s left (with the default TTL of 6 s: renewed more than 1 s before the read)
    "lease_reread",
    "lease_read_low",
)

#: a lease read again within this (s) counts as a re-read (a failure window lasts TTL + 1.5 s)
REREAD_S = 8.0


@dataclass
class Spec:
    """One participant: its index, when it arrives (s after the scenario's start), its role."""

    idx: int
    arrive: float = 0.0
    straggler: bool = False  # registers at arrival, joins only when the bench releases stragglers
    phase: int = 0  # 0: ``arrive`` counts from the scenario's start; k >= 1: from the bench's ``go(k)``


# ---- I/O counting (in each participant process) ------------------------------------------------
class _Io:
    def __init__(self, row: Any, base: int) -> None:
        self.lock = threading.Lock()
        self.c = dict.fromkeys(IO_KINDS, 0)
        self.row, self.base = row, base

    def add(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.c[kind] += n

    def set(self, kind: str, v: float) -> None:
        with self.lock:
            self.c[kind] = v

    def flush(self) -> None:
        with self.lock:
            vals = [self.c[k] for k in IO_KINDS]
        for i, v in enumerate(vals):
            self.row[self.base + i] = float(v)


#: set while this thread sends a txn of range ops only (a read, not a write): ``count_handler_io``
_READ_TXN = threading.local()


def _kind(method: str, url: str) -> str:
    path = url.split("?", 1)[0]
    if path.startswith("/v2/keys"):
        if method == "GET":
            return "watch" if "wait=true" in url else "read"
        return "delete" if method == "DELETE" else "write"
    if path.startswith("/v3"):
        tail = path.split("/v3", 1)[1].strip("/")
        if tail == "kv/range" or (tail == "kv/txn" and getattr(_READ_TXN, "on", False)):
            return "read"
        if tail == "watch":
            return "watch"
        if tail == "lease/keepalive":
            return "keepalive"
        if tail == "lease/timetolive":
            return "lease_read"
        if tail == "kv/deleterange":
            return "delete"
        return "write"
    return "other"


def install_io_counters(io: _Io) -> None:
    """Wrap the socket and http.client calls of this process so that they count into ``io``."""
    S = socket.socket
    o_send, o_sendall, o_recv, o_recv_into = S.send, S.sendall, S.recv, S.recv_into

    def send(self: Any, data: Any, *a: Any) -> int:
        n = o_send(self, data, *a)
        io.add("bytes_out", n)
        return n

    def sendall(self: Any, data: Any, *a: Any) -> None:
        o_sendall(self, data, *a)
        io.add("bytes_out", memoryview(data).nbytes)

    def recv(self: Any, *a: Any) -> bytes:
        d = o_recv(self, *a)
        io.add("bytes_in", len(d))
        return d

    def recv_into(self: Any, buf: Any, *a: Any) -> int:
        n = o_recv_into(self, buf, *a)
        io.add("bytes_in", n)
        return n

    S.send, S.sendall, S.recv, S.recv_into = send, sendall, recv, recv_into  # type: ignore[method-assign]
    o_put = http.client.HTTPConnection.putrequest

    def putrequest(self: Any, method: str, url: str, *a: Any, **kw: Any) -> None:
        io.add("requests")
        io.add(_kind(method, url))
        if url.startswith(("/v2/", "/v3/")):
            io.add(url[1:3])
        return o_put(self, method, url, *a, **kw)

    http.client.HTTPConnection.putrequest = putrequest  # type: ignore[method-assign]


def count_handler_io(io: _Io, served: Any = None) -> None:
    """Wrap, in this process, ``etcd_watch.Watch.get`` (what hands a watch's events to its owner)
    so that every event delivered counts into ``io`` ("watch_events"; ``served()``, if given, is
    how many nodes each event stands for: "watch_events_equiv", a light process's shared watch),
    ``etcdv3.Client.txn`` so that a txn of range ops only (``membership.read_membership``)
    counts as a read, not a write, and ``etcdv3.Client.time_to_live`` to count re-reads of a
    lease and reads that found 0-4 s left (TTL 6: renewed more than 1 s before)."""
    from petctl_agent.rendezvous import etcd_watch, etcdv3

    o_txn = etcdv3.Client.txn

    def txn(self: Any, compares: Any, success: Any = (), failure: Any = (), *a: Any, **kw: Any) -> Any:
        ops = [*success, *failure]
        _READ_TXN.on = bool(ops) and all(set(op) == {"request_range"} for op in ops)
        try:
            return o_txn(self, compares, success, failure, *a, **kw)
        finally:
            _READ_TXN.on = False

    etcdv3.Client.txn = txn  # type: ignore[method-assign]
    o_ttl = etcdv3.Client.time_to_live
    last_read: dict[int, float] = {}

    def time_to_live(self: Any, lease: int, *a: Any, **kw: Any) -> Any:
        now = time.monotonic()
        if now - last_read.get(lease, -1e9) < REREAD_S:
            io.add("lease_reread")
        last_read[lease] = now
        got = o_ttl(self, lease, *a, **kw)
        if 0 <= got[0] <= 4:
            io.add("lease_read_low")
        return got

    etcdv3.Client.time_to_live = time_to_live  # type: ignore[method-assign]
    o_get = etcd_watch.Watch.get

    def get(self: Any, timeout: float) -> Any:
        evs = o_get(self, timeout)
        if evs:
            io.add("watch_events", len(evs))
            if served is not None:
                io.add("watch_events_equiv", len(evs) * served())
        return evs

    etcd_watch.Watch.get = get  # type: ignore[method-assign]


# ---- the handler ---------------------------------------------------------------------------------
def register_only(h: Any) -> None:
    """Register ``h`` (membership key and its keepalive running) without joining a round: a node
    whose agent is stuck (an EFS read in D-state, a slow start) while its keepalive runs on.
    A public ``register`` if the handler has one, else the internal start next_rendezvous uses."""
    for name in ("register", "_start"):
        fn = getattr(h, name, None)
        if callable(fn):
            fn()
            return
    raise RuntimeError("the handler has neither register() nor _start(): cannot make a straggler")


@dataclass
class Plan:
    """What every participant process shares (fork: inherited, not pickled)."""

    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    conf: dict[str, Any]
    expected: Any  # mp.Value('i'): the desired capacity hint (0 = none)
    t0: Any  # mp.Value('d'): time.monotonic() of the scenario's start (CLOCK_MONOTONIC: system-wide)
    phases: Any  # mp.Array('d'): phases[k] = when phase-k participants start arriving (0: not yet)
    step_s: float
    ckpt_steps: int
    stop: Any  # mp.Event: leave
    release: Any  # mp.Event: stragglers may join
    crash: Any  # mp.Array('b'): crash[idx] = 1 -> hard loss of participant idx; 2 -> it leaves (drain)
    fail_at: Any  # mp.Value('d'): the real participants' workers fail at this time (0: never)
    q: Any  # mp.Queue: reports
    io: Any  # mp.RawArray('d', procs * len(IO_KINDS))


def phase_start(plan: Plan, phase: int) -> float:
    """When participants of ``phase`` count their ``arrive`` from (0: their phase has not begun)."""
    return plan.phases[phase] if phase else plan.t0.value


def _participant(plan: Plan, spec: Spec, h: Any) -> None:
    q = plan.q
    while spec.phase and not plan.phases[spec.phase]:
        if plan.stop.wait(0.1):
            return
    wait = phase_start(plan, spec.phase) + spec.arrive - time.monotonic()
    if wait > 0 and plan.stop.wait(wait):
        return
    try:
        if spec.straggler:
            register_only(h)
            q.put(("registered", spec.idx, time.monotonic()))
            while not plan.release.wait(0.2):
                if plan.stop.is_set():
                    return
        steps_since_ckpt = 0
        while not plan.stop.is_set():
            q.put(("call", spec.idx, time.monotonic()))
            info = h.next_rendezvous()
            t_ret = time.monotonic()
            rnd = getattr(h, "round", None)
            q.put(("ret", spec.idx, time.monotonic(), rnd, info.rank, info.world_size))
            steps, why = 0, "stop"
            failed = False  # this round's workers failed (a peer's hard loss)
            while True:
                if plan.stop.wait(plan.step_s):
                    break
                fail_at = plan.fail_at.value
                if not failed and t_ret < fail_at <= time.monotonic():
                    failed = True  # our collectives failed: the agent tells the handler at once
                    h.workers_failed()
                    q.put(("failed", spec.idx, time.monotonic(), rnd))
                if plan.crash[spec.idx] == 2:
                    h.leave()
                    q.put(("end", spec.idx, time.monotonic(), rnd, steps, 0, "left"))
                    return
                if plan.crash[spec.idx]:
                    h._crash()  # noqa: SLF001 - a SIGKILLed node: no keepalive, key left to expire
                    q.put(("end", spec.idx, time.monotonic(), rnd, steps, steps_since_ckpt, "crashed"))
                    return
                if not failed:  # failed workers make no steps while the agent waits for the round
                    steps += 1
                    steps_since_ckpt += 1
                if steps_since_ckpt >= plan.ckpt_steps:
                    steps_since_ckpt = 0
                if h.num_nodes_waiting() > 0:
                    pc = getattr(h, "pending_change", None)
                    ch = pc() if callable(pc) else None
                    gone = bool(ch and (ch.get("gone") or ch.get("reason") == "round record gone"))
                    why = (ch or {}).get("reason", "nodes waiting")
                    lost = steps_since_ckpt if gone else 0
                    steps_since_ckpt = 0
                    q.put(("end", spec.idx, time.monotonic(), rnd, steps, lost, why))
                    break
            if why == "stop":
                return
    except Exception as e:  # noqa: BLE001 - reported, the bench decides
        if not plan.stop.is_set():
            q.put(("error", spec.idx, time.monotonic(), f"{type(e).__name__}: {e}"))


class KeepaliveHub:
    """Light participants (``PETCTL_SIM_LIGHT=1``, the bench's ``--light``): one thread per
    process renews every membership lease of its participants, each every its own ``interval``
    as its own thread would (the same request, the same deadline and loss rules as
    ``lease.Lease._run``), instead of one thread per lease. The handler's code is unchanged;
    this only spares a 2-core machine a thousand keepalive threads."""

    def __init__(self) -> None:
        self.leases: list[Any] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="sim-keepalives", daemon=True).start()

    def install(self) -> None:
        from petctl_agent.rendezvous import etcdv3 as v3

        hub = self

        def start(lease: Any) -> Any:
            lease._next = time.monotonic() + lease.interval  # noqa: SLF001
            with hub.lock:
                hub.leases.append(lease)
            return lease

        v3.Lease.start = start  # type: ignore[method-assign]

    def _once(self, lease: Any) -> bool:
        """One keepalive; False when the lease is lost (no more renewals)."""
        from petctl_agent.rendezvous import etcdv3 as v3

        sent = time.monotonic()
        budget = max(0.1, min(lease.client.timeout, lease.deadline - sent))
        try:
            ttl = lease.client.keepalive_once(lease.id, timeout=budget)
        except v3.LeaseNotFound:
            lease._lose()  # noqa: SLF001
            return False
        except v3.ClusterChanged as e:  # a new etcd: the handler hears it (Lease._run's rule)
            if lease.on_error is not None:
                lease.on_error(e)
            lease._lose()  # noqa: SLF001
            return False
        except v3.EtcdError:
            if time.monotonic() >= lease.deadline:
                lease._lose()  # noqa: SLF001
                return False
            return True
        lease.deadline = sent + ttl
        lease.keepalives += 1
        return True

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self.lock:
                self.leases = [x for x in self.leases if not x._stop.is_set() and not x.lost.is_set()]  # noqa: SLF001
                due = [x for x in self.leases if x._next <= now]  # noqa: SLF001
            for x in due:
                x._next = time.monotonic() + x.interval  # noqa: SLF001
                if not x._stop.is_set() and not self._once(x):  # noqa: SLF001
                    x._stop.set()  # noqa: SLF001
            time.sleep(0.02)


def _process(plan: Plan, specs: list[Spec], row: int) -> None:
    """One participant process: its participants as threads; leaves when ``plan.stop`` is set."""
    logging.basicConfig(level=logging.WARNING)
    for name in ("etcd.client", "petctl_agent.rendezvous", "urllib3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    io = _Io(plan.io, row * len(IO_KINDS))
    install_io_counters(io)
    count_handler_io(io)
    if os.environ.get("PETCTL_SIM_LIGHT") == "1":
        KeepaliveHub().install()
    from rdzv_light import make_config

    from petctl_agent.rendezvous import PetctlRendezvousHandler

    cfg = make_config(plan.conf)

    def expected() -> int | None:
        return plan.expected.value or None

    hs = [
        PetctlRendezvousHandler(
            plan.run_id,
            plan.endpoint,
            plan.min_nodes,
            plan.max_nodes,
            "127.0.0.1",
            config=cfg,
            expected_nodes=expected,
            node_id=f"sim{s.idx:05d}",
        )  # fmt: skip
        for s in specs
    ]
    ts = [threading.Thread(target=_participant, args=(plan, s, h), daemon=True) for s, h in zip(specs, hs)]
    for t in ts:
        t.start()
    while not plan.stop.wait(0.1):
        io.set("rereads", sum(h.rereads for h in hs))
        io.flush()
    io.flush()
    for h in hs:  # the job is over: shutdown (the first closes the rendezvous; all leave)
        try:
            h.shutdown()
        except Exception:  # noqa: BLE001, S110 - a crashed or never-started handler
            pass
    for t in ts:
        t.join(5)
    io.flush()
    os._exit(0)  # handler threads (watches) may still sit in a socket read


def _light_process(plan: Plan, specs: list[Spec], row: int, ka_threads: int, workers: int) -> None:
    """One process of light nodes (rdzv_light.LightPool); leaves when ``plan.stop`` is set."""
    logging.basicConfig(level=logging.WARNING)
    for name in ("petctl_agent.rendezvous",):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    io = _Io(plan.io, row * len(IO_KINDS))
    install_io_counters(io)
    from rdzv_light import LightPool

    pool = LightPool(plan, specs, io, keepalive_threads=ka_threads, workers=workers)
    count_handler_io(io, served=pool.served)
    pool.start()
    while not plan.stop.wait(0.1):
        fan, rereads = pool.fanout()
        io.set("fanout_bytes", fan)
        io.set("rereads", rereads)
        io.set("snapshot_bytes", pool.snap_stats.bytes_in)
        io.flush()
    # the driver sees the stop and every node leaves (its lease revoked, bounded)
    deadline = time.monotonic() + 10
    while pool.rounds.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    fan, rereads = pool.fanout()
    io.set("fanout_bytes", fan)
    io.flush()
    os._exit(0)


class Sim:
    """N participants in forked processes, and what they reported (``events``).

    ``light``: the indices served by light nodes (rdzv_light.py), ``light_per_proc`` to a
    process; the others are real handlers. The bench registers the real ones first so that one
    of them leads (a light node never leads)."""

    def __init__(
        self,
        endpoint: str,
        specs: list[Spec],
        *,
        min_nodes: int,
        max_nodes: int,
        expected: int = 0,
        conf: dict[str, Any] | None = None,
        per_proc: int = 64,
        solo: tuple[int, ...] = (),
        step_s: float = 0.2,
        ckpt_steps: int = 100,
        run_id: str = "sim",
        light: set[int] | frozenset[int] = frozenset(),
        light_per_proc: int = 250,
        light_ka_threads: int = 4,
        light_workers: int = 8,
    ) -> None:
        ctx = mp.get_context("fork")
        self.ctx = ctx
        self.specs = {s.idx: s for s in specs}
        groups: list[list[Spec]] = [[s] for s in specs if s.idx in solo]
        rest = [s for s in specs if s.idx not in solo and s.idx not in light]
        groups += [rest[i : i + per_proc] for i in range(0, len(rest), per_proc)]
        self.n_real_groups = len(groups)
        lights = [s for s in specs if s.idx in light and s.idx not in solo]
        groups += [lights[i : i + light_per_proc] for i in range(0, len(lights), light_per_proc)]
        self.groups = groups
        self.light_opts = (light_ka_threads, light_workers)
        n_idx = max(self.specs) + 1
        self.plan = Plan(
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            conf=dict(conf or {}),
            expected=ctx.Value("i", expected, lock=False),
            t0=ctx.Value("d", 0.0, lock=False),
            phases=ctx.Array("d", 1 + max((s.phase for s in specs), default=0), lock=False),
            step_s=step_s,
            ckpt_steps=ckpt_steps,
            stop=ctx.Event(),
            release=ctx.Event(),
            crash=ctx.Array("b", n_idx, lock=False),
            fail_at=ctx.Value("d", 0.0, lock=False),
            q=ctx.Queue(),
            io=ctx.RawArray("d", len(groups) * len(IO_KINDS)),
        )
        self.procs: list[Any] = []
        self.proc_of: dict[int, Any] = {}
        self.events: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    # -- lifecycle --
    def start(self, at: float | None = None) -> float:
        """Fork the processes; participants arrive at ``at`` (monotonic; default now) + their offset.

        With light nodes, the real handlers' processes start first and the light ones only once
        every real one arriving at offset 0 has registered (its ``nodes/`` key exists), so that
        a real handler leads; the scenario's start (``t0``) is then."""
        import petctl_agent.rendezvous  # noqa: F401 - imported once here, not in every forked process

        self.plan.t0.value = time.monotonic() if at is None else at
        if self.n_real_groups < len(self.groups):
            for row in range(self.n_real_groups):
                self._fork(row)
            first = [
                s.idx for g in self.groups[: self.n_real_groups] for s in g if s.arrive == 0 and s.phase == 0
            ]
            self._wait_registered(first)
            self.plan.t0.value = time.monotonic() if at is None else max(at, time.monotonic())
            for row in range(self.n_real_groups, len(self.groups)):
                self._fork(row)
        else:
            for row in range(len(self.groups)):
                self._fork(row)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self.plan.t0.value

    def _wait_registered(self, idxs: list[int], timeout: float = 120.0) -> None:
        from petctl_agent.rendezvous import etcdv3 as v3
        from petctl_agent.rendezvous.config import DEFAULT_PREFIX
        from petctl_agent.rendezvous.layout import Keys, key_name

        keys = Keys(DEFAULT_PREFIX, self.plan.run_id)
        want = {f"sim{i:05d}" for i in idxs}
        c = v3.Client(self.plan.endpoint, timeout=5.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = {key_name(kv.key) for kv in c.range(keys.nodes, prefix=True, keys_only=True).kvs}
            except v3.EtcdError:
                got = set()
            if want <= got:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the real handlers {sorted(want)} did not register within {timeout:.0f} s")

    def _fork(self, row: int) -> None:
        g = self.groups[row]
        if row < self.n_real_groups:
            p = self.ctx.Process(target=_process, args=(self.plan, g, row), daemon=True)
        else:
            p = self.ctx.Process(
                target=_light_process, args=(self.plan, g, row, *self.light_opts), daemon=True
            )
        p.start()
        self.procs.append(p)
        for s in g:
            self.proc_of[s.idx] = p

    def _read(self) -> None:
        while True:
            try:
                ev = self.plan.q.get(timeout=0.5)
            except Exception:  # noqa: BLE001 - queue.Empty, or the queue closed at the end
                if self.plan.stop.is_set() and not any(p.is_alive() for p in self.procs):
                    return
                continue
            with self._lock:
                self.events.append(ev)

    def stop(self, timeout: float = 20.0) -> None:
        self.plan.stop.set()
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except (ProcessLookupError, TypeError):
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)

    # -- what the bench does to participants --
    def set_expected(self, n: int) -> None:
        self.plan.expected.value = n

    def go(self, phase: int = 1) -> float:
        """Participants of ``phase`` (>= 1) start arriving now (their ``arrive`` counts from here)."""
        self.plan.phases[phase] = time.monotonic()
        return self.plan.phases[phase]

    def workers_fail(self, at: float) -> None:
        """At ``at`` (monotonic) every running real participant's workers fail (a peer lost: their
        collectives fail): each calls its handler's ``workers_failed`` and stops stepping until
        the next round. Light nodes have no such call (they never lead)."""
        self.plan.fail_at.value = at

    def leave(self, idx: int) -> None:
        self.plan.crash[idx] = 2

    def release_stragglers(self) -> None:
        self.plan.release.set()

    def crash(self, idx: int) -> None:
        self.plan.crash[idx] = 1

    def pid_of(self, idx: int) -> int:
        return self.proc_of[idx].pid

    # -- what they reported --
    def snapshot(self) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self.events)

    def io(self, rows: list[int] | None = None) -> dict[str, float]:
        """The I/O counts of every process (``rows``: of those processes only; see ``row_of``)."""
        k = len(IO_KINDS)
        rows = list(range(len(self.groups))) if rows is None else rows
        return {name: sum(self.plan.io[r * k + i] for r in rows) for i, name in enumerate(IO_KINDS)}

    def row_of(self, idx: int) -> int:
        """The process (its row of counters) participant ``idx`` lives in."""
        return next(r for r, g in enumerate(self.groups) if any(s.idx == idx for s in g))

    def api(self) -> str:
        """The etcd API the handler spoke (by its requests): "v2", "v3", "v2+v3" or "none"."""
        io = self.io()
        return "+".join(k for k in ("v2", "v3") if io[k]) or "none"

    def errors(self) -> list[tuple[Any, ...]]:
        return [e for e in self.snapshot() if e[0] == "error"]

    def state(self) -> dict[int, tuple[Any, ...]]:
        """Each participant's latest call/ret/end/registered event."""
        out: dict[int, tuple[Any, ...]] = {}
        for e in self.snapshot():
            if e[0] in ("call", "ret", "end", "registered"):
                out[e[1]] = e
        return out

    def together(self, ids: list[int] | set[int], after: float = float("-inf")) -> tuple[Any, float] | None:
        """(round, the last return time) if every one of ``ids`` now runs in the same round, one they
        returned into after ``after``; else None."""
        st = self.state()
        rets = [st.get(i) for i in ids]
        if not rets or any(e is None or e[0] != "ret" for e in rets):
            return None
        rounds = {e[3] for e in rets}
        worlds = {e[5] for e in rets}
        if len(rounds) != 1 or len(worlds) != 1 or any(e[2] <= after for e in rets):
            return None
        return rounds.pop(), max(e[2] for e in rets)

    def wait_together(
        self, ids: list[int] | set[int], timeout: float, after: float = float("-inf")
    ) -> tuple[Any, float] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.together(ids, after)
            if got is not None:
                return got
            if self.errors():
                return None
            time.sleep(0.05)
        return None
