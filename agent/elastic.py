"""torch elastic integration: the rendezvous handler and petctl's ``LocalElasticAgent``.

We drive torch's own ``LocalElasticAgent`` + ``WorkerSpec`` (not a home-made
launcher) and override a few hooks to (a) publish status/events, (b) run the
drain protocol and leave the rendezvous without closing it for everyone, and
(c) work around torch behaviours that stall elastic jobs. Every workaround names
the torch behaviour it answers and can be switched off (see ``workarounds.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import urllib3.exceptions
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.settings import EtcdTls, Settings
from petctl_agent.spec import RDZV_BACKENDS, rdzv_backend  # noqa: F401 - rdzv_backend re-exported
from petctl_agent.status import StatusPublisher

log = logging.getLogger("petctl_agent.elastic")

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


#: exit "codes" of local ranks torch terminated after a sibling stopped: SIGTERM, then SIGKILL
#: once its grace period ran out (``PContext.close``)
TERMINATED_BY_TORCH = frozenset({-int(signal.SIGTERM), -int(signal.SIGKILL)})


class _NoAgentTraceback(logging.Filter):
    """Log a worker's exit without the agent-side traceback (its text stays in the message).

    torch logs every worker exit with ``logger.exception``; torch's log formatter imports
    ``torch._dynamo`` the first time it formats an exception: 1-3 s in the agent on a busy
    2-core box, spent between the workers' exit and the re-rendezvous (measured: the first
    drain of every agent stalled ~2 s in ``MultiprocessContext._poll``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_worker_exit_tracebacks() -> None:
    """Install :class:`_NoAgentTraceback` on torch's worker-process logger (idempotent)."""
    lg = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoAgentTraceback) for f in lg.filters):
        lg.addFilter(_NoAgentTraceback())


class LeftRendezvous(Exception):
    """This node was asked to leave while it was inside a rendezvous, and left it."""


def classify_exits(codes: Iterable[int | None]) -> str:
    """``drain`` or ``failure``: why a node's worker processes stopped.

    ``drain``: at least one local rank exited ``DRAIN_EXIT_CODE`` (it stopped on purpose
    after the coordinated checkpoint) and every other failed rank did too or was
    terminated by torch afterwards (-15, or -9 past torch's grace period): when one
    local rank exits, torch SIGTERMs its siblings. Everything else is a ``failure``.
    ``codes`` are the exit codes of the failed ranks only (torch leaves out ranks that exited 0).
    """
    seen = [c for c in codes]
    if DRAIN_EXIT_CODE not in seen:
        return "failure"
    if all(c == DRAIN_EXIT_CODE or c in TERMINATED_BY_TORCH for c in seen):
        return "drain"
    return "failure"


def capacity_coming(capacity: dict[str, int] | None, min_nodes: int) -> bool | None:
    """Does the worker group still bring us to ``min_nodes``? None = unknown (no group, API error).

    Yes while it has instances pending (launching) or a desired capacity of at least ``min_nodes``.
    """
    if capacity is None:
        return None
    return capacity.get("pending", 0) > 0 or capacity.get("desired", 0) >= min_nodes


def keep_waiting(elapsed: float, join_timeout: float, coming: bool | None) -> bool:
    """Below MIN after a rendezvous attempt timed out: wait on (True) or fail (False)?

    Always within ``join_timeout``. Past it only while the group says capacity is still
    coming (instances pending, or desired >= MIN: a capacity shortage, slow spot), and
    never past twice ``join_timeout`` (a group that never delivers must not bill forever).
    """
    if elapsed < join_timeout:
        return True
    return bool(coming) and elapsed < 2 * join_timeout


def describe_capacity(capacity: dict[str, int] | None) -> str:
    if capacity is None:
        return "worker group capacity unknown"
    return (
        f"worker group desired {capacity.get('desired', '?')}, in service {capacity.get('in_service', '?')}, "
        f"pending {capacity.get('pending', '?')}"
    )


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
) -> RendezvousHandler:
    """Build the rendezvous handler for ``backend`` (default :func:`rdzv_backend`: petctl-etcd).

    ``expected_nodes``: the worker group's desired capacity (a hint that turns a burst of
    joins into one round); only petctl-etcd uses it, and calls it at most once a second
    from its control thread, so it must not block.
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
            config=Config(join_timeout=float(cfg["join_timeout"]), **tls),
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


def _ours(handler: RendezvousHandler) -> Any:
    """The handler if it is petctl's own (petctl-etcd), else None."""
    from petctl_agent.rendezvous import PetctlRendezvousHandler

    return handler if isinstance(handler, PetctlRendezvousHandler) else None


