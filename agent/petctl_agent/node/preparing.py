"""A node's boot steps before it trains: the code, the job's packages, the shared filesystem and its
directories, and the wait in the warm pool. A mixin of :class:`petctl_agent.node.agent.Agent`,
whose state it shares.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from petctl_agent.cloud.fetch import fetch_code
from petctl_agent.cloud.status import StatusPublisher
from petctl_agent.node import jobenv
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.node.preflight import require_writable_dir, wait_for_dir
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec
from petctl_agent.worker.env import Paths, job_checkpoint_dir, job_work_dir

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


class Preparing:
    """The boot steps of :class:`~petctl_agent.node.agent.Agent` (see the module docstring)."""

    paths: Paths
    efs: Path
    settings: Settings
    pub: StatusPublisher | None
    lifecycle: Lifecycle | None
    job_env: jobenv.JobEnv | None
    leave_reason: str | None
    parked: bool

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
