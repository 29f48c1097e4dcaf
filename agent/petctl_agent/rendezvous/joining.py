"""Joining: :meth:`next_rendezvous`, the caller's side of a round.

A node joins round ``latest closed + 1`` (``joins/<r>/<id>``, on its lease) and waits until the
leader's record of that round is written; then it reads its own rank key under the record's
nonce once: there, it has its rank; missing, it was left out and joins the next round.
It picks its round only from a rounds view read since the last etcd error, and picks again
when it re-registered or etcd lost its state.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from petctl_agent.rendezvous import etcd_ops
from petctl_agent.rendezvous.client import TRANSIENT
from petctl_agent.rendezvous.layout import Rounds, latest_closed
from petctl_agent.rendezvous.record import read_current_rank

log = logging.getLogger("petctl_agent.rendezvous")


class RendezvousLeftError(RendezvousGracefulExitError):
    """This node left the rendezvous (:meth:`PetctlRendezvousHandler.leave`) while joining."""


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _free_port(addr: str | None) -> int:
    """A port for rank 0's store, free now and still free when the store listens on it.

    Taken below the kernel's ephemeral range (``ip_local_port_range``): a port from that range (what
    binding port 0 gives) can be handed to any outgoing connection on the node (the agents' etcd
    calls, the workers' gloo/NCCL links) before it is held, and that costs a restart.
    No outgoing connection gets a port below the range. Port 0 only if the band is full.

    The port must be free on the wildcard address as well as on ``addr``: a script that calls
    ``init_process_group()`` itself has torch's ``TCPStore`` listen on the wildcard, which fails on a
    port that anything on the node holds on any one address (in the local cloud, another node's
    127.x.y.z).
    """
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    for host in ([addr] if addr else []) + [""]:
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        wildcard = "::" if family == socket.AF_INET6 else ""
        for _ in range(64):
            port = random.randint(low, high)
            if _bindable(family, host, port) and (host == wildcard or _bindable(family, wildcard, port)):
                return port
        try:
            with socket.socket(family) as s:
                s.bind((host, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise OSError("no free port")


def _hold_port(addr: str | None, listen: bool = False) -> socket.socket:
    """A :func:`_free_port` port, bound and held with ``SO_REUSEADDR`` until this node joins again.

    ``listen`` (the workers' store is the agent's, ``use_agent_store``): bound on ``addr`` (an IP
    literal; else the wildcard) and listening from this instant; rank 0's agent serves the
    workers' store on this very socket (:meth:`Joining._serve_workers_store`), so no other
    process can take the port between the pick and the store, with ``SO_REUSEADDR`` or without.

    Otherwise (a script's rank 0 hosts the store): bound on the wildcard, not listening: a process
    that binds the port without ``SO_REUSEADDR`` in the seconds before rank 0's worker listens on
    it fails instead of taking it. Rank 0's store still binds it: the petctl helper's and torch's
    own ``TCPStore`` set ``SO_REUSEADDR``, and Linux lets a listener share a port with bound
    sockets that do not listen (``tests/agent/test_master_port.py``). Left open on that path: a
    process that sets ``SO_REUSEADDR`` and listens on that very port first."""
    for _ in range(8):
        try:
            return _bind(addr, _free_port(addr), listen)
        except OSError:  # taken since _free_port looked
            continue
    raise OSError("no free port to hold")


def _bind(addr: str | None, port: int, listen: bool) -> socket.socket:
    """``port`` bound with ``SO_REUSEADDR`` as :func:`_hold_port` holds it (OSError: taken)."""
    family = socket.AF_INET6 if addr and ":" in addr else socket.AF_INET
    host = "::" if family == socket.AF_INET6 else ""
    if listen and addr and _is_ip(addr):
        host = addr
    s = socket.socket(family)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        if listen:
            s.listen(1024)  # a bound, not listening SO_REUSEADDR socket of another: EADDRINUSE
    except OSError:
        s.close()
        raise
    return s


def _is_ip(addr: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr)
    except OSError:
        return False
    return True


class Joining:
    """Mixin of :class:`~petctl_agent.rendezvous.handler.PetctlRendezvousHandler` (its state is
    made in the handler's ``__init__``): the torch ``next_rendezvous`` call."""

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
            closed_rec: dict[str, Any] | None = None
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
                        closed_rec = got[0]
                    elif latest_closed(rounds)[0] >= target or epoch != join_epoch:
                        target = None
                latest, _ = latest_closed(rounds)
                version = self._version
            if closed_rec is not None and target is not None:
                try:
                    rank, replaced = read_current_rank(
                        self._etcd, self.keys, target, closed_rec, self.node_id
                    )
                except TRANSIENT as e:  # read again after the wait below (the join timeout still runs)
                    self._client_error(e)
                    log.info("reading our rank of round %d failed (%s); retrying", target, e)
                else:
                    with self._cond:
                        # a record read before etcd was replaced is the old etcd's: never accept it
                        ok = rank is not None and not replaced
                        if ok and epoch[1] == self._generation and not self._left:
                            return self._accept(target, closed_rec, rank, t0)
                    if rank is None:
                        self._event(f"round {target} closed without us")
                    elif replaced:
                        self._event(f"round {target} closed with us, but round {target + 1} replaced it")
                    target = None
                    continue
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
                except TRANSIENT as e:
                    self._client_error(e)
                    log.warning("join write failed (%s); retrying", e)
                    target = None
                    time.sleep(0.2)
                continue
            with self._cond:
                if self._version == version:
                    self._cond.wait(timeout=min(1.0, max(0.01, deadline - time.monotonic())))

    def _take_port(self) -> int:
        """This join's master port, held until the next join or until we leave (:func:`_hold_port`);
        the store the last one served (rank 0 of the last round) serves on (:meth:`_release_port`)."""
        held = _hold_port(self.addr, listen=self.use_agent_store)
        self._release_port(held)
        return int(held.getsockname()[1])

    def _release_port(self, held: socket.socket | None = None) -> None:
        """Close the port we held and hold ``held`` instead. The store we served on the old one
        keeps serving until this node's next workers start (:meth:`end_old_stores`): our workers,
        and the other nodes', may still use it while they stop (a checkpoint's group, a barrier),
        as they could while rank 0's worker hosted it."""
        with self._cond:
            old, self._port_hold = self._port_hold, held
            if self._workers_store is not None:
                self._old_stores.append(self._workers_store)
                self._workers_store = None
        if old is not None:
            old.close()

    def end_old_stores(self) -> None:
        """End the stores served for earlier starts of the workers (this node's workers of those
        rounds are gone: each start of new ones comes after they were reaped)."""
        with self._cond:
            old, self._old_stores = self._old_stores, []
        del old  # torch's TCPStore server stops with its last reference (it owns a dup of the socket)

    def _serve_workers_store(self, port: int) -> None:
        """As rank 0 of a round, with ``use_agent_store``: serve the workers' ``TCPStore`` on the
        port this join held and published (it listens already), as torchrun's agent does, until
        this node's next workers start (:meth:`_release_port`, :meth:`end_old_stores`). Each
        rank's ``init_process_group`` (env://, with ``TORCHELASTIC_USE_AGENT_STORE``) is a client
        of it; a fresh store for each start of the workers, so no key outlives the round. A port
        that is taken, or a store that fails to start, is a warning: the workers' start fails, and
        the next round picks another port. Caller holds _cond."""
        from torch.distributed import TCPStore

        held = self._port_hold
        try:
            if held is None or int(held.getsockname()[1]) != port:
                # the round carries the port of an earlier join of ours to it (the join key
                # existed, so the later join's port was never published): serve on that one
                held = _bind(self.addr, port, listen=True)
                self._release_port(held)
            # the store owns the dup from here on, and closes it, also when it fails
            self._workers_store = TCPStore(
                self.addr, port, None, True, timeout=timedelta(seconds=self.cfg.store_timeout),
                wait_for_workers=False, master_listen_fd=os.dup(held.fileno()),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the workers' start fails instead, not the agent
            log.warning("cannot serve the workers' store on port %d (%s): their start fails, "
                        "and the next round picks another port", port, e)  # fmt: skip

    def _join(
        self,
        target: int,
        prev_round: int | None,
        prev_record: dict[str, Any] | None,
        latest: int,
        rounds: Rounds,
    ) -> None:
        value: dict[str, Any] = {
            "addr": self.addr,
            "port": self._take_port(),
            "reg": self._reg_index or 0,
        }
        _, rec = latest_closed(rounds)
        if rec is not None:
            self._seen_seq = max(self._seen_seq, int(rec.get("seq", latest)))
        if self._seen_seq:
            value["seen"] = self._seen_seq  # the newest round we saw closed, on any etcd (its seq)
        if self._last_rank is not None:
            # [seq, rank, etcd boot token] of the round we last ran in: the order kept if etcd is replaced
            value["prev"] = list(self._last_rank)
        lease = self._lease.id if self._lease is not None else 0
        self._etcd.put(self.keys.join(target, self.node_id), json.dumps(value), lease=lease)
        if (
            prev_round is not None
            and prev_round == latest
            and prev_record is not None  # we ran in it (a record is kept only for a round we ran in)
            and target not in rounds
        ):
            # a participant of the running round wants a new one (its workers stopped): tell everyone.
            # Only while the round we ran in is etcd's latest, as we saw it (its record's
            # mod_revision changes when the next round closes, and it goes record_ttl later): a
            # view that lags would otherwise create an open marker under an expired record's key
            # (an old round number), which nothing ever deletes
            marker = {"state": "open", "by": self.node_id, "waiting": [], "gone": [], "rejoin": True}
            key = self.keys.round(target)
            with self._cond:
                seen = (
                    self._rounds.mod_revision(self.keys.round(latest)) if self._rounds is not None else None
                )
            if seen is not None:
                cmp = [
                    etcd_ops.compare(key, "create", "==", 0),
                    etcd_ops.compare(self.keys.round(latest), "mod", "==", seen),
                ]
                self._etcd.txn(cmp, [etcd_ops.put_op(key, json.dumps(marker))])
        with self._cond:
            self._target = target
            self._bump()
        self._event(f"joined round {target}")

    def _accept(self, target: int, rec: dict[str, Any], rank: int, t0: float) -> RendezvousInfo:
        """Caller holds _cond."""
        from petctl_agent.rendezvous.store import V3Store

        self._round, self._record, self._last_record, self._target = target, rec, rec, None
        seq = int(rec.get("seq", target))
        self._last_rank = (seq, rank, self._token or "")
        self._seen_seq = max(self._seen_seq, seq)
        if self._joins is not None:
            self._joins.stop()
            self._joins = None
        self._bump()
        world = int(rec["n"])
        if rank == 0 and self.use_agent_store:
            self._serve_workers_store(int(rec["master_port"]))
        store = V3Store(self._etcd, self.keys.store(target), timedelta(seconds=self.cfg.store_timeout))
        self._event(f"round {target} rank {rank}/{world}")
        log.info(
            "rendezvous %s round %d: rank %d of %d (master %s:%s) after %.3fs",
            self.run_id, target, rank, world, rec["master_addr"], rec["master_port"], time.monotonic() - t0,
        )  # fmt: skip
        return RendezvousInfo(
            store, rank, world, RendezvousStoreInfo(rec["master_addr"], int(rec["master_port"]))
        )
