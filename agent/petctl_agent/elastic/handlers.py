"""Rendezvous handlers: which one, built how, and the torch internals the agent reaches into.

``create_rdzv_handler`` builds petctl's own ``petctl-etcd`` handler (the default) or one of
torch's (``etcd-v2``, the fallback; ``etcd``, the legacy one), with the timeouts, heartbeats,
TLS and workarounds docs/agent.md explains. The rest are the places where the agent needs more
from torch's ``DynamicRendezvousHandler`` than its public API gives: forget a lost state, leave
a round, make a leave request take effect inside torch's join loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from threading import Event
from typing import Any

import urllib3.exceptions
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from petctl_agent.settings import EtcdTls, Settings
from petctl_agent.spec import rdzv_backend

log = logging.getLogger("petctl_agent.handlers")

try:
    import etcd  # python-etcd

    _ETCD_ERRORS: tuple[type[BaseException], ...] = (etcd.EtcdException,)
except ImportError:  # pragma: no cover
    _ETCD_ERRORS = ()

#: errors that mean "etcd or the etcd-backed store is unreachable/slow": retryable
TRANSIENT_RDZV_ERRORS = (
    RendezvousConnectionError,
    RendezvousStateError,
    LookupError,  # EtcdStore.get/wait timeout (e.g. the node that should publish MASTER_ADDR died)
    ConnectionError,
    urllib3.exceptions.HTTPError,
    *_ETCD_ERRORS,
)


class LeftRendezvous(Exception):
    """This node was asked to leave while it was inside a rendezvous, and left it."""


def join_timeout_s(spec_join_timeout: float, settings: Settings) -> float:
    """The job's join timeout: ``$PETCTL_AGENT_JOIN_TIMEOUT`` overrides the spec (tests, emergencies)."""
    return spec_join_timeout if settings.join_timeout is None else settings.join_timeout


def rendezvous_config(join_timeout: float = 1800, settings: Settings = Settings()) -> dict[str, Any]:
    """Rendezvous timeouts/heartbeats, chosen by measurement (docs/agent.md)."""
    # torch's join timeout is one *attempt*: when it fires the agent asks the worker group
    # whether capacity is still coming and joins again (PetctlElasticAgent._rendezvous);
    # the job's own bound is the spec's join_timeout.
    attempt = min(settings.rdzv_attempt, join_timeout_s(join_timeout, settings))
    cfg: dict[str, Any] = {"join_timeout": max(1, int(attempt))}
    if settings.enabled("FAST_LAST_CALL"):
        # torch default last_call_timeout=30 s: every (re-)rendezvous with >= min
        # nodes waits 30 s for stragglers (DESIGN §4: 33 s start, 43 s join).
        cfg["last_call_timeout"] = settings.last_call
    if settings.enabled("FAST_HEARTBEAT"):
        # torch default keep-alive 5 s x 3 attempts: a SIGKILLed node stays a
        # participant for ~15-20 s and the survivors' next round cannot start
        # (the round only advances when its participants are gone).
        cfg["keep_alive_interval"] = settings.keepalive
        cfg["keep_alive_max_attempt"] = settings.keepalive_attempts
    return cfg


#: backends that are torch's own handlers: only these need the torch workarounds
TORCH_BACKENDS = frozenset({"etcd-v2", "etcd"})


def torch_workaround(name: str, backend: str, settings: Settings = Settings()) -> bool:
    """Is the torch workaround ``name`` on for ``backend``? Only torch's own handlers need them
    (SPLIT_STORE, FAST_LAST_CALL, FAST_HEARTBEAT, STORE_TIMEOUT, ETCD_OUTAGE, MEMBERSHIP_WATCH, ...)."""
    return backend in TORCH_BACKENDS and settings.enabled(name)


def etcd_tls_config(tls: EtcdTls | None, backend: str) -> dict[str, str]:
    """The handler config keys that make ``backend``'s etcd client speak https with ``tls``.

    torch names them differently per handler (torch 2.13): the legacy ``etcd`` handler reads
    ``cacert``/``cert``/``key`` (``etcd_rendezvous.py``), ``etcd-v2``'s ``_create_etcd_client``
    reads ``ca_cert``/``ssl_cert``/``ssl_cert_key`` (``etcd_rendezvous_backend.py``); petctl-etcd
    takes the former. The endpoint stays ``host:port``. Empty without TLS (plain http).
    """
    if tls is None:
        return {}
    if backend == "etcd-v2":
        return {"protocol": "https", "ca_cert": tls.cacert, "ssl_cert": tls.cert, "ssl_cert_key": tls.key}
    return {"protocol": "https", "cacert": tls.cacert, "cert": tls.cert, "key": tls.key}