def _dynamic(handler: RendezvousHandler) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    return handler if isinstance(handler, DynamicRendezvousHandler) else None


def reset_lost_state(handler: RendezvousHandler) -> bool:
    """If etcd lost the rendezvous key (replaced/wiped etcd), forget our stale fencing token.

    torch's state holder keeps the etcd modifiedIndex it last saw; once the key is
    gone every write with ``prevIndex`` fails with EtcdKeyNotFound, which torch
    maps to RendezvousConnectionError -- forever. Returns True when it reset.
    """
    h = _dynamic(handler)
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


class PetctlElasticAgent(LocalElasticAgent):
    """torch's LocalElasticAgent plus petctl's drain protocol, status and stall workarounds.

    Outcome after :meth:`run` in :attr:`outcome`: ``succeeded``, ``drained`` or ``failed``
    (with :attr:`fail_reason`; :attr:`fail_kind` ``join_timeout`` for a rendezvous that
    never reached ``min_nodes``, which is not a reason to stop the whole job).

    Restart budget (``WorkerSpec.max_restarts``, torch's ``_remaining_restarts``): only
    worker failures that no membership change explains spend it. Joins, drains
    (``classify_exits``) and lost peers (the participants changed within the heartbeat
    expiry after the failure) restart for free.
    """

    def __init__(
        self,
        spec: Any,
        logs_specs: Any,
        publisher: StatusPublisher,
        drain_file: Path,
        progress_file: Path,
        drain_timeout: float,
        exit_barrier_timeout: float = 120,
        join_timeout: float = 1800,
        capacity_probe: Callable[[], dict[str, int] | None] | None = None,
        min_nodes: int = 1,
        start_method: str = "spawn",
        step_info: Callable[[], dict[str, Any]] | None = None,
        settings: Settings = Settings(),
    ) -> None:
        super().__init__(
            spec, logs_specs, start_method=start_method, exit_barrier_timeout=exit_barrier_timeout
        )
        self.pub = publisher
        self.settings = settings
        self.drain_file = Path(drain_file)
        #: called right before each (re)start of the workers (main.py: flush the log tailer)
        self.before_workers_start: Callable[[], None] | None = None
        self.progress_file = Path(progress_file)
        self._workers_started_at = time.time()
        self.drain_timeout = drain_timeout
        self.join_timeout = join_timeout_s(join_timeout, settings)
        self.capacity_probe = capacity_probe or (lambda: None)
        self.min_nodes = min_nodes
        #: () -> {"last_step", "last_checkpoint_step"} (what the status document shows)
        self.step_info = step_info or (lambda: {})
        self.leave_requested = threading.Event()
        self.leave_reason = ""
        self.phase = "init"  # init | rendezvous | running | draining | done
        self.outcome: str | None = None
        self.fail_reason: str | None = None
        self.fail_kind: str | None = None
        self._rdzv_reason = "initial"
        self._round: int | None = None
        self._members: set[Any] | None = None
        self._restarts = 0
        self._free_restarts = 0
        self._last_etcd_warn = 0.0
        self._guarded: Any = None
        self._rdzv_down_since: float | None = None  # etcd unreachable while training (event published)
        self.sync_timeout = (
            min(max(drain_timeout, 5.0), 30.0) if settings.sync_timeout is None else settings.sync_timeout
        )
        # torch 2.5-2.8 install their own SIGTERM/SIGINT handler every time workers start
        # (PContext.start); ours turn SIGTERM into a drain. Remember them to put them back.
        self._own_signal_handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                h = signal.getsignal(sig)
                if callable(h) and h not in (signal.default_int_handler,):
                    self._own_signal_handlers[sig] = h

    # ---- rendezvous ------------------------------------------------------------------
    def request_leave(self, reason: str) -> None:
        """Leave the job (drain while training; leave the round at once while joining one).

        With petctl-etcd a node inside ``next_rendezvous`` leaves from this (watcher) thread:
        ``handler.leave()`` deletes its membership key and ``next_rendezvous`` raises
        ``RendezvousLeftError``, which :meth:`_rendezvous` turns into :class:`LeftRendezvous`.
        (``phase`` is set before the leave request is read there, and the request is set
        before ``phase`` is read here: one of the two sides always sees the other.)
        """
        self.leave_reason = reason
        self.leave_requested.set()
        h = _ours(self._worker_group.spec.rdzv_handler)
        if h is not None and self.phase == "rendezvous":
            h.leave()

    def _last_step(self) -> Any:
        try:
            return self.step_info().get("last_step")
        except Exception:  # noqa: BLE001 - status detail only
            return None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.phase = "rendezvous"
        handler = worker_group.spec.rdzv_handler
        ours = _ours(handler)
        if self.leave_requested.is_set():
            if ours is not None:
                ours.leave()
            raise LeftRendezvous("asked to leave before joining the rendezvous")
        self.pub.update(state="RENDEZVOUS")
        self.pub.event(
            "rendezvous_start", reason=self._rdzv_reason, round=self._round, step=self._last_step()
        )
        started = time.time()
        t0 = time.monotonic()
        if ours is None:
            self._guard_join(handler)
        attempt = 0
        while True:
            try:
                super()._rendezvous(worker_group)
                break
            except RendezvousClosedError:
                raise
            except RendezvousGracefulExitError as e:  # petctl-etcd: we left (request_leave) while joining
                raise LeftRendezvous(f"left the rendezvous while joining ({e})") from None
            except RendezvousTimeoutError:
                # torch's join timeout is one attempt; the job's bound is join_timeout, and
                # past it we still wait while the worker group says capacity is coming.
                elapsed = time.monotonic() - t0
                capacity = self._probe_capacity()
                coming = capacity_coming(capacity, self.min_nodes)
                if not keep_waiting(elapsed, self.join_timeout, coming):
                    self.fail_kind = "join_timeout"
                    raise RendezvousTimeoutError(
                        f"below min_nodes for {elapsed:.0f}s (join_timeout {self.join_timeout:.0f}s; "
                        f"{describe_capacity(capacity)})"
                    ) from None
                log.info(
                    "still below min_nodes after %.0fs (%s); waiting on", elapsed, describe_capacity(capacity)
                )
                self.pub.update(reason=f"waiting for nodes ({describe_capacity(capacity)})")
            except TRANSIENT_RDZV_ERRORS as e:
                attempt += 1
                if not self.settings.enabled("RDZV_RETRY"):
                    raise
                if time.monotonic() - t0 > self.join_timeout:
                    self.fail_kind = "join_timeout"
                    raise RendezvousTimeoutError(
                        f"no complete round within the join timeout; last error {type(e).__name__}: {e}"
                    ) from e
                # torch lets these escape agent.run(): an etcd restart or a peer
                # dying between "round complete" and "MASTER_ADDR published" would
                # kill the agent. Retry: the next attempt exits and re-joins a round.
                log.warning("rendezvous attempt %d failed (%s: %s); retrying", attempt, type(e).__name__, e)
                reset_lost_state(handler)
                time.sleep(min(0.5 * attempt, 3.0))
            if self.leave_requested.is_set():
                if ours is not None:
                    ours.leave()
                raise LeftRendezvous("asked to leave while waiting to join")
        if ours is not None and self.leave_requested.is_set():
            # the round closed with us just as the leave came: leave it before any worker starts
            ours.leave()
            raise LeftRendezvous("asked to leave as the round closed")
        self.pub.update(reason=None)
        if ours is not None:
            self._round, self._members = ours.round, set((ours.record or {}).get("participants", []))
        h = _dynamic(handler)
        if h is not None:
            st = h._state_holder.state
            self._round, self._members = st.round, set(st.participants)
        world = worker_group.workers[0].world_size if worker_group.workers else None
        self.pub.update(world_size=world, round=self._round)
        self.pub.event(
            "rendezvous_done",
            round=self._round,
            world_size=world,
            nodes=worker_group.group_world_size,
            group_rank=worker_group.group_rank,
            reason=self._rdzv_reason,
            started=started,
            seconds=round(time.time() - started, 3),
        )

    def _probe_capacity(self) -> dict[str, int] | None:
        try:
            return self.capacity_probe()
        except Exception as e:  # noqa: BLE001 - unknown capacity: decide on the join timeout alone
            log.warning("cannot read the worker group's capacity (%s)", e)
            return None

    def _guard_join(self, handler: RendezvousHandler) -> None:
        """Make a leave request take effect *inside* torch's join loop.

        torch's join op runs in this (main) thread and cannot be interrupted. If another
        thread removed us from the round meanwhile, the join loop would add us back: a
        ghost that a round can complete with. Instead the join op itself checks the
        leave request at every iteration: it removes us (participants, wait list or
        redundancy list) with the same state write torch uses, then raises
        :class:`LeftRendezvous` before the round can count us.
        """
        h = _dynamic(handler)
        if h is None or self._guarded is h:
            return
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousJoinOp

        executor = h._op_executor
        orig_run = executor.run
        leave = self.leave_requested

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
        self._guarded = h

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        try:
            self.drain_file.unlink()
        except FileNotFoundError:
            pass
        if self.before_workers_start is not None:
            # torch rmtree()s and re-creates attempt_<n>/ when the restart count is unchanged:
            # read the last lines of the workers that just stopped before they are deleted
            # (with fast restarts the log tailer's next poll came too late: "step=103" lost).
            try:
                self.before_workers_start()
            except Exception as e:  # noqa: BLE001 - logs must never stop a restart
                log.debug("before_workers_start: %s", e)
        pids = super()._start_workers(worker_group)
        self._restore_signal_handlers()
        self._workers_started_at = time.time()
        self.phase = "running"
        self.pub.update(state="RUNNING", restarts=self._restarts)
        try:
            resume = self.step_info().get(
                "last_checkpoint_step"
            )  # the state they load: they train resume+1 on
        except Exception:  # noqa: BLE001
            resume = None
        self.pub.event(
            "workers_started",
            round=self._round,
            world_size=worker_group.workers[0].world_size,
            pids=list(pids.values()),
            step=resume,
            start_method=self._start_method,
        )
        return pids

    def _restore_signal_handlers(self) -> None:
        """Put our SIGTERM/SIGINT handlers back if torch replaced them while starting workers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._own_signal_handlers.items():
            if signal.getsignal(sig) is not handler:
                log.info("torch replaced the %s handler; re-installing the agent's", signal.Signals(sig).name)
                signal.signal(sig, handler)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        super()._restart_workers(worker_group)

    def _free_restart(self, wg: WorkerGroup, reason: str) -> None:
        """Restart for a membership change: the restart budget is not touched."""
        self._free_restarts += 1
        self._rdzv_reason = reason
        self._restart_workers(wg)

    # ---- main loop (replaces SimpleElasticAgent._invoke_run) -------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        wg = self._worker_group
        self._initialize_workers(wg)
        check_every = self.settings.membership_interval
        next_check = time.monotonic() + check_every
        while True:
            ours = _ours(wg.spec.rdzv_handler)
            if ours is not None and wg.state == WorkerState.HEALTHY:
                # petctl-etcd's watches bring a membership change: wake up the moment one does,
                # and look at it on every pass (pending_change reads local state, no request)
                ours.wait_for_change(wg.spec.monitor_interval)
                next_check = 0.0
            else:
                time.sleep(wg.spec.monitor_interval)
            if self.leave_requested.is_set():
                return self._drain_and_leave(wg)
            result = self._monitor_workers(wg)
            wg.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self.phase = "done"
                self.outcome = "succeeded"
                self._exit_barrier()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                done = self._on_workers_stopped(wg, result)
                if done is not None:
                    return done
                continue
            if result.state == WorkerState.HEALTHY and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every
                change, can_sync = self._membership_change()
                if change:
                    log.info("re-rendezvous: %s", change)
                    if can_sync and self.settings.enabled("SYNC_RESTART") and self._workers_progressed():
                        self._rdzv_reason = change
                        done = self._coordinated_stop(wg, self.sync_timeout)
                        if done is not None:
                            return done
                        if self.leave_requested.is_set():
                            return self._drain_and_leave(wg)
                    self._free_restart(wg, change)

    def _on_workers_stopped(self, wg: WorkerGroup, result: RunResult) -> RunResult | None:
        """Workers stopped with failures: a drain, a membership change, or a failure that
        spends the restart budget. Returns a RunResult only when the agent is done."""
        codes = sorted({f.exitcode for f in result.failures.values()}, key=lambda c: (c is None, c))
        if classify_exits(f.exitcode for f in result.failures.values()) == "drain":
            # every failed worker stopped on purpose at a drain checkpoint (a node is
            # leaving or joining; siblings torch terminated after it count too): re-form.
            self._free_restart(wg, "coordinated checkpoint (peer drain/scale)")
            return None
        if self.leave_requested.is_set():
            return self._drain_and_leave(wg)
        self.pub.event(
            "workers_failed",
            round=self._round,
            exit_codes=codes,
            failures=_describe(result),
            step=self._last_step(),
        )
        why = self._failure_explained()
        if why:
            log.info(
                "workers failed (exit codes %s) and %s: restarting, restart budget untouched", codes, why
            )
            self._free_restart(wg, f"workers failed (exit codes {codes}) after a membership change: {why}")
            return None
        if self.leave_requested.is_set():
            return self._drain_and_leave(wg)
        if self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            log.warning(
                "workers failed (exit codes %s), no membership change explains it: %d of %d restarts left",
                codes,
                self._remaining_restarts,
                wg.spec.max_restarts,
            )
            self._rdzv_reason = f"workers failed (exit codes {codes})"
            self._restart_workers(wg)
            return None
        self._stop_workers(wg)
        wg.state = WorkerState.FAILED
        self.outcome = "failed"
        self.fail_reason = f"workers failed after {wg.spec.max_restarts} restarts: {_describe(result)}"
        return result

    def _failure_explained(self) -> str | None:
        """Did the membership change around a worker failure (a peer died or left, a node is waiting)?

        A peer that died is dropped from the round only after the heartbeat expiry, while
        our workers' collectives fail at once: look for up to that long
        (``PETCTL_AGENT_FAILURE_GRACE``; default: petctl-etcd's key TTL + 1.5 s (3.5 s),
        torch's keep-alive x attempts + 2 s (7 s)).
        """
        ours = _ours(self._worker_group.spec.rdzv_handler)
        if ours is not None:
            default = ours.cfg.ttl + 1.5
        else:
            cfg = rendezvous_config(self.join_timeout, self.settings)
            default = cfg.get("keep_alive_interval", 5) * cfg.get("keep_alive_max_attempt", 3) + 2
        grace = self.settings.failure_grace
        deadline = time.monotonic() + (default if grace is None else grace)
        while True:
            change, _ = self._membership_change()
            if change:
                return change
            left = deadline - time.monotonic()
            if left <= 0 or self.leave_requested.is_set():
                return None
            if ours is not None:
                ours.wait_for_change(min(left, 0.25))
            else:
                time.sleep(0.25)

    def _uses_helper(self) -> bool:
        """Has any worker on this node ever reported progress? Then the script uses the helper
        (``petctl_agent.checkpoint``) and stops by itself at a drain checkpoint."""
        return self.progress_file.exists()

    def _workers_progressed(self) -> bool:
        """Have the current workers reported a step? (If not, there is nothing to checkpoint.)"""
        try:
            return self.progress_file.stat().st_mtime > self._workers_started_at
        except OSError:
            return False

    def _membership_change(self) -> tuple[str | None, bool]:
        """Why the worker group must re-form now (or None), and whether the current
        workers can still take a coordinated checkpoint first (all peers alive)."""
        handler = self._worker_group.spec.rdzv_handler
        ours = _ours(handler)
        if ours is not None:
            # petctl-etcd: never raises, never makes a request; its watches heal by themselves
            self._note_rdzv_reachable(ours.connected, "etcd watch disconnected")
            ch = ours.pending_change()
            if ch is None:
                return None, False
            gone = list(ch.get("gone") or [])
            waiting = list(ch.get("waiting") or [])
            why = f"{ch['reason']} (round {ch['round']}"
            why += f"; waiting: {len(waiting)}" if waiting else ""
            why += f"; gone: {', '.join(gone)}" if gone else ""
            # a coordinated checkpoint needs every participant: only when nobody is gone
            return why + ")", not gone
        try:
            waiting = handler.num_nodes_waiting()
        except Exception as e:  # noqa: BLE001
            if not self.settings.enabled("ETCD_OUTAGE"):
                raise  # torch: the exception escapes _invoke_run and the agent dies
            # The workers do not need etcd while they train: keep them running
            # through an etcd restart instead of failing the whole job.
            self._note_rdzv_reachable(False, f"{type(e).__name__}: {e}")
            if time.monotonic() - self._last_etcd_warn > 10:
                log.warning("rendezvous backend unreachable while training (%s); workers keep running", e)
                self._last_etcd_warn = time.monotonic()
            reset_lost_state(handler)
            return None, False
        self._note_rdzv_reachable(True, "")
        if waiting > 0:
            return f"{waiting} node(s) waiting to join", True
        h = _dynamic(handler)
        if h is None or not self.settings.enabled("MEMBERSHIP_WATCH"):
            return None, False
        # torch only looks at the wait list; a participant that died or left is
        # noticed only when our workers' collectives fail -- which can take the
        # whole collective timeout when a peer died during worker start-up.
        st = h._state_holder.state
        # A participant that is gone cannot join a drain all-reduce: restart at once.
        if st.round != self._round:
            return f"rendezvous round moved on ({self._round} -> {st.round})", False
        members = set(st.participants)
        if self._members is not None and members != self._members:
            gone = sorted(str(n) for n in self._members - members)
            return f"participant(s) left: {', '.join(gone) or '?'}", False
        return None, False

    def _note_rdzv_reachable(self, reachable: bool, detail: str) -> None:
        """Publish ``rdzv_unreachable`` / ``rdzv_recovered`` when etcd goes away / comes back
        while the workers train on (they do not need it)."""
        if not reachable and self._rdzv_down_since is None:
            self._rdzv_down_since = time.time()
            log.warning("rendezvous server unreachable while training (%s); workers keep running", detail)
            self.pub.event("rdzv_unreachable", round=self._round, step=self._last_step(), detail=detail[:200])
        elif reachable and self._rdzv_down_since is not None:
            down = time.time() - self._rdzv_down_since
            self._rdzv_down_since = None
            log.info("rendezvous server reachable again after %.1fs", down)
            self.pub.event(
                "rdzv_recovered", round=self._round, step=self._last_step(), seconds=round(down, 3)
            )

    def _coordinated_stop(self, wg: WorkerGroup, timeout: float) -> RunResult | None:
        """Ask the workers to checkpoint and stop (drain file); wait up to ``timeout``.

        Returns a RunResult only if the workers finished the job meanwhile.
        """
        self.drain_file.touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.leave_requested.is_set():
            result = self._monitor_workers(wg)
            if result.state == WorkerState.SUCCEEDED:
                self.phase = "done"
                self.outcome = "succeeded"
                self._exit_barrier()
                return result
            if result.state != WorkerState.HEALTHY:
                return None
            time.sleep(0.1)
        if not self.leave_requested.is_set():
            log.warning("workers did not stop at a checkpoint within %.0fs; stopping them", timeout)
        return None

    # ---- graceful leave --------------------------------------------------------------
    def _drain_and_leave(self, wg: WorkerGroup) -> RunResult:
        """Stop our workers for good, then leave the round.

        Workers that use the helper (something on this node reported progress, so they
        read the drain file) get the drain file: all ranks of all nodes checkpoint the
        same step and exit 75. Any other script (no progress within
        ``PETCTL_AGENT_DRAIN_PROBE`` s) -- and helper workers still running when the
        drain timeout is up -- gets SIGTERM, as torchrun does, and is waited for (the
        rest of the drain timeout, at least 5 s) before the node leaves the rendezvous.
        """
        self.phase = "draining"
        self.pub.update(state="DRAINING", reason=self.leave_reason)
        self.pub.event("drain_requested", reason=self.leave_reason, round=self._round, step=self._last_step())
        self.drain_file.touch()
        t0 = time.monotonic()
        deadline = t0 + self.drain_timeout
        result = self._monitor_workers(wg)
        if not self._uses_helper():
            # nothing on this node ever reported progress: a plain script, or helper
            # workers that have not reached their first step yet. Give them a moment.
            probe_end = min(deadline, t0 + self.settings.drain_probe)
            while time.monotonic() < probe_end and result.state == WorkerState.HEALTHY:
                if self._uses_helper():
                    break
                time.sleep(0.1)
                result = self._monitor_workers(wg)
        if self._uses_helper():
            while time.monotonic() < deadline and result.state == WorkerState.HEALTHY:
                time.sleep(0.1)
                result = self._monitor_workers(wg)
        sigterm = result.state == WorkerState.HEALTHY
        if sigterm:
            self._signal_workers(wg, signal.SIGTERM)
            grace = max(deadline - time.monotonic(), 5.0)
            end = time.monotonic() + grace
            while time.monotonic() < end and result.state == WorkerState.HEALTHY:
                time.sleep(0.1)
                result = self._monitor_workers(wg)
        codes = [f.exitcode for f in result.failures.values()]
        if sigterm:  # a plain script: clean if every worker ended on our SIGTERM, not our SIGKILL
            clean = result.state != WorkerState.HEALTHY and -int(signal.SIGKILL) not in codes
        else:
            clean = result.state == WorkerState.SUCCEEDED or (
                result.state == WorkerState.FAILED and classify_exits(codes) == "drain"
            )
        self._stop_workers(wg)
        self.leave_rendezvous()
        self.phase = "done"
        self.outcome = "drained"
        self.pub.event(
            "drained",
            clean=clean,
            sigterm=sigterm,
            exit_codes=sorted(set(codes), key=lambda c: (c is None, c)),
            seconds=round(time.monotonic() - t0, 3),
            round=self._round,
        )
        # torch's run() records one event per worker and insists every worker has a result
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in wg.workers})

    @staticmethod
    def _signal_workers(wg: WorkerGroup, sig: int) -> None:
        for w in wg.workers:
            if w.id is None:
                continue
            try:
                os.kill(int(w.id), sig)
            except (ProcessLookupError, ValueError, TypeError):
                pass

    def leave_rendezvous(self) -> None:
        """Remove this node from the current round so the others re-form at once.

        Not ``handler.shutdown()``: that marks the whole rendezvous *closed* and
        every other node's next join fails with RendezvousClosedError.
        """
        ours = _ours(self._worker_group.spec.rdzv_handler)
        if ours is not None:
            ours.leave()  # deletes our membership key: the leader opens the next round at once
            log.info("left the rendezvous (round %s)", self._round)
            return
        h = _dynamic(self._worker_group.spec.rdzv_handler)
        if h is None:
            return  # legacy etcd rendezvous: peers notice via the key TTL
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        h._stop_heartbeats()
        try:
            with h._heartbeat_lock:
                h._op_executor.run(_RendezvousExitOp(), time.monotonic() + 15)
            log.info("left the rendezvous (round %s)", self._round)
        except Exception as e:  # noqa: BLE001 - peers fall back to heartbeat expiry
            log.warning("could not leave the rendezvous cleanly (%s); peers will expire us", e)


def _describe(result: RunResult) -> str:
    parts = []
    for rank, f in sorted(result.failures.items()):
        msg = ""
        try:
            msg = f.message if isinstance(f.message, str) else str(f.message)
        except Exception:  # noqa: BLE001
            pass
        parts.append(
            f"rank {rank} exit {f.exitcode}" + (f" ({msg[:200]})" if msg and "<N/A>" not in msg else "")
        )
    return "; ".join(parts) or "unknown"
