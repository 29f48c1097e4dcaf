"""One node's agent, from the job spec to the job's end: the boot sequence as named steps.

``Agent.run``: read the spec, publish ``agent_started``, check torch, then :meth:`Agent._run`:
prepare the node (code, shared filesystem, dirs) -> wait while warmed -> build the rendezvous
handler -> warm the workers' forkserver -> build petctl's torch agent -> train -> finish
(``SUCCEEDED``, ``LEFT`` or ``FAILED``, and what each means for the job's groups).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from petctl_agent import EXIT_FAILED
from petctl_agent.cloud.fetch import load_spec
from petctl_agent.cloud.imds import Imds
from petctl_agent.cloud.status import StatusPublisher, make_writer
from petctl_agent.node import churn, crashes, ending, failure, jobenv
from petctl_agent.node.launching import Launching
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.node.preflight import check_etcd_tls, check_torch
from petctl_agent.node.preparing import Preparing
from petctl_agent.node.snapshots import SnapshotArea
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError, rdzv_backend
from petctl_agent.worker.env import (
    Paths,
    StepInfo,
    export_worker_env,
    job_checkpoint_dir,
)

log = logging.getLogger("petctl_agent")


class Agent(Preparing, Launching):
    """One node's agent: owns the status publisher, the IMDS watcher and the torch agent."""

    def __init__(self, args: argparse.Namespace, settings: Settings, imds: Imds) -> None:
        self.args = args
        self.settings = settings
        self.imds = imds
        self.paths = Paths(settings.agent_dir)
        self.efs = settings.efs_mount
        self.instance_id = imds.meta("instance-id") or socket.gethostname()
        self.local_addr = args.local_addr or imds.meta("local-ipv4") or "127.0.0.1"
        self.spec: JobSpec | None = None
        self.lifecycle: Lifecycle | None = None
        self.pub: StatusPublisher | None = None
        self.elastic: Any = None
        self.backend = "petctl-etcd"
        self.leave_reason: str | None = None
        #: in the warm pool (Warmed:*), joined nothing: a stop or termination exits quietly
        self.parked = False
        #: this instance's agent runs, to stop one that keeps failing (node/crashes.py)
        self.runs = crashes.Runs(settings.agent_dir / crashes.FILE)
        self.step_info = StepInfo(self.paths.progress)
        self._stop = threading.Event()
        #: the node's memory-snapshot store (made before the workers start, freed at the end)
        self.snapshots: SnapshotArea | None = None
        #: the job's environment (its requirements installed), which the workers run in
        self.job_env: jobenv.JobEnv | None = None

    # ---- leaving --------------------------------------------------------------------
    def request_leave(self, reason: str) -> None:
        """Leave the job (signal, scale-in, spot notice); the first reason wins. Any thread."""
        if self.leave_reason is not None:
            return
        self.leave_reason = reason
        log.info("leave requested: %s", reason)
        if not self.parked and self.elastic is None and self.lifecycle is not None:
            # Stopped while still preparing, before it published WARMED: the target state, not
            # the agent's phase, says whether this instance is in the pool.
            self.parked = self.lifecycle.state().startswith("Warmed:")
            if self.parked and self.pub:
                self.pub.update(state="WARMED", reason="warm pool: stopped while preparing")
                self.pub.flush()
        if self.parked:
            # AWS stops a warm pool instance once its boot is done (systemd's SIGTERM), and ends
            # pool instances the same way. It never joined: nothing to drain, and no LEFT, which
            # would tell `status` this node once trained. Its report stays WARMED.
            log.info("stopped in the warm pool: exiting, still WARMED")
            self.runs.end(True)
            os._exit(0)
        if self.elastic is not None:
            self.elastic.request_leave(reason)
        threading.Thread(target=self._leave_outside_training, name="petctl-leave", daemon=True).start()

    def _leave_outside_training(self) -> None:
        """A leave that arrives before the torch agent exists (boot: code, shared filesystem).

        Inside a rendezvous the main thread leaves by itself: the join loop checks the
        leave request at every iteration, removes us from the round and raises
        ``LeftRendezvous`` (``handlers.guard_join``); then ``_run`` completes the lifecycle
        action, publishes LEFT and returns. Only if the main thread is stuck elsewhere (a
        store read, ``PETCTL_AGENT_STORE_TIMEOUT``) for longer than
        ``PETCTL_AGENT_LEAVE_FALLBACK`` s does this thread leave the round and exit.
        """
        time.sleep(2)
        if self.elastic is not None:
            fallback = self.settings.leave_fallback
            deadline = time.monotonic() + fallback
            while time.monotonic() < deadline:
                if getattr(self.elastic, "phase", "init") in ("running", "draining", "done"):
                    return  # the training loop drains (it polls leave_requested every 0.2 s)
                time.sleep(0.5)
            phase = getattr(self.elastic, "phase", "init")
            if phase in ("running", "draining", "done"):
                return
            log.warning(
                "main thread did not leave within %.0fs (%s); leaving from the watcher", fallback, phase
            )
            self.elastic.leave_rendezvous()
        else:
            phase = "init"
            log.info("leaving during boot: no workers to drain")
        if self.pub:
            self.pub.event("drained", clean=True, phase=phase)
        self.free_snapshots()
        self.finish_leave()
        self.runs.end(True)
        os._exit(0)

    def finish_leave(self) -> int:
        """Complete a pending lifecycle action, publish LEFT; exit status 0."""
        return ending.finish_leave(self.lifecycle, self.pub, self.leave_reason)

    def free_snapshots(self) -> None:
        """Stop the persister and remove the node's snapshot store (job end, node leave). Idempotent."""
        area, self.snapshots = self.snapshots, None
        if area is not None:
            try:
                area.close()
            except Exception as e:  # noqa: BLE001 - the node's end must go on
                log.warning("freeing the snapshot store failed (ignored): %s", e)

    def fail(self, reason: str, rc: int = EXIT_FAILED) -> int:
        """Publish FAILED; exit status ``rc``."""
        return ending.fail(self.pub, reason, rc)

    def _failed_for_good(self, rc: int) -> None:
        """A terminal failure (not restarted by systemd) counts like a failed boot
        (``node/failure.py``): recorded in ``boot/``, the instance Unhealthy, and three of them
        with no workers ever started scale the job to zero."""
        if self.spec is None or self.lifecycle is None:
            return
        reason = (self.pub.snapshot().get("reason") if self.pub else None) or f"exit {rc}"
        try:
            failure.failed_for_good(rc, reason, self.spec, self.lifecycle, self.step_info.ckpt_dir)
        except Exception as e:  # noqa: BLE001 - it must not hide the failure itself
            log.warning("could not report the terminal failure (ignored): %s", e)

    # ---- run ------------------------------------------------------------------------
    def run(self) -> int:
        spec_url = self.args.spec or self.imds.tag("petctl:spec")
        if not spec_url:
            raise SpecError(
                "no job spec: pass --spec or set the instance tag petctl:spec (IMDS tags enabled?)"
            )
        self.spec = spec = load_spec(spec_url)
        self.lifecycle = Lifecycle(spec, self.imds, self.settings, self.instance_id)
        self.step_info.ckpt_dir = job_checkpoint_dir(self.efs, spec)
        self.pub = pub = StatusPublisher(
            make_writer(spec.status_url),
            spec.job_name,
            self.instance_id,
            self.local_addr,
            interval=self.settings.status_interval,
            # the job's training progress, for its node-failure cap (node/churn.py)
            refresh=churn.ProgressMark(self.step_info, make_writer(failure.boot_url(spec.status_url))),
        )
        pub.start()
        pub.event("agent_started", local_addr=self.local_addr, pid=os.getpid())
        threading.Thread(
            target=self.lifecycle.launch_heartbeats, name="petctl-launch-hb", daemon=True
        ).start()
        rc = EXIT_FAILED
        failures, last = self.runs.begin()
        try:
            if failures >= self.settings.failure_limit:
                rc = self.fail(
                    f"the agent ended unclean {failures} times on this instance (the last: {last}); "
                    "not running it again",
                    failure.exit_status("agent_failures"),
                )
                return rc
            rc = self._checked_run(spec)
            return rc
        finally:
            self.free_snapshots()  # job end, node left, gave up or crashed: the memory goes
            reason = pub.snapshot().get("reason") or ""
            self.runs.end(rc == 0 or failure.is_terminal(rc), f"exit {rc}: {reason}".rstrip(": "))
            if failure.is_terminal(rc):
                self._failed_for_good(rc)
            pub.close()

    def _checked_run(self, spec: JobSpec) -> int:
        assert self.pub is not None and self.lifecycle is not None
        pub = self.pub
        try:
            try:
                self.backend = rdzv_backend(spec.rdzv_backend, self.settings.rdzv_backend)
                check_etcd_tls(self.settings)
            except ValueError as e:
                raise SpecError(str(e)) from None
            pub.update(rdzv_backend=self.backend)
            problem = check_torch(spec.torch_version, self.backend)
            if problem:  # before anything joins the rendezvous
                rc = self.fail(problem, failure.exit_status("torch"))
                self.lifecycle.complete_action_at_end(0)
                return rc
            return self._run(spec)
        except jobenv.RequirementsError as e:  # the same on every node: terminal, like a wrong torch
            rc = self.fail(
                f"the job's requirements did not install: {e}", failure.exit_status("requirements")
            )
            self.lifecycle.complete_action_at_end(0)
            return rc
        except SpecError as e:
            return self.fail(str(e), failure.exit_status("spec"))
        except Exception as e:  # noqa: BLE001 - report any crash as FAILED with its reason
            log.exception("agent failed")
            return self.fail(f"{type(e).__name__}: {e}")

    def _run(self, spec: JobSpec) -> int:
        endpoint = self._rdzv_endpoint(spec)
        script, ckpt_dir, work_dir = self._prepare_node(spec)
        self._wait_while_warmed()  # before the forkserver's imports and before registering
        if self.leave_reason:
            return self.finish_leave()
        nproc = spec.resolved_nproc()
        if self.settings.snapshots and self.snapshots is None and not spec.live:
            self.snapshots = SnapshotArea.open(
                self.settings.snapshot_dir,
                spec.job_name,
                self.instance_id,
                self.pub,
                serve_addr=self.local_addr if self.settings.snapshot_fetch else None,
            )
        export_worker_env(
            os.environ,
            spec,
            self.paths,
            ckpt_dir,
            work_dir,
            self.local_addr,
            nproc,
            self.backend,
            self.settings,
            snapshot_dir=self.snapshots.dir if self.snapshots else None,
        )
        if self.job_env is not None:  # a forkserver worker puts it first (worker/forkserver.py)
            os.environ["PETCTL_JOB_ENV"] = str(self.job_env.path)
        if spec.live:
            return self._run_live(spec, endpoint, script, nproc, ckpt_dir, work_dir)
        handler = self._rendezvous_handler(spec, endpoint)
        entrypoint, entry_args, start_method = self._worker_entrypoint(spec, script)
        if self.leave_reason:  # arrived while we were warming up
            return self.finish_leave()
        agent = self._elastic_agent(spec, handler, nproc, entrypoint, entry_args, start_method)
        outcome = self._train(spec, agent, work_dir)
        # before LEFT/SUCCEEDED: a leaving node's persister ends its write before the instance goes
        self.free_snapshots()
        return self._finish(agent, handler, outcome, ckpt_dir)

    def _run_live(
        self, spec: JobSpec, endpoint: str, script: Path, nproc: int, ckpt_dir: Path, work_dir: Path
    ) -> int:
        """``run-job --live``: the workers are torchft replica groups the agent starts once
        (node/live.py); no torch rendezvous, no torch agent."""
        from petctl_agent.node.live import LiveNode, lighthouse_url

        assert self.pub is not None
        node = LiveNode(
            python=str(self.job_env.python) if self.job_env else sys.executable,
            script=script,
            args=tuple(spec.args),
            nproc=nproc,
            env=os.environ,
            lighthouse=lighthouse_url(endpoint, spec.lighthouse_port),
            replica_id=self.instance_id,
            logs_dir=self.paths.logs,
            work_dir=work_dir,
            drain_file=self.paths.drain,
            drain_timeout=spec.drain_timeout,
            max_restarts=spec.max_restarts,
            pub=self.pub,
        )
        self.pub.update(live=True)
        self.elastic = node
        if self.leave_reason:  # arrived while we were setting up
            node.request_leave(self.leave_reason)
        outcome = self._train(spec, node, work_dir)
        return self._finish(node, None, outcome, ckpt_dir)

    # ---- the steps of _run ----------------------------------------------------------
    def _rdzv_endpoint(self, spec: JobSpec) -> str:
        ep = self.args.rdzv_endpoint or self.imds.tag("petctl:rdzv")
        if not ep:
            raise SpecError(
                "no rendezvous endpoint: pass --rdzv-endpoint or set the instance tag petctl:rdzv"
            )
        return ep if ":" in ep else f"{ep}:{spec.rdzv_port}"

    def _finish(self, agent: Any, handler: Any, outcome: Any, ckpt_dir: Path) -> int:
        """What the outcome means for this node and for the job (``ending.finish``)."""
        assert self.pub is not None and self.lifecycle is not None
        return ending.finish(
            outcome,
            agent.fail_reason,
            handler,
            ckpt_dir,
            self.pub,
            self.lifecycle,
            leave_reason=self.leave_reason,
            lifecycle_wait=self.settings.lifecycle_wait,
            last_step=lambda: self.step_info().get("last_step"),
        )