def create_rdzv_handler(
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str,
    join_timeout: float = 1800,
    backend: str | None = None,
    expected_nodes: Callable[[], int | None] | None = None,
    settings: Settings = Settings(),
    drain_timeout: float = 60.0,
) -> RendezvousHandler:
    """Build the rendezvous handler for ``backend`` (default :func:`rdzv_backend`: petctl-etcd).

    ``expected_nodes``: the worker group's desired capacity (a hint that turns a burst of
    joins into one round); only petctl-etcd uses it, and calls it at most once a second
    from its control thread, so it must not block. ``drain_timeout``: the job's; the leader
    waits for a node of the previous round as long as that node's coordinated stop may take.
    """
    backend_name = backend or rdzv_backend("", settings.rdzv_backend)
    cfg = rendezvous_config(join_timeout, settings)
    tls = etcd_tls_config(settings.etcd_tls, backend_name)
    if backend_name == "petctl-etcd":
        from petctl_agent.rendezvous import Config, PetctlRendezvousHandler

        return PetctlRendezvousHandler(
            run_id,
            endpoint,
            min_nodes,
            max_nodes,
            local_addr,
            config=Config(
                join_timeout=float(cfg["join_timeout"]),
                stop_wait=settings.stop_wait_for(drain_timeout),
                **tls,
            ),
            expected_nodes=expected_nodes,
        )
    if backend_name != "etcd-v2":
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        legacy = {"last_call_timeout": cfg.get("last_call_timeout", 30), "timeout": cfg["join_timeout"]}
        params = RendezvousParameters(
            backend_name, endpoint, run_id, min_nodes, max_nodes, local_addr, **legacy, **tls
        )
        return get_rendezvous_handler(params)

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
        _create_etcd_client,
    )
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    params = RendezvousParameters(
        backend_name, endpoint, run_id, min_nodes, max_nodes, local_addr, read_timeout=10, **cfg, **tls
    )
    client = _create_etcd_client(params)
    backend = EtcdRendezvousBackend(client, run_id, key_prefix="/torch/elastic/rendezvous")
    store_timeout = None
    if settings.enabled("STORE_TIMEOUT"):
        # torch builds EtcdStore with the c10d default timeout (300 s). After a
        # round completes, non-zero ranks block in EtcdStore.get("MASTER_ADDR")
        # until rank 0 publishes it; if rank 0 dies in between they block ~300 s.
        # A short timeout raises LookupError, which our retry turns into a new round.
        store_timeout = timedelta(seconds=settings.store_timeout)
    store = EtcdStore(client, "/torch/elastic/store", timeout=store_timeout)
    return create_handler(store, backend, params)


def ours(handler: RendezvousHandler) -> Any:
    """The handler if it is petctl's own (petctl-etcd), else None."""
    from petctl_agent.rendezvous import PetctlRendezvousHandler

    return handler if isinstance(handler, PetctlRendezvousHandler) else None


def dynamic(handler: RendezvousHandler) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    return handler if isinstance(handler, DynamicRendezvousHandler) else None


def reset_lost_state(handler: RendezvousHandler) -> bool:
    """If etcd lost the rendezvous key (replaced/wiped etcd), forget our stale fencing token.

    torch's state holder keeps the etcd modifiedIndex it last saw; once the key is
    gone every write with ``prevIndex`` fails with EtcdKeyNotFound, which torch
    maps to RendezvousConnectionError -- forever. Returns True when it reset.
    """
    h = dynamic(handler)
    if h is None:
        return False
    holder = h._state_holder
    try:
        if holder._backend.get_state() is not None:
            return False
    except Exception:  # noqa: BLE001 - etcd still down: nothing to decide yet
        return False
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    log.warning("rendezvous state is gone from etcd (etcd replaced?): starting from a fresh state")
    holder._token = None
    holder._dirty = False
    holder._state = _RendezvousState()
    return True


def guard_join(handler: RendezvousHandler, leave: Event) -> None:
    """Make a leave request (``leave`` set) take effect *inside* torch's join loop (etcd-v2).

    torch's join op runs in the agent's main thread and cannot be interrupted. If another
    thread removed us from the round meanwhile, the join loop would add us back: a
    ghost that a round can complete with. Instead the join op itself checks the
    leave request at every iteration: it removes us (participants, wait list or
    redundancy list) with the same state write torch uses, then raises
    :class:`LeftRendezvous` before the round can count us. Idempotent per handler.
    """
    h = dynamic(handler)
    if h is None or getattr(h, "_petctl_guarded", False):
        return
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousJoinOp

    executor = h._op_executor
    orig_run = executor.run

    def leaving_join(op: Any) -> Callable[..., Any]:
        def state_handler(ctx: Any, deadline: float) -> Any:
            if not leave.is_set():
                return op(ctx, deadline)
            st = ctx.state
            if ctx.node in st.participants:
                return _Action.REMOVE_FROM_PARTICIPANTS
            if ctx.node in st.wait_list:
                return _Action.REMOVE_FROM_WAIT_LIST
            if ctx.node in getattr(st, "redundancy_list", ()):
                return _Action.REMOVE_FROM_REDUNDANCY_LIST
            log.info("left the rendezvous before round %s completed with us", st.round)
            raise LeftRendezvous("left the rendezvous (leave requested while joining)")

        return state_handler

    def run(state_handler: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = leaving_join(state_handler)
        return orig_run(state_handler, *args, **kwargs)

    executor.run = run
    h._petctl_guarded = True


def leave_round(handler: RendezvousHandler) -> bool:
    """Remove this node from the current round so the others re-form at once; True when done.

    Not ``handler.shutdown()``: that marks the whole rendezvous *closed* and every other
    node's next join fails with RendezvousClosedError. The legacy etcd handler cannot leave
    (peers notice through its key TTL): False.
    """
    mine = ours(handler)
    if mine is not None:
        mine.leave()  # deletes our membership key: the leader opens the next round at once
        return True
    h = dynamic(handler)
    if h is None:
        return False
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    h._stop_heartbeats()
    try:
        with h._heartbeat_lock:
            h._op_executor.run(_RendezvousExitOp(), time.monotonic() + 15)
        return True
    except Exception as e:  # noqa: BLE001 - peers fall back to heartbeat expiry
        log.warning("could not leave the rendezvous cleanly (%s); peers will expire us", e)
        return False
