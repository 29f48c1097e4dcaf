"""The restart path's launch: petctl's torch elastic agent over the job's rendezvous, its workers'
entry point (the forkserver), and the training run with the logs shipped and IMDS watched. A
mixin of :class:`petctl_agent.node.agent.Agent`, whose state it shares; a live node
(``node/live.py``) goes through :meth:`Launching._train` alone.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from petctl_agent.cloud import aws
from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.node import failure, jobenv, markers
from petctl_agent.node.lifecycle import CapacityHint, Lifecycle
from petctl_agent.node.snapshots import SnapshotArea
from petctl_agent.settings import Settings, exclude_after
from petctl_agent.spec import JobSpec
from petctl_agent.worker.env import Paths, StepInfo, job_checkpoint_dir, worker_entrypoint
from petctl_agent.worker.project import link_and_log

log = logging.getLogger("petctl_agent")


class Launching:
    """The restart path's launch steps of :class:`~petctl_agent.node.agent.Agent` (see the module docstring)."""

    paths: Paths
    efs: Path
    settings: Settings
    pub: StatusPublisher | None
    lifecycle: Lifecycle | None
    job_env: jobenv.JobEnv | None
    leave_reason: str | None
    instance_id: str
    local_addr: str
    backend: str
    elastic: Any
    step_info: StepInfo
    snapshots: SnapshotArea | None
    _stop: threading.Event

    if TYPE_CHECKING:  # the Agent's

        def request_leave(self, reason: str) -> None: ...

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
            # the job's own setting (run-job --env PETCTL_AGENT_EXCLUDE_AFTER=N) over the agent's
            exclude_after=exclude_after(spec.env, self.settings.exclude_after),
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
