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
from petctl_agent.cloud import aws
from petctl_agent.cloud.fetch import fetch_code, load_spec
from petctl_agent.cloud.imds import Imds
from petctl_agent.cloud.status import StatusPublisher, make_writer
from petctl_agent.node import churn, crashes, ending, failure, jobenv, markers
from petctl_agent.node.lifecycle import CapacityHint, Lifecycle
from petctl_agent.node.preflight import check_etcd_tls, check_torch, require_writable_dir, wait_for_dir
from petctl_agent.node.snapshots import SnapshotArea
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError, rdzv_backend
from petctl_agent.worker.env import (
    Paths,
    StepInfo,
    export_worker_env,
    job_checkpoint_dir,
    job_work_dir,
    worker_entrypoint,
)
from petctl_agent.worker.project import link_and_log

log = logging.getLogger("petctl_agent")

#: The worker boot's last step writes this file in the agent dir (user_data/worker.sh.j2): the
#: agent completes a first launch into the warm pool only after it (at most BOOT_DONE_WAIT s).
BOOT_DONE = "boot-done"
BOOT_DONE_WAIT = 120.0


def wait_for_file(path: Path, timeout: float) -> bool:
    """Whether ``path`` exists within ``timeout`` s (polled every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            log.warning("%s not there after %.0fs; going on", path, timeout)
            return False
        time.sleep(0.5)
    return True


class Agent:
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

    def _prepare_node(self, spec: JobSpec) -> tuple[Path, Path, Path]:
        """Fetch the code, wait for the shared filesystem, make the checkpoint and work dirs and
        check this node can write them: ``(script, checkpoint dir, work dir)``."""
        self.paths.root.mkdir(parents=True, exist_ok=True)
        script = fetch_code(spec, self.paths.code)
        self.job_env = self._install_requirements(spec)
        wait_for_dir(self.efs, self.settings.efs_wait, "shared filesystem")
        ckpt_dir = job_checkpoint_dir(self.efs, spec)
        require_writable_dir(ckpt_dir, "checkpoint directory")
        work_dir = job_work_dir(self.efs, spec)
        require_writable_dir(work_dir, "work directory")
        return script, ckpt_dir, work_dir

    def _install_requirements(self, spec: JobSpec) -> jobenv.JobEnv | None:
        """The job's requirements, installed into its cached environment (node/jobenv.py) before
        the node parks in a warm pool or joins; a boot stage of ``status`` (``requirements``)."""
        if not spec.requirements.strip():
            return None
        envs = Path(self.settings.envs_dir) if self.settings.envs_dir else self.paths.root / "envs"
        t0 = time.monotonic()
        try:
            env = jobenv.ensure(spec, self.paths.code, envs)
        except jobenv.RequirementsError as e:
            if self.pub:
                self.pub.event("requirements_failed", seconds=round(time.monotonic() - t0, 2), error=str(e))
            raise
        assert env is not None
        if self.pub:
            self.pub.event(
                "requirements_installed",
                seconds=round(time.monotonic() - t0, 2),
                cached=env.cached,
                installed=list(env.installed),
            )
        return env

    def _wait_while_warmed(self) -> None:
        """A warm-pool instance publishes WARMED and waits, joining nothing, until InService."""
        assert self.lifecycle is not None

        def warmed(state: str) -> None:
            self.parked = True
            if self.pub:
                self.pub.update(state="WARMED", reason=f"warm pool: target-lifecycle-state {state}")
                self.pub.flush()
            # Parked: only now may the launch action complete (AWS then stops the instance). The
            # boot must have ended first, or cloud-init would run the user data again at the
            # instance's next start.
            if self.settings.launch_hook:
                wait_for_file(self.paths.root / BOOT_DONE, BOOT_DONE_WAIT)
            self.lifecycle.complete_launch()

        was_warmed = self.lifecycle.wait_while_warmed(lambda: self.leave_reason is not None, warmed)
        self.parked = False
        if was_warmed and self.pub and self.leave_reason is None:
            self.pub.update(state="STARTING", reason=None)
        if self.leave_reason is None:  # in service: straight from the launch, or out of the pool
            self.lifecycle.complete_launch()

    def _rendezvous_handler(self, spec: JobSpec, endpoint: str) -> Any:
        from petctl_agent.elastic.handlers import create_rdzv_handler

        assert self.lifecycle is not None
        return create_rdzv_handler(
            endpoint,
            spec.job_name,
            spec.min_nodes,
            spec.max_nodes,
            self.local_addr,
            spec.join_timeout,
            backend=self.backend,
            expected_nodes=CapacityHint(lambda: self.lifecycle.capacity(instances=False))
            if spec.worker_group
            else None,
            settings=self.settings,
            drain_timeout=spec.drain_timeout,
        )

    def _worker_entrypoint(self, spec: JobSpec, script: Path) -> tuple[Any, tuple[str, ...], str]:
        """torch's entry point for the workers. With the forkserver, warm it first (and wait):
        torch launches every worker as a fresh interpreter that re-imports torch (+ torch._dynamo
        via torch.optim): 15-30 s per start on a loaded 2-core box. The forkserver imports them
        once, *before* this node first joins the rendezvous (joining is what stops the running
        nodes), and every worker forks from it, the first ones included."""
        python = str(self.job_env.python) if self.job_env else None
        entrypoint, args, start_method = worker_entrypoint(script, spec.args, self.settings, python)
        if python and start_method == "forkserver":
            import multiprocessing

            # the forkserver, and every worker forked from it, runs the job's environment's python
            multiprocessing.set_executable(python)
        if start_method == "forkserver":
            from petctl_agent.worker.forkserver import warm_forkserver

            secs = warm_forkserver()
            log.info("forkserver warm (torch preloaded) in %.1fs; joining the rendezvous", secs)
            if self.pub:
                self.pub.event("workers_ready", seconds=round(secs, 3))
        return entrypoint, args, start_method

    def _elastic_agent(
        self,
        spec: JobSpec,
        handler: Any,
        nproc: int,
        entrypoint: Any,
        args: tuple[str, ...],
        start_method: str,
    ) -> Any:
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        from petctl_agent.elastic.agent import PetctlElasticAgent

        assert self.pub is not None and self.lifecycle is not None
        wspec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            entrypoint=entrypoint,
            args=args,
            rdzv_handler=handler,
            max_restarts=spec.max_restarts,
            monitor_interval=0.2,
            local_addr=self.local_addr,
        )
        logs_specs = DefaultLogsSpecs(log_dir=str(self.paths.logs), redirects=Std.ALL)
        self.elastic = agent = PetctlElasticAgent(
            wspec,
            logs_specs,
            self.pub,
            self.paths.drain,
            self.paths.progress,
            spec.drain_timeout,
            join_timeout=spec.join_timeout,
            capacity_probe=self.lifecycle.capacity,
            min_nodes=spec.min_nodes,
            start_method=start_method,
            step_info=self.step_info,
            settings=self.settings,
            failure_file=self.paths.failed,
            instance_id=self.instance_id,
        )
        if self.leave_reason:  # arrived while we were setting up
            agent.request_leave(self.leave_reason)
        return agent

    def _train(self, spec: JobSpec, agent: Any, work_dir: Path) -> Any:
        """Run the torch agent with the worker logs shipped and IMDS watched; its Outcome."""
        from petctl_agent.cloud.logship import CloudWatchShipper, LogTailer, stdout_sink

        assert self.lifecycle is not None
        sinks = [stdout_sink(self.instance_id)]
        shipper = None
        if spec.log_group and self.settings.cloudwatch:
            shipper = CloudWatchShipper(
                spec.log_group,
                f"{spec.job_name}/{self.instance_id}",
                lambda: aws.client("logs", spec.region or None),
                on_lost=lambda lost: self.pub.update(log_events_lost=lost),
            )
            shipper.start()
            sinks.append(shipper.sink)
        tailer = LogTailer(self.paths.logs, sinks)
        tailer.start()
        marker = job_checkpoint_dir(self.efs, spec) / failure.WORKERS_MARKER

        def before_workers_start() -> None:
            # later failures of this run are no longer "every node keeps failing"
            markers.mark(marker, spec.run_id)
            if spec.code_kind == "dir":
                # relative reads find the project's files (worker/project.py), at every start
                link_and_log(self.paths.code, work_dir)
            tailer.poll()

        agent.before_workers_start = before_workers_start
        if self.snapshots is not None:
            agent.after_workers_stopped = self.snapshots.verify
            agent.after_round = self.snapshots.after_round
        threading.Thread(
            target=self.lifecycle.watch,
            args=(self._stop, self.request_leave),
            name="petctl-imds",
            daemon=True,
        ).start()
        # Workers start in the job's work dir on the shared filesystem (as torchrun's
        # workers start in its cwd): a script's relative paths (snapshot.pt) are shared; a
        # project's own files are links there to this node's copy (worker/project.py).
        os.chdir(work_dir)
        try:
            return agent.run()
        finally:
            self._stop.set()
            tailer.stop()
            if shipper:
                shipper.stop()

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
