"""``petctl-agent run``: job spec -> shared filesystem -> code -> torch elastic agent.

Environment contract: docs/contracts.md ("Agent environment") and docs/agent.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from petctl_agent import aws
from petctl_agent.fetch import load_spec
from petctl_agent.imds import Imds
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError, checkpoint_dir, rdzv_backend
from petctl_agent.status import StatusPublisher, make_writer

log = logging.getLogger("petctl_agent")

# Exec'd in each worker before the user script: die with the agent (SIGKILL on
# parent death). torch starts workers with start_new_session=True, so killing an
# agent (or its process group) would otherwise orphan its workers, and they would
# keep a dead node's ranks alive.
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None).prctl(1,signal.SIGKILL);"
    "p=int(os.environ.get('PETCTL_AGENT_PID','0'));"
    "(p and os.getppid()!=p) and os._exit(70);"
    "os.execv(sys.executable,[sys.executable,'-u']+sys.argv[1:])"
)
SUCCESS_MARKER = ".petctl-job-succeeded"
#: how many [t, step] samples the status document keeps (``progress``)
PROGRESS_SAMPLES = 300


class CapacityHint:
    """The worker group's desired capacity, for petctl-etcd's ``expected_nodes`` hint.

    The handler calls it from its control thread (at most once a second), which must never
    wait on the Auto Scaling API: this returns the last value read at once and refreshes it
    in a background thread when it is older than ``max_age`` seconds. None until the first
    read succeeds, and whenever there is no worker group.
    """

    def __init__(self, probe: Any, max_age: float = 5.0) -> None:
        self.probe = probe
        self.max_age = max_age
        self.value: int | None = None
        self._read_at = float("-inf")
        self._busy = threading.Lock()

    def __call__(self) -> int | None:
        if time.monotonic() - self._read_at > self.max_age and self._busy.acquire(blocking=False):
            threading.Thread(target=self._refresh, name="petctl-capacity", daemon=True).start()
        return self.value

    def _refresh(self) -> None:
        try:
            cap = self.probe()
            self.value = None if cap is None else int(cap.get("desired", 0)) or None
        except Exception as e:  # noqa: BLE001 - a hint only
            log.debug("capacity hint: %s", e)
        finally:
            self._read_at = time.monotonic()
            self._busy.release()


class Paths:
    def __init__(self, agent_dir: Path) -> None:
        agent_dir = agent_dir.absolute()  # workers run in the job's work dir, not here
        self.root = agent_dir
        self.code = agent_dir / "code"
        self.logs = agent_dir / "logs"
        self.drain = agent_dir / "drain"
        self.progress = agent_dir / "progress.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="petctl-agent", description="petctl node agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run this node's part of the job")
    r.add_argument("--spec", help="job spec: s3://..., file://... or a path (default: IMDS tag petctl:spec)")
    r.add_argument(
        "--rdzv-endpoint", help="etcd HOST[:PORT] (default: IMDS tag petctl:rdzv + spec rdzv_port)"
    )
    r.add_argument("--local-addr", help="this node's address (default: IMDS local-ipv4)")
    return p.parse_args(argv)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for_dir(path: Path, timeout: float, what: str) -> None:
    """Wait (bounded) for a directory, e.g. the EFS mount, to exist."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if time.monotonic() > deadline:
            raise SpecError(
                f"{what} {path} did not appear within {timeout:.0f}s (is the filesystem mounted?)"
            )
        time.sleep(1)


