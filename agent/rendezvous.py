"""petctl's own rendezvous handler on etcd (v2 API, python-etcd): ``--rdzv-backend petctl-etcd``.

Why not torch's ``etcd-v2`` (``DynamicRendezvousHandler`` + ``EtcdRendezvousBackend``): it
keeps the whole rendezvous state in one JSON blob that every node rewrites with
compare-and-swap and *polls* (1 s sleep + 1 s cache), waits a last call (30 s by default)
once MIN is reached, and only counts a node dead after keep-alive x attempts (5 s x 3). A
membership change therefore costs 8-20 s even tuned. Here:

* **Membership**: one key per node, ``<base>/nodes/<id>``, TTL ``ttl`` (2 s) refreshed every
  ``refresh`` (0.5 s) with etcd's silent refresh (``refresh=true``: no watch event). Leaving
  deletes it at once; a dead node's key expires (etcd's expiry sweep adds <= 0.5 s).
* **Rounds**: one key per round, ``<base>/rounds/<r>``. A participant that wants a new round
  (or the leader, on a membership change) creates it as an *open marker*
  (``prevExist=false``); the leader replaces it with the *record* (``prevIndex`` CAS):
  ordered participants, their addresses, master address and port. Every node watches
  ``<base>/rounds``; that is how running nodes learn that a new round is open
  (:meth:`num_nodes_waiting`) and how joining nodes learn that theirs closed.
* **Joins**: ``<base>/joins/<r>/<id>``, one write per node per round, watched only by the
  leader.
* **Leader**: the first *live* node in the order "participants of the last round (in rank
  order), then newcomers by registration index". Normally rank 0 of the last round, so
  rank 0 stays put. The leader alone watches ``<base>/nodes`` (all membership events) and
  the joins; every other node watches only the leader's key (silent while it lives) and
  the rounds directory. So a round costs O(N) etcd requests, never O(N^2): each node
  registers once, refreshes, writes one join, and receives ~3 round events (open, record,
  expiry of the previous record); the leader additionally receives one event per join.
* **Closing**: the leader closes round r as soon as every live registered node has joined
  it, at least ``min_nodes`` did, and no node registered within the last ``settle`` seconds
  (0.5 s; skipped when the ``expected_nodes`` hint is already met). Extra nodes beyond
  ``max_nodes`` wait for the next round. Nodes that are still booting are not registered,
  so they never hold a round open: a node registers when it first calls
  :meth:`next_rendezvous`.
* **Store**: workers host their own TCPStore (``use_agent_store`` is False): rank 0's node
  picks a free port when it joins and the record carries it as ``MASTER_PORT``; no store
  round trip is needed to learn it, so a dead rank 0 can never leave others blocked in
  ``store.get("MASTER_ADDR")``. The agent-side store returned in ``RendezvousInfo`` is torch's
  ``EtcdStore`` under ``<base>/store/<r>`` (only used by torch's exit barrier and by the
  non-identical rank assignment).
* **etcd outages**: every watcher re-reads its keys after a connection error and resumes from
  the read's index; a restarted etcd (same data) changes nothing, and membership losses
  seen within ``ttl + 1`` s of a reconnect are not acted on (keys that expired while etcd
  was down come back with the next refresh). A replaced etcd (empty data dir; seen as a
  changed cluster id, an index that went backwards, or our key gone) drops every watcher's
  view, the refresher re-registers, running nodes see their round record gone and form a
  new round; the previous rank order is kept from local memory.

Register with torch: importing this module registers ``petctl-etcd`` in torch's handler
registry; ``python -m petctl_agent.rendezvous <torchrun args>`` runs torchrun with it. See
docs/rendezvous.md.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import etcd
import urllib3.exceptions
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

log = logging.getLogger("petctl_agent.rendezvous")

BACKEND = "petctl-etcd"
DEFAULT_PREFIX = "/petctl/rdzv"
DEFAULT_PORT = 2379

#: errors that mean "etcd is unreachable right now" (retry; re-read state afterwards)
_TRANSIENT = (
    etcd.EtcdConnectionFailed,
    etcd.EtcdClusterIdChanged,
    etcd.EtcdException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    OSError,
)


class RendezvousLeftError(RendezvousGracefulExitError):
    """This node left the rendezvous (:meth:`PetctlRendezvousHandler.leave`) while joining."""


class Config:
    """Timing knobs (seconds), and how to reach etcd. Defaults follow issue 10; all can be set
    via ``--rdzv-conf``.

    TLS takes torch's ``etcd`` handler's keys: ``protocol`` (``http``/``https``), ``cacert`` (the
    CA bundle that signed etcd's certificate), ``cert`` and ``key`` (our client certificate and
    its key; ``cert`` alone is a PEM holding both).
    """

    def __init__(
        self,
        ttl: float = 2.0,
        refresh: float = 0.5,
        settle: float = 0.5,
        hint_wait: float = 5.0,
        join_timeout: float = 600.0,
        store_timeout: float = 20.0,
        watch_timeout: float = 30.0,
        request_timeout: float = 5.0,
        reconnect_grace: float | None = None,
        record_ttl: float = 60.0,
        protocol: str = "http",
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        if int(ttl) != ttl or ttl < 1 or not 0 < refresh < ttl:
            raise ValueError(
                f"ttl ({ttl}) must be a whole number of seconds (etcd v2) above refresh ({refresh})"
            )
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol {protocol!r}: use http or https")
        if key and not cert:
            raise ValueError("key given without cert: give the client certificate too (cert=...)")
        if protocol == "http" and (cacert or cert):
            raise ValueError("cacert/cert/key are for TLS: add protocol=https")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path} is not a file")
        self.ttl = int(ttl)
        self.refresh = refresh
        self.settle = settle
        self.hint_wait = hint_wait
        self.join_timeout = join_timeout
        self.store_timeout = store_timeout
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.reconnect_grace = ttl + 1.0 if reconnect_grace is None else reconnect_grace
        self.record_ttl = int(record_ttl)
        self.protocol = protocol
        self.cacert = cacert or None
        self.cert = cert or None
        self.key = key or None

    def client_tls(self) -> dict[str, Any]:
        """python-etcd ``Client`` arguments for our protocol and certificates."""
        if self.protocol == "http":
            return {}
        return {
            "protocol": "https",
            "ca_cert": self.cacert,
            "cert": (self.cert, self.key) if self.key else self.cert,
        }


class RequestCounter:
    """Counts etcd requests by kind (thread-safe); one can be shared by many handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _Client:
    """A python-etcd client (one per thread: watches hold their connection) that counts requests.

    python-etcd remembers the cluster id of its first answer and refuses, once, the first answer
    of another cluster (``EtcdClusterIdChanged``): a new etcd (fresh data dir) now serves this
    address. Then this client starts afresh, tells ``on_new_cluster`` (the handler drops every
    view it read from the old etcd) and re-raises, so the caller retries as after any outage.
    """

    def __init__(
        self,
        host: str,
        port: int,
        counter: RequestCounter,
        timeout: float,
        on_new_cluster: Callable[[str], None],
        tls: dict[str, Any] | None = None,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.tls = tls or {}
        self.counter = counter
        self.on_new_cluster = on_new_cluster
        self.c = self._connect()

    def _connect(self) -> etcd.Client:
        return etcd.Client(
            host=self.host, port=self.port, read_timeout=self.timeout, allow_reconnect=False, **self.tls
        )

    def _call(self, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.counter.add(kind)
        try:
            return fn(*args, **kw)
        except etcd.EtcdClusterIdChanged:
            cluster = str(self.c.expected_cluster_id)
            self.c = self._connect()
            self.on_new_cluster(cluster)
            raise

    def get(self, key: str, kind: str, recursive: bool = False) -> etcd.EtcdResult:
        return self._call(kind, lambda: self.c.read(key, recursive=recursive))

    def write(self, key: str, value: str | None, kind: str, **kw: Any) -> etcd.EtcdResult:
        return self._call(kind, lambda: self.c.write(key, value, **kw))

    def delete(self, key: str, kind: str, **kw: Any) -> None:
        self._call(kind, lambda: self.c.delete(key, **kw))

    def watch(self, key: str, index: int, timeout: float, recursive: bool) -> etcd.EtcdResult:
        return self._call(
            "watch",
            lambda: self.c.read(key, wait=True, waitIndex=index, timeout=timeout, recursive=recursive),
        )


class _Watcher:
    """A local copy of one etcd key or directory tree, kept current by a v2 watch in a thread.

    ``items``: leaf key -> (value, createdIndex). After any error it re-reads the tree and
    resumes from the read's ``X-Etcd-Index`` (so etcd restarts heal). When the handler learns
    that etcd was replaced it stops every watcher and starts new ones: a view of the old etcd
    is never used again. Every change bumps the handler's version and notifies its condition.
    """

    def __init__(self, h: PetctlRendezvousHandler, key: str, recursive: bool, timeout: float) -> None:
        self.h = h
        self.key = key
        self.recursive = recursive
        self.timeout = timeout
        self.items: dict[str, tuple[str | None, int]] = {}
        self.index = 0
        self.synced = False
        self.connected = False
        self.reconnected_at = float("-inf")
        self.last_added = float("-inf")
        self.added_at: dict[str, float] = {}
        self._stop = False
        self.thread = threading.Thread(target=self._run, name=f"petctl-rdzv-watch{key}", daemon=True)

    def start(self) -> _Watcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True

    @property
    def stopped(self) -> bool:
        return self._stop

    @property
    def current(self) -> bool:
        """Read since the last error: what etcd holds now, give or take one round trip."""
        return self.synced and self.connected

    def _run(self) -> None:
        client = self.h._client(self.timeout + 5)
        need_sync, backoff = True, 0.05
        while not self._stop and not self.h._stopping:
            try:
                if need_sync:
                    self._sync(client)
                    need_sync, backoff = False, 0.05
                    continue
                ev = client.watch(self.key, self.index + 1, self.timeout, self.recursive)
            except etcd.EtcdWatchTimedOut:
                continue
            except etcd.EtcdEventIndexCleared:
                need_sync = True
                continue
            except _TRANSIENT as e:
                if self.connected:
                    log.info("etcd watch on %s failed (%s); re-reading after reconnect", self.key, e)
                with self.h._cond:
                    self.connected = False
                    self.h._bump()
                need_sync = True
                time.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, 1.0)
                continue
            if not self._stop:
                self._apply(ev)

    def _sync(self, client: _Client) -> None:
        items: dict[str, tuple[str | None, int]] = {}
        try:
            r = client.get(self.key, "sync", recursive=self.recursive)
            index = int(r.etcd_index)
            for leaf in r.leaves:
                if not leaf.dir:
                    items[leaf.key] = (leaf.value, int(leaf.createdIndex))
        except etcd.EtcdKeyNotFound as e:
            index = int(e.payload.get("index", 0)) if getattr(e, "payload", None) else 0
        now = time.monotonic()
        with self.h._cond:
            if self._stop:
                return
            if index < self.index:  # an etcd index never goes backwards: a new etcd at this address
                self.h._etcd_replaced(f"the index of {self.key} went back from {self.index} to {index}")
                return
            if self.synced and not self.connected:
                self.reconnected_at = now
            added = set(items) - set(self.items)
            for k in added:
                self.added_at[k] = now
            for k in set(self.items) - set(items):
                self.added_at.pop(k, None)
            if added and self.synced:  # what was there before we looked is not a fresh arrival
                self.last_added = now
            self.items, self.index = items, index
            self.synced = self.connected = True
            self.h._bump()

    def _apply(self, ev: etcd.EtcdResult) -> None:
        now = time.monotonic()
        with self.h._cond:
            if ev.action in ("delete", "expire", "compareAndDelete"):
                for k in [k for k in self.items if k == ev.key or k.startswith(ev.key + "/")]:
                    del self.items[k]
                    self.added_at.pop(k, None)
            elif not ev.dir:
                if ev.key not in self.items:
                    self.added_at[ev.key] = now
                    self.last_added = now
                self.items[ev.key] = (ev.value, int(ev.createdIndex))
            self.index = max(self.index, int(ev.modifiedIndex))
            self.h._bump()

    def modified_index(self, key: str) -> int | None:
        v = self.items.get(key)
        return None if v is None else v[1]


def _free_port(addr: str | None) -> int:
    for host in ([addr] if addr else []) + [""]:
        try:
            with socket.socket(socket.AF_INET6 if host and ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise OSError("no free port")


def _loads(v: str | None) -> dict[str, Any]:
    try:
        d = json.loads(v or "{}")
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}


class PetctlRendezvousHandler(RendezvousHandler):
    """See the module docstring. Thread-safe; :meth:`next_rendezvous` runs in the caller's thread.

    ``expected_nodes``: optional hint (e.g. the worker group's desired capacity). While the
    current round plus the waiting nodes are below it, the leader holds off announcing a
    new round for up to ``hint_wait`` s so that a burst becomes one round (the running
    workers keep training meanwhile); once it is met the round closes without the settle
    window.
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
        self.base = f"{prefix.rstrip('/')}/{run_id}"
        self.nodes_dir, self.rounds_dir = f"{self.base}/nodes", f"{self.base}/rounds"
        self.node_key = f"{self.nodes_dir}/{self.node_id}"

        self._cond = threading.Condition(threading.RLock())
        self._version = 0
        self._stopping = False
        self._left = False
        self._main = self._client(self.cfg.request_timeout)  # the caller's thread
        self._reg_index: int | None = None  # createdIndex of our node key; None = not registered
        self._reg_epoch = 0
        self._generation = 0  # etcd replacements (or losses of our key) seen: each drops every view
        self._cluster_id: str | None = None  # the etcd cluster id a client last switched to
        self._replaced_at = float("-inf")
        self._started = False
        self._rounds: _Watcher | None = None
        self._members: _Watcher | None = None  # only while we are the leader
        self._leader_w: _Watcher | None = None  # the leader's key, while someone else leads
        self._joins: _Watcher | None = None  # leader in a rendezvous: joins of the target round
        self._snap: dict[str, int] = {}  # node id -> registration index, from the last read of nodes/
        self._snap_index = 0
        self._round: int | None = None  # the round we run in (None while joining / before)
        self._record: dict[str, Any] | None = None
        self._last_record: dict[str, Any] | None = None  # survives etcd replacement: rank order
        self._target: int | None = None  # the round we are joining
        self._expected_cache: tuple[float, int | None] = (float("-inf"), None)
        self._cleanup: list[Callable[[_Client], None]] = []
        self._snapped_for: tuple[str, int] | None = None
        self._threads: list[threading.Thread] = []
        #: (time.time(), what): the last few hundred steps, for tests, benchmarks and logs
        self.events: deque[tuple[float, str]] = deque(maxlen=500)

    # ---- plumbing --------------------------------------------------------------------
    def _client(self, timeout: float) -> _Client:
        return _Client(self.host, self.port, self.counter, timeout, self._new_cluster, self.cfg.client_tls())

    def _new_cluster(self, cluster_id: str) -> None:
        """A client met another etcd cluster at our address (each client tells it once)."""
        with self._cond:
            if cluster_id == self._cluster_id:
                return  # another client told it first
            self._cluster_id = cluster_id
            self._etcd_replaced(f"etcd cluster id changed to {cluster_id}")

    def _etcd_replaced(self, why: str) -> None:
        """etcd lost our state (a new etcd at this address, or our key vanished): stop every watcher
        and start afresh, so nothing acts on what the old etcd held. The refresher re-registers;
        a node that is joining picks its round again from the new view (see next_rendezvous)."""
        with self._cond:
            if self._stopping or self._left:
                return
            self._generation += 1
            self._replaced_at = time.monotonic()
            for w in (self._members, self._leader_w, self._joins):
                if w is not None:
                    w.stop()
            self._members = self._leader_w = self._joins = None
            self._snapped_for = None
            if self._rounds is not None:
                self._rounds.stop()
                self._rounds = _Watcher(self, self.rounds_dir, True, self.cfg.watch_timeout).start()
            self._bump()
        log.warning("%s: re-reading the rendezvous state", why)
        self._event(f"etcd state lost: {why}")

    def _bump(self) -> None:  # caller holds _cond
        self._version += 1
        self._cond.notify_all()

    def _key_round(self, r: int) -> str:
        return f"{self.rounds_dir}/{r:010d}"

    def _rounds_view(self) -> tuple[dict[int, tuple[dict[str, Any], int]], bool]:
        """round -> (value, createdIndex) and the closed flag, from the rounds watcher (caller holds _cond)."""
        out: dict[int, tuple[dict[str, Any], int]] = {}
        closed = False
        if self._rounds is not None:
            for k, (v, idx) in self._rounds.items.items():
                name = k.rsplit("/", 1)[-1]
                if name == "closed":
                    closed = True
                elif name.isdigit():
                    out[int(name)] = (_loads(v), idx)
        return out, closed

    @staticmethod
    def _latest_closed(rounds: dict[int, tuple[dict[str, Any], int]]) -> tuple[int, dict[str, Any] | None]:
        closed = [r for r, (v, _) in rounds.items() if v.get("state") == "closed"]
        if not closed:
            return 0, None
        r = max(closed)
        return r, rounds[r][0]

    def _expected(self) -> int | None:
        if self.expected_nodes is None:
            return None
        t, v = self._expected_cache
        if time.monotonic() - t < 1.0:
            return v
        try:
            v = self.expected_nodes()
        except Exception as e:  # noqa: BLE001 - a hint only
            log.debug("expected_nodes hint failed: %s", e)
            v = None
        self._expected_cache = (time.monotonic(), v)
        return v

    def _event(self, what: str) -> None:
        self.events.append((time.time(), what))
        log.debug("%s: %s", self.node_id, what)

    # ---- registration and background threads ------------------------------------------
    def _register(self, client: _Client) -> None:
        value = json.dumps({"addr": self.addr, "pid": os.getpid()})
        try:
            r = client.write(self.node_key, value, "register", ttl=self.cfg.ttl, prevExist=False)
        except etcd.EtcdAlreadyExist:
            r = client.write(self.node_key, None, "refresh", ttl=self.cfg.ttl, refresh=True, prevExist=True)
        with self._cond:
            self._reg_index = int(r.createdIndex)
            self._reg_epoch += 1
            self._bump()

    def _snapshot(self, client: _Client) -> None:
        """Read the membership once (non-leaders use it to find the leader)."""
        try:
            r = client.get(self.nodes_dir, "snapshot", recursive=True)
            snap = {
                leaf.key.rsplit("/", 1)[-1]: int(leaf.createdIndex)
                for leaf in r.leaves
                if not leaf.dir and leaf.key != self.nodes_dir
            }
            index = int(r.etcd_index)
        except etcd.EtcdKeyNotFound as e:
            snap, index = {}, int(e.payload.get("index", 0))
        with self._cond:
            self._snap, self._snap_index = snap, index
            self._bump()

    def _start(self) -> None:
        """Register, start the rounds watcher, the refresher and the control thread (once)."""
        if self._started:
            return
        deadline = time.monotonic() + self.cfg.join_timeout
        while True:
            try:
                self._register(self._main)
                self._snapshot(self._main)
                break
            except _TRANSIENT as e:
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"cannot register at etcd {self.cfg.protocol}://{self.host}:{self.port}: {e}"
                    ) from e
                log.warning("etcd unreachable while registering (%s); retrying", e)
                time.sleep(0.5)
        self._started = True
        self._rounds = _Watcher(self, self.rounds_dir, True, self.cfg.watch_timeout).start()
        for target, name in ((self._refresher, "refresh"), (self._control, "control")):
            t = threading.Thread(target=target, name=f"petctl-rdzv-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _refresher(self) -> None:
        client = self._client(self.cfg.request_timeout)
        while not self._stopping and not self._left:
            t0 = time.monotonic()
            try:
                client.write(self.node_key, None, "refresh", ttl=self.cfg.ttl, refresh=True, prevExist=True)
            except etcd.EtcdKeyNotFound:
                if self._left or self._stopping:
                    break
                self._etcd_replaced("our membership key vanished (expired, or etcd was replaced)")
                try:
                    self._register(client)
                    self._event("re-registered")
                except _TRANSIENT as e:
                    log.info("re-register failed: %s", e)
            except _TRANSIENT as e:
                log.debug("refresh failed: %s", e)
            with self._cond:
                pending, self._cleanup = self._cleanup, []
            for job in pending:
                try:
                    job(client)
                except _TRANSIENT as e:
                    log.debug("cleanup failed: %s", e)
            time.sleep(max(0.0, self.cfg.refresh - (time.monotonic() - t0)))

    # ---- leadership -------------------------------------------------------------------
    def _order(self, base: list[str], nodes: set[str], reg: Callable[[str], int]) -> list[str]:
        survivors = [n for n in base if n in nodes]
        rest = sorted(nodes - set(survivors), key=lambda n: (reg(n), n))
        return survivors + rest

    def _presumed_leader(self) -> str | None:
        """The first live node in rank order, as far as this node knows (caller holds _cond)."""
        rounds, _ = self._rounds_view()
        rnum, rec = self._latest_closed(rounds)
        rec = rec or self._last_record
        base = list(rec["participants"]) if rec else []
        if self._members is not None and self._members.synced:
            live = {k.rsplit("/", 1)[-1]: idx for k, (_, idx) in self._members.items.items()}
        else:
            live = dict(self._snap)
            rec_idx = rounds[rnum][1] if rnum in rounds else 0
            if rec and self._snap_index < rec_idx:
                for n in base:  # the record is newer than our read of nodes/: its nodes were alive
                    live.setdefault(n, 0)
        if self._reg_index is not None:
            live.setdefault(self.node_id, self._reg_index)
        if not live:
            return None
        return self._order(base, set(live), lambda n: live.get(n, 0))[0]

    def _control(self) -> None:
        """Background coordination: who leads, opening rounds on membership changes, closing rounds."""
        client = self._client(self.cfg.request_timeout)
        seen = -1
        wait: float | None = None
        while not self._stopping and not self._left:
            with self._cond:
                if self._version == seen:
                    self._cond.wait(timeout=wait if wait is not None else 1.0)
                seen = self._version
            try:
                wait = self._step(client)
            except _TRANSIENT as e:
                log.debug("control step failed: %s", e)
                wait = 0.2

    def _step(self, client: _Client) -> float | None:
        """One pass of the control loop; returns when to look again (None: on the next change)."""
        now = time.monotonic()
        with self._cond:
            leader = self._presumed_leader()
            me = leader == self.node_id
            if me:
                if self._leader_w is not None:
                    self._leader_w.stop()
                    self._leader_w = None
                if self._members is None:
                    self._members = _Watcher(self, self.nodes_dir, True, 10.0).start()
                    self._event("leading")
            else:
                if self._members is not None:
                    self._members.stop()
                    self._members = None
                if self._joins is not None:
                    self._joins.stop()
                    self._joins = None
                lk = f"{self.nodes_dir}/{leader}" if leader else None
                if self._leader_w is not None and self._leader_w.key != lk:
                    self._leader_w.stop()
                    self._leader_w = None
                if lk and self._leader_w is None:
                    self._leader_w = _Watcher(self, lk, False, 10.0).start()
        if not me:
            return self._follow(client, now)
        return self._lead(client, now)

    def _follow(self, client: _Client, now: float) -> float | None:
        with self._cond:
            w = self._leader_w
            if w is None or not w.synced or w.items:
                return None
            if not w.connected:
                return None
            since = max(w.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            if self._snapped_for == (w.key, w.index):
                return 0.2  # already re-read the membership for this state of the leader's key
            self._snapped_for = (w.key, w.index)
        # the leader's key is gone (expired or deleted): read the membership again, recompute
        self._snapshot(client)
        return 0.0

    def _lead(self, client: _Client, now: float) -> float | None:
        with self._cond:
            m = self._members
            if m is None or not m.synced or not m.connected:
                return None
            since = max(m.reconnected_at, self._replaced_at)
            if now - since < self.cfg.reconnect_grace:
                return self.cfg.reconnect_grace - (now - since) + 0.05
            live = {k.rsplit("/", 1)[-1]: idx for k, (_, idx) in m.items.items()}
            rounds, closed = self._rounds_view()
            if closed:
                return None
            latest, rec = self._latest_closed(rounds)
            target = self._target
            running = self._round
        if target is not None and target == latest + 1:
            return self._try_close(client, now, target, live, rounds, rec)
        if running is not None and running == latest and rec is not None:
            return self._maybe_open(client, now, latest, rec, live, rounds)
        return None

    def _maybe_open(
        self,
        client: _Client,
        now: float,
        latest: int,
        rec: dict[str, Any],
        live: dict[str, int],
        rounds: dict[int, tuple[dict[str, Any], int]],
    ) -> float | None:
        """Leader of a running round: announce the next round when the membership changed."""
        if latest + 1 in rounds:
            return None  # already open
        parts = list(rec["participants"])
        gone = [p for p in parts if p not in live]
        waiting = [n for n in sorted(live, key=lambda n: live[n]) if n not in parts]
        if len(parts) - len(gone) >= self.max_nodes:
            waiting = []
        retry = None
        if waiting and not gone:
            exp = self._expected()
            if exp is not None and len(parts) + len(waiting) < min(exp, self.max_nodes):
                with self._cond:
                    at = self._members.added_at if self._members is not None else {}
                    first = min(at.get(f"{self.nodes_dir}/{n}", now) for n in waiting)
                if now - first < self.cfg.hint_wait:
                    return self.cfg.hint_wait - (now - first) + 0.01
        if not gone and not waiting:
            return retry
        marker = {"state": "open", "by": self.node_id, "waiting": waiting, "gone": gone, "t": time.time()}
        try:
            client.write(self._key_round(latest + 1), json.dumps(marker), "open", prevExist=False)
            self._event(f"opened round {latest + 1}: waiting={len(waiting)} gone={len(gone)}")
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
            pass
        return None

    def _try_close(
        self,
        client: _Client,
        now: float,
        target: int,
        live: dict[str, int],
        rounds: dict[int, tuple[dict[str, Any], int]],
        rec: dict[str, Any] | None,
    ) -> float | None:
        with self._cond:
            jkey = f"{self.base}/joins/{target:010d}"
            if self._joins is not None and self._joins.key != jkey:
                self._joins.stop()
                self._joins = None
            if self._joins is None:
                self._joins = _Watcher(self, jkey, True, 10.0).start()
                return None
            if not self._joins.synced:
                return None
            joins = {k.rsplit("/", 1)[-1]: _loads(v) for k, (v, _) in self._joins.items.items()}
            members_index = self._members.index if self._members else 0
            last_added = self._members.last_added if self._members else float("-inf")
        if not set(live) <= set(joins):
            return None  # a live registered node has not joined yet
        for n, j in joins.items():
            # joined, but its registration not seen yet (it is in flight on the other watch)
            if n not in live and int(j.get("reg", 0)) > members_index:
                return None
        joined = {n for n in joins if n in live}
        if len(joined) < self.min_nodes:
            return None
        base = list((rec or self._last_record or {}).get("participants", []))
        order = self._order(base, joined, lambda n: live[n])
        parts = order[: self.max_nodes]
        exp = self._expected()
        survivors = [n for n in base if n in joined]
        if exp is not None and len(parts) > len(survivors) and exp <= len(survivors):
            # newcomers are joining but the hint expects no growth: it predates them (a desired
            # capacity read before the scale-out). A stale hint must not skip the settle window.
            exp = None
        hinted = exp is not None and len(parts) >= min(exp, self.max_nodes)
        if not hinted and now - last_added < self.cfg.settle:
            return self.cfg.settle - (now - last_added) + 0.01
        if parts[0] != self.node_id:
            return None  # our view of the order is stale; the watchers will catch up
        record = {
            "state": "closed",
            "round": target,
            "participants": parts,
            "addrs": [joins[n].get("addr") for n in parts],
            "master_addr": joins[parts[0]].get("addr"),
            "master_port": int(joins[parts[0]]["port"]),
            "leader": self.node_id,
            "t": time.time(),
        }
        key = self._key_round(target)
        cur = rounds.get(target)
        try:
            if cur is None:
                r = client.write(key, json.dumps(record), "record", prevExist=False)
            else:
                r = client.write(
                    key, json.dumps(record), "record", prevIndex=self._rounds.modified_index(key)
                )
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            return None  # someone else wrote it; the rounds watch brings it
        self._event(f"closed round {target} with {len(parts)}")
        with self._cond:
            if self._rounds is not None:
                self._rounds.items[key] = (json.dumps(record), int(r.createdIndex))
                self._rounds.index = max(self._rounds.index, int(r.modifiedIndex))
            old = [k for k in rounds if k < target]
            self._cleanup.append(lambda c: self._gc(c, target, old))
            self._bump()
        return None

    def _gc(self, client: _Client, target: int, old: list[int]) -> None:
        """After closing ``target``: older round keys expire (silently) later; old joins/stores go."""
        for r in old:
            try:
                client.write(
                    self._key_round(r), None, "cleanup", ttl=self.cfg.record_ttl, refresh=True, prevExist=True
                )
            except etcd.EtcdKeyNotFound:
                pass
        for key in (f"{self.base}/joins/{target - 1:010d}", f"{self.base}/store/{target - 2:010d}"):
            try:
                client.delete(key, "cleanup", recursive=True)
            except etcd.EtcdKeyNotFound:
                pass

    # ---- RendezvousHandler -------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # Workers run their own TCPStore on rank 0's node at the port in the round record.
        return False

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.join_timeout
        if self._left:
            raise RendezvousLeftError(f"node {self.node_id} left the rendezvous")
        with self._cond:
            prev_round, prev_record = self._round, self._record
            self._round = self._record = None
            self._bump()
        self._start()
        self._event("join")
        target: int | None = None
        join_epoch: tuple[int, int] = (-1, -1)
        while True:
            with self._cond:
                if self._left:
                    self._target = None
                    raise RendezvousLeftError(f"node {self.node_id} left the rendezvous")
                rounds, closed = self._rounds_view()
                if closed:
                    self._target = None
                    raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")
                # a view from before an etcd error may be the old etcd's: never pick a round from it
                synced = self._rounds is not None and self._rounds.current
                epoch = (self._reg_epoch, self._generation)
                if target is not None and synced:
                    got = rounds.get(target)
                    if got is not None and got[0].get("state") == "closed":
                        rec = got[0]
                        if self.node_id in rec.get("participants", []):
                            return self._accept(target, rec, t0)
                        self._event(f"round {target} closed without us")
                        target = None
                    elif self._latest_closed(rounds)[0] >= target or epoch != join_epoch:
                        target = None
                latest, _ = self._latest_closed(rounds)
                version = self._version
            if time.monotonic() > deadline:
                with self._cond:
                    self._target = None
                raise RendezvousTimeoutError(
                    f"no round with this node within {self.cfg.join_timeout:.0f}s "
                    f"(min_nodes={self.min_nodes}, max_nodes={self.max_nodes})"
                )
            if target is None and synced:
                target = latest + 1
                try:
                    self._join(target, prev_round, prev_record, latest, rounds)
                    join_epoch = epoch
                except _TRANSIENT as e:
                    log.warning("join write failed (%s); retrying", e)
                    target = None
                    time.sleep(0.2)
                continue
            with self._cond:
                if self._version == version:
                    self._cond.wait(timeout=min(1.0, max(0.01, deadline - time.monotonic())))

    def _join(
        self,
        target: int,
        prev_round: int | None,
        prev_record: dict[str, Any] | None,
        latest: int,
        rounds: dict[int, tuple[dict[str, Any], int]],
    ) -> None:
        value = {
            "addr": self.addr,
            "port": _free_port(self.addr),
            "reg": self._reg_index or 0,
            "t": time.time(),
        }
        self._main.write(f"{self.base}/joins/{target:010d}/{self.node_id}", json.dumps(value), "join")
        if (
            prev_round is not None
            and prev_round == latest
            and prev_record is not None
            and self.node_id in prev_record.get("participants", [])
            and target not in rounds
        ):
            # a participant of the running round wants a new one (its workers stopped): tell everyone
            marker = {"state": "open", "by": self.node_id, "waiting": [], "gone": [], "rejoin": True}
            try:
                self._main.write(self._key_round(target), json.dumps(marker), "open", prevExist=False)
            except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
                pass
        with self._cond:
            self._target = target
            self._bump()
        self._event(f"joined round {target}")

    def _accept(self, target: int, rec: dict[str, Any], t0: float) -> RendezvousInfo:
        """Caller holds _cond."""
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        self._round, self._record, self._last_record, self._target = target, rec, rec, None
        if self._joins is not None:
            self._joins.stop()
            self._joins = None
        self._bump()
        parts = rec["participants"]
        rank = parts.index(self.node_id)
        store = EtcdStore(
            self._client(self.cfg.store_timeout + 5).c,
            f"{self.base}/store/{target:010d}",
            timeout=timedelta(seconds=self.cfg.store_timeout),
        )
        self._event(f"round {target} rank {rank}/{len(parts)}")
        log.info(
            "rendezvous %s round %d: rank %d of %d (master %s:%s) after %.3fs",
            self.run_id, target, rank, len(parts), rec["master_addr"], rec["master_port"], time.monotonic() - t0,
        )  # fmt: skip
        return RendezvousInfo(
            store, rank, len(parts), RendezvousStoreInfo(rec["master_addr"], int(rec["master_port"]))
        )

    def pending_change(self) -> dict[str, Any] | None:
        """Why the current round must end, or None: ``{"round", "reason", "waiting", "gone"}``.

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
                return {
                    "round": newer[0],
                    "reason": reason,
                    "waiting": list(v.get("waiting", [])),
                    "gone": list(v.get("gone", [])),
                }
            if self._round not in rounds and self._rounds.connected:
                return {"round": self._round + 1, "reason": "round record gone", "waiting": [], "gone": []}
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
                if ch is not None or self._left or left <= 0:
                    return ch
                self._cond.wait(left)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round, plus participants gone; >0 means re-rendezvous now.

        Never raises and never talks to etcd: it reads what the watches brought.
        """
        ch = self.pending_change()
        if ch is None:
            return 0
        return max(1, len(ch["waiting"]) + len(ch["gone"]))

    def is_closed(self) -> bool:
        with self._cond:
            if self._rounds is not None and self._rounds.synced:
                return self._rounds_view()[1]
        try:
            self._main.get(f"{self.rounds_dir}/closed", "get")
            return True
        except etcd.EtcdKeyNotFound:
            return False

    def set_closed(self) -> None:
        self._main.write(f"{self.rounds_dir}/closed", "1", "close")

    def leave(self) -> None:
        """Leave now: delete our membership key (peers see it at once), stop all threads.

        A :meth:`next_rendezvous` running in another thread raises :class:`RendezvousLeftError`.
        Does not close the rendezvous for the others.
        """
        with self._cond:
            if self._left:
                return
            self._left = True
            self._round = self._target = None
            self._bump()
        try:
            self._client(self.cfg.request_timeout).delete(self.node_key, "leave")
        except etcd.EtcdKeyNotFound:
            pass
        except _TRANSIENT as e:
            log.warning("could not delete our membership key (%s); peers will see it expire", e)
        self._stop_watchers()
        self._event("left")

    def _stop_watchers(self) -> None:
        with self._cond:
            for w in (self._rounds, self._members, self._leader_w, self._joins):
                if w is not None:
                    w.stop()
            self._bump()

    def shutdown(self) -> bool:
        """torch's contract: the job is over, close the rendezvous for everyone, release resources."""
        try:
            self.set_closed()
        except _TRANSIENT as e:
            log.warning("could not close the rendezvous: %s", e)
        self.leave()
        self._stopping = True
        return True

    def _crash(self) -> None:
        """Tests: stop every thread without deleting the membership key (a SIGKILLed node)."""
        with self._cond:
            self._left = True
            self._stopping = True
            self._bump()
        self._stop_watchers()

    def stats(self) -> dict[str, int]:
        return self.counter.snapshot()

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


# ---- torch registry ------------------------------------------------------------------------
def create_handler(params: RendezvousParameters) -> PetctlRendezvousHandler:
    """Creator for torch's registry; ``--rdzv-conf`` keys: ttl, refresh, settle, hint_wait,
    join_timeout, store_timeout, watch_timeout, key_prefix, and TLS: protocol, cacert, cert, key."""
    cfg = Config(
        ttl=float(params.get("ttl", 2.0)),
        refresh=float(params.get("refresh", 0.5)),
        settle=float(params.get("settle", 0.5)),
        hint_wait=float(params.get("hint_wait", 5.0)),
        join_timeout=float(params.get("join_timeout", 600)),
        store_timeout=float(params.get("store_timeout", 20)),
        watch_timeout=float(params.get("watch_timeout", 30)),
        protocol=str(params.get("protocol", "http")),
        cacert=params.get("cacert"),
        cert=params.get("cert"),
        key=params.get("key"),
    )
    return PetctlRendezvousHandler(
        params.run_id,
        params.endpoint,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        config=cfg,
        prefix=str(params.get("key_prefix", DEFAULT_PREFIX)),
    )


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """For the ``torchrun.handlers`` entry point group (torch calls it and registers the result)."""
    return create_handler


def register() -> None:
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:  # already registered (e.g. through the entry point): keep that one
        pass


register()


def main(argv: list[str] | None = None) -> None:
    """``python -m petctl_agent.rendezvous <torchrun args>``: torchrun with ``petctl-etcd`` registered."""
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main()
