"""Acting on a running job: scale it, kill it; and ``upload``, which copies files to S3."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl import naming
from petctl.context import Context
from petctl.errors import ConfigError, NotFound, PetctlError, describe_client_error
from petctl.gateway import Gateway
from petctl.gateway.stacks import parameters_of
from petctl.jobs.observe import find_job, require_job
from petctl.jobs.request import DEFAULT_DRAIN_TIMEOUT
from petctl.storage import Upload, parse_s3_url
from petctl.ui import cmd


@dataclass
class Scaled:
    job: str
    before: int
    to: int
    min: int
    max: int

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "from": self.before, "to": self.to, "min": self.min, "max": self.max}


def scale(gw: Gateway, profile: str, job: str, size: int) -> Scaled:
    """Set the worker group's desired capacity through the Auto Scaling API."""
    require_job(gw, profile, job)
    group = gw.groups.worker_group(job)
    if group is None:
        raise NotFound(f"job {job!r} has no worker group; is it being deleted? `{cmd('status ' + job)}`")
    lo, hi, before = group["MinSize"], group["MaxSize"], group["DesiredCapacity"]
    if not lo <= size <= hi:
        raise ConfigError(f"--size {size} is outside the job's range [{lo}, {hi}]")
    gw.groups.set_capacity(group["AutoScalingGroupName"], size)
    return Scaled(job, before, size, lo, hi)


@dataclass
class Killed:
    job: str
    deleted: bool
    seconds: float
    waited: bool
    checkpoints_kept: str
    checkpoints_deleted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def kill_job(
    ctx: Context,
    job: str,
    timeout: float = 1800,
    wait: bool = True,
    sleep: Callable[[float], None] = time.sleep,
    delete_checkpoints: bool = False,
) -> Killed:
    """Stop the workers, then delete the job stack (the rendezvous server goes last), and wait
    until every instance is really gone. Killing a job that is gone is not an error; killing
    another profile's job is (``find_job``).

    Workers first: scaled to zero they drain (checkpoint, leave) while etcd still answers, so
    they neither log connection errors nor lose steps. ``wait=False`` only starts the deletion.
    The job's whole S3 prefix (uploads, TLS keys, reports) is deleted once no instance of it can
    start any more: after the wait, or, with ``wait=False``, by a later kill-job that finds the
    stack gone.

    ``delete_checkpoints``: once the workers are gone, the job's one-shot instance deletes its
    directory on EFS (:mod:`petctl.jobs.cleanup`); the stack goes only after it reported success.
    """
    from petctl.jobs import cleanup

    gw = ctx.gateway()
    stack = find_job(gw, ctx.profile_name, job)
    if stack is not None and delete_checkpoints:
        cleanup.check_possible(gw, job, wait)
    result = Killed(job, False, 0.0, wait, f"{ctx.profile.efs_id or '<efs>'}:/{naming.checkpoint_dir(job)}")
    if stack is None:
        if delete_checkpoints:
            ctx.ui.warn(
                f"job {job} is gone, and its access point with it: petctl cannot delete its checkpoints "
                f"(docs/contracts.md, Shared file system)"
            )
        # Files left by a `kill-job --no-wait`. A bucket may be shared with a profile of another
        # region, where a running job of this name has no stack here to find: its spec says where
        # it runs, and another region's job is never touched from this one.
        elsewhere = gw.job_files.spec_region(job)
        if elsewhere and elsewhere != gw.region:
            ctx.ui.warn(
                f"s3://{ctx.profile.bucket}/{naming.job_prefix(job)} belongs to a job {job} in {elsewhere} "
                f"(its job.json says so), not this profile's {gw.region}: left alone; run kill-job there"
            )
            return result
        gw.job_files.delete_all(job)
        return result
    t0 = time.monotonic()
    if not wait:
        # The prefix stays (TLS keys, code, spec): should the deletion fail (DELETE_FAILED), the
        # groups left would launch instances whose boot needs them. The next kill-job, stack gone,
        # deletes it.
        gw.stacks.start_delete(naming.job_stack(job))
        result.deleted = True
        return result
    workers = naming.worker_group(job)
    if gw.groups.describe(workers) is not None:
        ctx.ui.progress(f"stopping the workers of {job} (they checkpoint and leave)")
        try:
            gw.groups.stop(workers)
        except Exception as e:  # noqa: BLE001 - the stack deletion below stops them anyway
            ctx.ui.warn(f"could not scale {workers} to zero ({describe_client_error(e)}); deleting the stack")
        # A warm pool outlives a scale to zero: its stopped instances would hold the wait below.
        # Only a stack made with one is asked (a policy without DescribeWarmPool still kills others).
        if int(parameters_of(stack).get("WarmPoolSize") or 0) > 0:
            try:
                if gw.groups.delete_warm_pool(workers):
                    ctx.ui.progress(f"deleting the warm pool of {workers}")
            except Exception as e:  # noqa: BLE001 - the stack deletion below deletes it anyway
                ctx.ui.warn(
                    f"could not delete the warm pool of {workers} ({describe_client_error(e)}); "
                    "deleting the stack"
                )
        drain = int(parameters_of(stack).get("DrainTimeout") or DEFAULT_DRAIN_TIMEOUT)
        gone = _wait_until(
            ctx,
            lambda: (
                not (gw.groups.describe(workers) or {}).get("Instances")
                and not gw.compute.job_instances(job, "worker")
            ),
            drain + 120,
            "workers gone",
            sleep,
        )
        if delete_checkpoints and not gone:
            raise PetctlError(
                f"workers of {job} are still running: their checkpoints were not deleted and the stack is "
                f"kept; run `{cmd('kill-job ' + job + ' --delete-checkpoints')}` again once they are gone"
            )
    if delete_checkpoints:
        cleanup.delete_checkpoints(ctx, gw, job, sleep=sleep)
        result.checkpoints_deleted, result.checkpoints_kept = True, ""
    gw.stacks.delete(naming.job_stack(job), timeout=timeout)
    _wait_until(ctx, lambda: not gw.compute.job_instances(job), 600, "instances terminated", sleep)
    gw.job_files.delete_all(job)
    result.deleted = True
    result.seconds = round(time.monotonic() - t0, 1)
    return result


def _wait_until(
    ctx: Context, done: Callable[[], bool], timeout: float, what: str, sleep: Callable[[float], None]
) -> bool:
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    while not done():
        ctx.ui.live(f"waiting for {what} ({time.monotonic() - t0:.0f}s)")
        if time.monotonic() > deadline:
            ctx.ui.warn(f"still waiting for {what} after {timeout:.0f}s; going on")
            return False
        sleep(2)
    ctx.ui.progress(f"{what} ({time.monotonic() - t0:.0f}s)")
    return True


def upload(ctx: Context, path: str, s3_url: str | None) -> list[str]:
    """Upload a file or directory (as-is, file by file) to S3, like the original tool; returns
    the URLs written."""
    src = Path(path)
    if not src.exists():
        raise ConfigError(f"{path} does not exist")
    if s3_url is None:
        ctx.profile.require_ready()
        s3_url = f"s3://{ctx.profile.bucket}/petctl/uploads/{src.resolve().name}"
    bucket, key = parse_s3_url(s3_url)
    objects = ctx.gateway().objects
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    uploaded = []
    for f in files:
        k = (
            key
            if src.is_file() and not key.endswith("/")
            else f"{key.rstrip('/')}/{f.relative_to(src) if src.is_dir() else f.name}"
        )
        objects.put_object(bucket, Upload(key=k, path=str(f)))
        uploaded.append(f"s3://{bucket}/{k}")
    return uploaded