class Agent:
    """One node's agent: owns the status publisher, the watcher and the torch agent."""

    def __init__(self, args: argparse.Namespace, settings: Settings, imds: Imds) -> None:
        self.args = args
        self.settings = settings
        self.imds = imds
        self.paths = Paths(settings.agent_dir)
        self.efs = settings.efs_mount
        self.instance_id = self.imds.meta("instance-id") or socket.gethostname()
        self.local_addr = args.local_addr or self.imds.meta("local-ipv4") or "127.0.0.1"
        self.spec: JobSpec | None = None
        self.pub: StatusPublisher | None = None
        self.elastic: Any = None
        self.backend = "petctl-etcd"
        self.leave_reason: str | None = None
        self.lifecycle_pending = False
        self._stop = threading.Event()
        self._progress: deque[list[float | int]] = deque(maxlen=PROGRESS_SAMPLES)
        self._progress_lock = threading.Lock()  # _refresh runs in the status thread and the main one

    # ---- status helpers -------------------------------------------------------------
    def _refresh(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        prog = _read_json(self.paths.progress)
        if prog:
            step = prog.get("step")
            out["last_step"] = step
            t = prog.get("t")
            if t is None:
                try:
                    t = self.paths.progress.stat().st_mtime
                except OSError:
                    t = None
            out["last_step_at"] = t
            with self._progress_lock:
                if (
                    isinstance(step, int)
                    and t is not None
                    and (not self._progress or self._progress[-1][1] != step)
                ):
                    self._progress.append([round(float(t), 3), step])
                out["progress"] = list(self._progress)
        if self.spec is not None:
            latest = _read_json(self.efs / self.spec.checkpoint_dir / "latest")
            if latest:
                out["last_checkpoint_step"] = latest.get("step")
        return out

    # ---- leaving --------------------------------------------------------------------
    def request_leave(self, reason: str) -> None:
        if self.leave_reason is not None:
            return
        self.leave_reason = reason
        log.info("leave requested: %s", reason)
        if self.elastic is not None:
            self.elastic.request_leave(reason)
        threading.Thread(target=self._leave_outside_training, name="petctl-leave", daemon=True).start()

    def _leave_outside_training(self) -> None:
        """A leave that arrives before the torch agent exists (boot: code, shared filesystem).

        Inside a rendezvous the main thread leaves by itself: the join loop checks the
        leave request at every iteration, removes us from the round and raises
        ``LeftRendezvous`` (``PetctlElasticAgent._guard_join``); then ``_run`` completes
        the lifecycle action, publishes LEFT and returns. Only if the main thread is
        stuck elsewhere (a store read, ``PETCTL_AGENT_STORE_TIMEOUT``) for longer than
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
        self.finish_leave()
        os._exit(0)

    def finish_leave(self) -> None:
        self.complete_lifecycle_action()
        if self.pub:
            self.pub.update(state="LEFT", reason=self.leave_reason)
            self.pub.close()

    def watch_imds(self) -> None:
        """Poll IMDS every ~1 s for a scale-in (lifecycle) or spot interruption notice."""
        interval = self.settings.imds_poll
        while not self._stop.wait(interval):
            state = self.imds.get("meta-data/autoscaling/target-lifecycle-state")
            if state and state.strip() == "Terminated":
                self.lifecycle_pending = True
                self.request_leave("autoscaling target-lifecycle-state=Terminated")
                return
            spot = self.imds.get("meta-data/spot/instance-action")
            if spot:
                self.request_leave(f"spot instance-action {spot.strip()}")
                return

    def lifecycle_state(self) -> str:
        """IMDS ``autoscaling/target-lifecycle-state``; absent (404: no group, or a group without
        a warm pool) or unreachable reads as ``InService``."""
        state = self.imds.get("meta-data/autoscaling/target-lifecycle-state")
        return state.strip() if state and state.strip() else "InService"

    def wait_while_warmed(self) -> None:
        """An instance of the group's warm pool never joins: wait until it is put in service.

        On AWS a warmed instance runs its boot (install, mount) and is stopped; started again
        for a scale-out, systemd starts this agent anew. The local cloud pauses the process tree
        (SIGSTOP) and resumes it (SIGCONT). Either way this agent reaches the rendezvous only
        once the target lifecycle state is no longer ``Warmed:*``. A leave request ends the wait.
        """
        state = self.lifecycle_state()
        if not state.startswith("Warmed:"):
            return
        t0 = time.monotonic()
        log.info("in the warm pool (%s): not joining until InService", state)
        if self.pub:
            self.pub.update(state="WARMED", reason=f"warm pool: target-lifecycle-state {state}")
        while state.startswith("Warmed:") and self.leave_reason is None:
            time.sleep(self.settings.imds_poll)
            state = self.lifecycle_state()
        log.info("left the warm pool after %.1fs (%s)", time.monotonic() - t0, state)
        if self.pub:
            self.pub.update(state="STARTING", reason=None)

    def complete_lifecycle_action_at_end(self, wait: float) -> None:
        """After SUCCEEDED/FAILED: complete our termination lifecycle action as soon as the
        instance enters Terminating:Wait, so it does not sit out the hook's timeout (billed).

        When we just scaled the groups to zero the termination follows within seconds
        to a minute: watch IMDS for up to ``wait`` s. Otherwise only act if it is pending now.
        """
        spec = self.spec
        if spec is None or not spec.lifecycle_hook or not spec.worker_group:
            return
        deadline = time.monotonic() + wait
        interval = self.settings.imds_poll
        while True:
            state = self.imds.get("meta-data/autoscaling/target-lifecycle-state")
            if self.lifecycle_pending or (state and state.strip() == "Terminated"):
                self.lifecycle_pending = True
                self.complete_lifecycle_action()
                return
            if time.monotonic() >= deadline:
                if wait > 0:
                    log.info("no termination lifecycle action within %.0fs; exiting", wait)
                return
            time.sleep(interval)

    def capacity(self) -> dict[str, int] | None:
        """The worker group's capacity (desired, in service, pending), or None without a group."""
        spec = self.spec
        if spec is None or not spec.worker_group:
            return None
        groups = aws.client("autoscaling", spec.region or None).describe_auto_scaling_groups(
            AutoScalingGroupNames=[spec.worker_group]
        )["AutoScalingGroups"]
        if not groups:
            return {"desired": 0, "in_service": 0, "pending": 0}
        g = groups[0]
        states = [i.get("LifecycleState", "") for i in g.get("Instances", [])]
        return {
            "desired": int(g.get("DesiredCapacity", 0)),
            "in_service": sum(1 for s in states if s == "InService"),
            "pending": sum(1 for s in states if s.startswith("Pending")),
        }

    def complete_lifecycle_action(self) -> None:
        spec = self.spec
        if spec is None or not spec.lifecycle_hook or not spec.worker_group:
            return
        if not self.lifecycle_pending:
            state = self.imds.get("meta-data/autoscaling/target-lifecycle-state")
            if not state or state.strip() != "Terminated":
                return
        try:
            aws.client("autoscaling", spec.region or None).complete_lifecycle_action(
                LifecycleHookName=spec.lifecycle_hook,
                AutoScalingGroupName=spec.worker_group,
                LifecycleActionResult="CONTINUE",
                InstanceId=self.instance_id,
            )
            log.info("completed lifecycle action %s on %s", spec.lifecycle_hook, spec.worker_group)
        except Exception as e:  # noqa: BLE001 - the hook's heartbeat timeout completes it anyway
            log.warning("complete_lifecycle_action failed (ignored): %s", e)

    def scale_groups_to_zero(self) -> None:
        spec = self.spec
        assert spec is not None
        for group in (spec.worker_group, spec.rdzv_group):
            if not group:
                continue
            try:
                aws.client("autoscaling", spec.region or None).update_auto_scaling_group(
                    AutoScalingGroupName=group, MinSize=0, DesiredCapacity=0
                )
                log.info("set %s to min=desired=0", group)
            except Exception as e:  # noqa: BLE001
                log.warning("could not scale %s to zero (ignored): %s", group, e)

    # ---- run ------------------------------------------------------------------------
    def run(self) -> int:
        spec_url = self.args.spec or self.imds.tag("petctl:spec")
        if not spec_url:
            raise SpecError(
                "no job spec: pass --spec or set the instance tag petctl:spec (IMDS tags enabled?)"
            )
        self.spec = spec = load_spec(spec_url)
        self.pub = pub = StatusPublisher(
            make_writer(spec.status_url),
            spec.job_name,
            self.instance_id,
            self.local_addr,
            interval=self.settings.status_interval,
            refresh=self._refresh,
        )
        pub.start()
        pub.event("agent_started", local_addr=self.local_addr, pid=os.getpid())
        try:
            try:
                self.backend = rdzv_backend(spec.rdzv_backend, self.settings.rdzv_backend)
                check_etcd_tls(self.settings)
            except ValueError as e:
                raise SpecError(str(e)) from None
            pub.update(rdzv_backend=self.backend)
            problem = check_torch(spec.torch_version, self.backend)
            if problem:  # before anything joins the rendezvous
                rc = self.fail(problem)
                self.complete_lifecycle_action_at_end(0)
                return rc
            return self._run(spec, pub)
        except SpecError as e:
            return self.fail(str(e))
        except Exception as e:  # noqa: BLE001 - report any crash as FAILED with its reason
            log.exception("agent failed")
            return self.fail(f"{type(e).__name__}: {e}")
        finally:
            pub.close()

    def fail(self, reason: str) -> int:
        log.error("FAILED: %s", reason)
        if self.pub:
            self.pub.event("failed", reason=reason)
            self.pub.update(state="FAILED", reason=reason)
            self.pub.flush()
        return 1

    def _rdzv_endpoint(self, spec: JobSpec) -> str:
        ep = self.args.rdzv_endpoint or self.imds.tag("petctl:rdzv")
        if not ep:
            raise SpecError(
                "no rendezvous endpoint: pass --rdzv-endpoint or set the instance tag petctl:rdzv"
            )
        return ep if ":" in ep else f"{ep}:{spec.rdzv_port}"

    def _run(self, spec: JobSpec, pub: StatusPublisher) -> int:
        from petctl_agent.fetch import fetch_code

        endpoint = self._rdzv_endpoint(spec)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        script = fetch_code(spec, self.paths.code)
        wait_for_dir(self.efs, self.settings.efs_wait, "shared filesystem")
        ckpt_dir = (
            self.efs / spec.checkpoint_dir
            if spec.checkpoint_dir
            else self.efs / checkpoint_dir(spec.job_name)
        )
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        work_dir = job_work_dir(self.efs, spec)
        work_dir.mkdir(parents=True, exist_ok=True)
        self.wait_while_warmed()  # before the forkserver's imports and before registering
        if self.leave_reason:
            self.finish_leave()
            return 0

        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        from petctl_agent.elastic import PetctlElasticAgent, create_rdzv_handler
        from petctl_agent.logship import CloudWatchShipper, LogTailer, stdout_sink

        nproc = spec.resolved_nproc()
        backend = self.backend
        self._export_worker_env(spec, ckpt_dir, work_dir, nproc, backend)
        handler = create_rdzv_handler(
            endpoint,
            spec.job_name,
            spec.min_nodes,
            spec.max_nodes,
            self.local_addr,
            spec.join_timeout,
            backend=backend,
            expected_nodes=CapacityHint(self.capacity) if spec.worker_group else None,
            settings=self.settings,
        )
        entrypoint: Any = sys.executable
        start_method = "spawn"
        if self.settings.enabled("FORKSERVER"):
            # torch launches every worker as a fresh interpreter that re-imports
            # torch (+ torch._dynamo via torch.optim): 15-30 s per start on a loaded
            # 2-core box. Warm a forkserver that imported them once, *before* this
            # node first joins the rendezvous (joining is what stops the running
            # nodes), and fork every worker from it, the first ones included.
            from petctl_agent.worker import run_script, warm_forkserver

            secs = warm_forkserver()
            log.info("forkserver warm (torch preloaded) in %.1fs; joining the rendezvous", secs)
            pub.event("workers_ready", seconds=round(secs, 3))
            entrypoint, start_method = run_script, "forkserver"
            entry_args: tuple[str, ...] = (str(script), *spec.args)
        elif self.settings.enabled("PDEATHSIG"):
            entry_args = ("-c", _PDEATHSIG_SHIM, str(script), *spec.args)
        else:
            entry_args = ("-u", str(script), *spec.args)
        if self.leave_reason:  # arrived while we were warming up
            self.finish_leave()
            return 0
        wspec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            entrypoint=entrypoint,
            args=entry_args,
            rdzv_handler=handler,
            max_restarts=spec.max_restarts,
            monitor_interval=0.2,
            local_addr=self.local_addr,
        )
        logs_specs = DefaultLogsSpecs(log_dir=str(self.paths.logs), redirects=Std.ALL)
        self.elastic = agent = PetctlElasticAgent(
            wspec,
            logs_specs,
            pub,
            self.paths.drain,
            self.paths.progress,
            spec.drain_timeout,
            join_timeout=spec.join_timeout,
            capacity_probe=self.capacity,
            min_nodes=spec.min_nodes,
            start_method=start_method,
            step_info=self._refresh,
            settings=self.settings,
        )
        if self.leave_reason:  # arrived while we were setting up
            agent.request_leave(self.leave_reason)

        sinks = [stdout_sink(self.instance_id)]
        shipper = None
        if spec.log_group and self.settings.cloudwatch:
            shipper = CloudWatchShipper(
                spec.log_group,
                f"{spec.job_name}/{self.instance_id}",
                lambda: aws.client("logs", spec.region or None),
            )
            shipper.start()
            sinks.append(shipper.sink)
        tailer = LogTailer(self.paths.logs, sinks)
        tailer.start()
        agent.before_workers_start = tailer.poll
        threading.Thread(target=self.watch_imds, name="petctl-imds", daemon=True).start()

        # Workers start in the job's work dir on the shared filesystem (as torchrun's
        # workers start in its cwd): a script's relative paths (snapshot.pt) are shared.
        os.chdir(work_dir)
        try:
            agent.run()
        except Exception as e:  # noqa: BLE001
            from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

            from petctl_agent.elastic import LeftRendezvous

            if isinstance(e, LeftRendezvous):
                agent.outcome = "drained"
                pub.event("drained", clean=True, phase="rendezvous", note=str(e))
            elif isinstance(e, RendezvousClosedError) and (ckpt_dir / SUCCESS_MARKER).exists():
                agent.outcome = "succeeded"  # we arrived after the job finished
            elif isinstance(e, RendezvousTimeoutError):
                agent.outcome = "failed"
                agent.fail_kind = "join_timeout"
                agent.fail_reason = (
                    f"rendezvous timed out: fewer than min_nodes={spec.min_nodes} nodes joined within "
                    f"join_timeout {agent.join_timeout:.0f}s" + (f"; {e}" if str(e) else "")
                )
            elif isinstance(e, RendezvousClosedError):
                agent.outcome = "failed"
                agent.fail_reason = "the rendezvous was closed by another node (job failed elsewhere)"
            else:
                agent.outcome = "failed"
                agent.fail_reason = f"{type(e).__name__}: {e}"
        finally:
            self._stop.set()
            tailer.stop()
            if shipper:
                shipper.stop()

        if agent.outcome == "drained":
            self.finish_leave()
            return 0
        lifecycle_wait = self.settings.lifecycle_wait
        if agent.outcome == "succeeded":
            (ckpt_dir / SUCCESS_MARKER).touch()
            try:
                handler.shutdown()  # close the rendezvous: late joiners stop instead of waiting
            except Exception as e:  # noqa: BLE001
                log.debug("rendezvous shutdown: %s", e)
            pub.event("succeeded", last_step=self._refresh().get("last_step"))
            pub.update(state="SUCCEEDED", reason=None)
            self.scale_groups_to_zero()
            self.complete_lifecycle_action_at_end(lifecycle_wait)
            pub.close()
            return 0
        if agent.fail_kind == "join_timeout":
            # This node's rendezvous timed out. That alone does not end the job: other
            # nodes may be training (this one waited beyond max_nodes) or about to
            # arrive. Do not close the rendezvous, do not scale the groups to zero.
            rc = self.fail(agent.fail_reason or "rendezvous timed out")
            self.complete_lifecycle_action_at_end(0)
            if self.pub:
                self.pub.close()
            return rc
        try:
            handler.shutdown()  # unrecoverable: close it so the other nodes stop too
        except Exception:  # noqa: BLE001
            pass
        rc = self.fail(agent.fail_reason or "unknown failure")
        # A failed job must not keep paying for idle instances (the ASG would replace them and
        # systemd would restart the agent): stop the groups; the status, logs and checkpoints stay.
        self.scale_groups_to_zero()
        self.complete_lifecycle_action_at_end(lifecycle_wait)
        if self.pub:
            self.pub.close()
        return rc

    def _export_worker_env(
        self, spec: JobSpec, ckpt_dir: Path, work_dir: Path, nproc: int, backend: str = "petctl-etcd"
    ) -> None:
        """Worker env = agent env + torchrun's vars (set by torch) + these."""
        from petctl_agent.elastic import torch_workaround

        env = os.environ
        env.update(spec.env)
        omp = omp_num_threads(env, nproc)
        if omp is not None:
            log.warning(
                "Setting OMP_NUM_THREADS environment variable for each process to be %s in default, "
                "to avoid your system being overloaded, please further tune the variable for optimal "
                "performance in your application as needed.",
                omp,
            )
            env["OMP_NUM_THREADS"] = omp
        env["PETCTL_WORK_DIR"] = str(work_dir)
        env["PETCTL_JOB_NAME"] = spec.job_name
        env["PETCTL_CHECKPOINT_DIR"] = str(ckpt_dir)
        env["PETCTL_DRAIN_FILE"] = str(self.paths.drain)
        env["PETCTL_PROGRESS_FILE"] = str(self.paths.progress)
        env["PETCTL_LOCAL_ADDR"] = self.local_addr
        env["PETCTL_AGENT_PID"] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        # our SIGTERM/SIGINT handlers start a drain; torch's would raise SignalException.
        # (torch 2.5-2.8 ignore this variable and install theirs anyway: the agent puts
        # its own back after every worker start, PetctlElasticAgent._restore_signal_handlers.)
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP,SIGQUIT")
        if torch_workaround("SPLIT_STORE", backend, self.settings):
            # etcd-v2 + shared agent TCPStore: a node joining a running job waits
            # forever for MASTER_ADDR of the new round (DESIGN §4). Workers get
            # their own store on rank 0's node instead. (petctl-etcd never shares
            # an agent store: the round record carries MASTER_ADDR/PORT.)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if self.settings.enabled("IDENTICAL_RANKS"):
            # homogeneous nodes: ranks = group_rank * nproc + local_rank, computed
            # locally instead of rank 0 collecting every node's role info through
            # the store (another place a lost node blocks the store timeout).
            env["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"


def job_work_dir(efs: Path, spec: JobSpec) -> Path:
    """Where workers start: ``<efs>/petctl/jobs/<job>/work``, shared by every node of the job."""
    return efs / "petctl" / "jobs" / spec.job_name / "work"


def omp_num_threads(env: Any, nproc: int) -> str | None:
    """What torchrun does: OMP_NUM_THREADS=1 when unset and more than one worker per node."""
    if "OMP_NUM_THREADS" not in env and nproc > 1:
        return "1"
    return None


def check_etcd_tls(settings: Settings) -> None:
    """Refuse half a TLS setup or a missing file now, before a handler retries TLS errors for ever."""
    tls = settings.etcd_tls
    if tls is None:
        return
    for var, path in (
        ("PETCTL_ETCD_CACERT", tls.cacert),
        ("PETCTL_ETCD_CERT", tls.cert),
        ("PETCTL_ETCD_KEY", tls.key),
    ):
        if not os.path.isfile(path):
            raise ValueError(f"{var}={path} is not a file: the boot script fetches the job's TLS files first")


def check_torch(wanted_version: str, backend: str = "petctl-etcd") -> str | None:
    """One-line reason the installed torch cannot run this job (wrong version, missing internals
    that the agent uses with ``backend``)."""
    from petctl_agent.torch_compat import check, required_for

    return check(wanted_version, required_for(backend))


def _install_signal_handlers(agent: Agent) -> None:
    def on_signal(signum: int, _frame: Any) -> None:
        agent.request_leave(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``petctl-agent``."""
    args = _parse(argv)
    settings = Settings.from_env()
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(settings.torch_log)
    for noisy in ("botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from petctl_agent.elastic import quiet_worker_exit_tracebacks

    quiet_worker_exit_tracebacks()
    agent = Agent(args, settings, Imds(settings.imds_url))
    _install_signal_handlers(agent)
    try:
        rc = agent.run()
    except SpecError as e:  # before the status publisher exists: nowhere to report but here
        log.error("FAILED: %s", e)
        return 1
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
