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
import threading
import time
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
    RendezvousStateError,
    RendezvousTimeoutError,
)

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.status import StatusPublisher
from petctl_agent.workarounds import enabled, env_float

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


def rendezvous_config() -> dict[str, Any]:
    """Rendezvous timeouts/heartbeats, chosen by measurement (docs/agent.md)."""
    cfg: dict[str, Any] = {"join_timeout": int(env_float("PETCTL_AGENT_JOIN_TIMEOUT", 600))}
    if enabled("FAST_LAST_CALL"):
        # torch default last_call_timeout=30 s: every (re-)rendezvous with >= min
        # nodes waits 30 s for stragglers (DESIGN §4: 33 s start, 43 s join).
        cfg["last_call_timeout"] = int(env_float("PETCTL_AGENT_LAST_CALL", 5))
    if enabled("FAST_HEARTBEAT"):
        # torch default keep-alive 5 s x 3 attempts: a SIGKILLed node stays a
        # participant for ~15-20 s and the survivors' next round cannot start
        # (the round only advances when its participants are gone).
        cfg["keep_alive_interval"] = int(env_float("PETCTL_AGENT_KEEPALIVE", 1))
        cfg["keep_alive_max_attempt"] = int(env_float("PETCTL_AGENT_KEEPALIVE_ATTEMPTS", 5))
    return cfg


def create_rdzv_handler(
    endpoint: str, run_id: str, min_nodes: int, max_nodes: int, local_addr: str
) -> RendezvousHandler:
    """Build the rendezvous handler (backend ``$PETCTL_AGENT_RDZV_BACKEND``, default ``etcd-v2``)."""
    backend_name = os.environ.get("PETCTL_AGENT_RDZV_BACKEND", "etcd-v2")
    cfg = rendezvous_config()
    if backend_name != "etcd-v2":
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        legacy = {"last_call_timeout": cfg.get("last_call_timeout", 30), "timeout": cfg["join_timeout"]}
        params = RendezvousParameters(
            backend_name, endpoint, run_id, min_nodes, max_nodes, local_addr, **legacy
        )
        return get_rendezvous_handler(params)

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
        _create_etcd_client,
    )
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    params = RendezvousParameters(
        backend_name, endpoint, run_id, min_nodes, max_nodes, local_addr, read_timeout=10, **cfg
    )
    client = _create_etcd_client(params)
    backend = EtcdRendezvousBackend(client, run_id, key_prefix="/torch/elastic/rendezvous")
    store_timeout = None
    if enabled("STORE_TIMEOUT"):
        # torch builds EtcdStore with the c10d default timeout (300 s). After a
        # round completes, non-zero ranks block in EtcdStore.get("MASTER_ADDR")
        # until rank 0 publishes it; if rank 0 dies in between they block ~300 s.
        # A short timeout raises LookupError, which our retry turns into a new round.
        store_timeout = timedelta(seconds=env_float("PETCTL_AGENT_STORE_TIMEOUT", 20))
    store = EtcdStore(client, "/torch/elastic/store", timeout=store_timeout)
    return create_handler(store, backend, params)


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
    (with :attr:`fail_reason`).
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
        restart_launch: tuple[str, Any, tuple[str, ...]] | None = None,
    ) -> None:
        super().__init__(spec, logs_specs, start_method="spawn", exit_barrier_timeout=exit_barrier_timeout)
        self._restart_launch = restart_launch  # (start_method, entrypoint, args) for restarts
        self.pub = publisher
        self.drain_file = Path(drain_file)
        self.progress_file = Path(progress_file)
        self._workers_started_at = time.time()
        self.drain_timeout = drain_timeout
        self.leave_requested = threading.Event()
        self.leave_reason = ""
        self.phase = "init"  # init | rendezvous | running | draining | done
        self.outcome: str | None = None
        self.fail_reason: str | None = None
        self._rdzv_reason = "initial"
        self._round: int | None = None
        self._members: set[Any] | None = None
        self._restarts = 0
        self._last_etcd_warn = 0.0
        self.sync_timeout = env_float("PETCTL_AGENT_SYNC_TIMEOUT", min(max(drain_timeout, 5.0), 30.0))

    # ---- rendezvous ------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.phase = "rendezvous"
        self.pub.update(state="RENDEZVOUS")
        self.pub.event("rendezvous_start", reason=self._rdzv_reason, round=self._round)
        started = time.time()
        deadline = time.monotonic() + env_float("PETCTL_AGENT_JOIN_TIMEOUT", 600)
        handler = worker_group.spec.rdzv_handler
        attempt = 0
        while True:
            try:
                super()._rendezvous(worker_group)
                break
            except RendezvousClosedError:
                raise
            except TRANSIENT_RDZV_ERRORS as e:
                attempt += 1
                if not enabled("RDZV_RETRY"):
                    raise
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(
                        f"no complete round within the join timeout; last error {type(e).__name__}: {e}"
                    ) from e
                # torch lets these escape agent.run(): an etcd restart or a peer
                # dying between "round complete" and "MASTER_ADDR published" would
                # kill the agent. Retry: the next attempt exits and re-joins a round.
                log.warning("rendezvous attempt %d failed (%s: %s); retrying", attempt, type(e).__name__, e)
                reset_lost_state(handler)
                time.sleep(min(0.5 * attempt, 3.0))
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

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        try:
            self.drain_file.unlink()
        except FileNotFoundError:
            pass
        pids = super()._start_workers(worker_group)
        self._workers_started_at = time.time()
        if self._restart_launch is not None:
            self._switch_to_forkserver(worker_group)
        self.phase = "running"
        self.pub.update(state="RUNNING", restarts=self._restarts)
        self.pub.event(
            "workers_started",
            round=self._round,
            world_size=worker_group.workers[0].world_size,
            pids=list(pids.values()),
        )
        return pids

    def _switch_to_forkserver(self, worker_group: WorkerGroup) -> None:
        """After the first start: warm a torch-preloaded forkserver in the background and
        launch every later (re)start from it (see ``petctl_agent.worker``)."""
        import multiprocessing
        import multiprocessing.forkserver

        from petctl_agent.worker import PRELOAD

        method, entrypoint, args = self._restart_launch
        self._restart_launch = None
        multiprocessing.set_forkserver_preload(PRELOAD)
        threading.Thread(
            target=multiprocessing.forkserver.ensure_running, name="petctl-forkserver", daemon=True
        ).start()
        self._start_method = method
        worker_group.spec.entrypoint = entrypoint
        worker_group.spec.args = args

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        super()._restart_workers(worker_group)

    # ---- main loop (replaces SimpleElasticAgent._invoke_run) -------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        wg = self._worker_group
        spec = wg.spec
        self._initialize_workers(wg)
        check_every = env_float("PETCTL_AGENT_MEMBERSHIP_INTERVAL", 1.0)
        next_check = time.monotonic() + check_every
        while True:
            time.sleep(spec.monitor_interval)
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
                codes = sorted({f.exitcode for f in result.failures.values()})
                if codes == [DRAIN_EXIT_CODE]:
                    # every failed worker stopped on purpose at a drain checkpoint
                    # (another node is leaving or joining): re-form, no budget spent.
                    self._rdzv_reason = "coordinated checkpoint (peer drain/scale)"
                    self._restart_workers(wg)
                    continue
                self.pub.event(
                    "workers_failed", round=self._round, exit_codes=codes, failures=_describe(result)
                )
                if self._remaining_restarts > 0:
                    self._remaining_restarts -= 1
                    self._rdzv_reason = f"workers failed (exit codes {codes})"
                    self._restart_workers(wg)
                    continue
                self._stop_workers(wg)
                wg.state = WorkerState.FAILED
                self.outcome = "failed"
                self.fail_reason = f"workers failed after {spec.max_restarts} restarts: {_describe(result)}"
                return result
            if result.state == WorkerState.HEALTHY and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every
                change, can_sync = self._membership_change()
                if change:
                    self._rdzv_reason = change
                    log.info("re-rendezvous: %s", change)
                    if can_sync and enabled("SYNC_RESTART") and self._workers_progressed():
                        done = self._coordinated_stop(wg, self.sync_timeout)
                        if done is not None:
                            return done
                        if self.leave_requested.is_set():
                            return self._drain_and_leave(wg)
                    self._restart_workers(wg)

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
        try:
            waiting = handler.num_nodes_waiting()
        except Exception as e:  # noqa: BLE001
            if not enabled("ETCD_OUTAGE"):
                raise  # torch: the exception escapes _invoke_run and the agent dies
            # The workers do not need etcd while they train: keep them running
            # through an etcd restart instead of failing the whole job.
            if time.monotonic() - self._last_etcd_warn > 10:
                log.warning("rendezvous backend unreachable while training (%s); workers keep running", e)
                self._last_etcd_warn = time.monotonic()
            reset_lost_state(handler)
            return None, False
        if waiting > 0:
            return f"{waiting} node(s) waiting to join", True
        h = _dynamic(handler)
        if h is None or not enabled("MEMBERSHIP_WATCH"):
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
        self.phase = "draining"
        self.pub.update(state="DRAINING", reason=self.leave_reason)
        self.pub.event("drain_requested", reason=self.leave_reason, round=self._round)
        self.drain_file.touch()
        t0 = time.monotonic()
        deadline = t0 + self.drain_timeout
        result = RunResult(state=WorkerState.HEALTHY)
        while time.monotonic() < deadline:
            result = self._monitor_workers(wg)
            if result.state != WorkerState.HEALTHY:
                break
            time.sleep(0.1)
        clean = result.state == WorkerState.SUCCEEDED or (
            result.state == WorkerState.FAILED
            and {f.exitcode for f in result.failures.values()} == {DRAIN_EXIT_CODE}
        )
        self._stop_workers(wg)
        self.leave_rendezvous()
        self.phase = "done"
        self.outcome = "drained"
        self.pub.event(
            "drained",
            clean=clean,
            seconds=round(time.monotonic() - t0, 3),
            round=self._round,
        )
        # torch's run() records one event per worker and insists every worker has a result
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in wg.workers})

    def leave_rendezvous(self) -> None:
        """Remove this node from the current round so the others re-form at once.

        Not ``handler.shutdown()``: that marks the whole rendezvous *closed* and
        every other node's next join fails with RendezvousClosedError.
        """
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
