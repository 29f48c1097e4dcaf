"""Reading a job: find it, gather the facts of its status, list the profile's jobs, wait for an end."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from petctl import naming
from petctl.errors import ConfigError, NotFound
from petctl.gateway import Gateway
from petctl.gateway.stacks import parameters_of, tags_of
from petctl.jobs import boots
from petctl.jobs import state as st
from petctl.jobs.state import Facts
from petctl.jobs.status import Host, JobStatus
from petctl.ui import cmd


def check_job_name(job: str) -> None:
    if not naming.JOB_NAME_RE.match(job):
        raise ConfigError(f"{job!r} is not a valid job name; `{cmd('jobs')}` lists the jobs")


def find_job(gw: Gateway, profile: str, job: str) -> dict[str, Any] | None:
    """The job's stack if it exists in ``profile``, else None.

    Job stacks are named per account and region, not per profile, so a stack of the same name
    may belong to another profile: that one is never touched (NotFound names its profile).
    """
    check_job_name(job)
    stack = gw.stacks.describe(naming.job_stack(job))
    if stack is None:
        return None
    owner = tags_of(stack).get("petctl:profile")
    if owner != profile:
        raise NotFound(
            f"job {job!r} not found in profile {profile!r} (a job of that name belongs to "
            f"profile {owner!r}; use --profile {owner} to act on it)"
            if owner
            else f"job {job!r} not found in profile {profile!r} (its stack was not made by petctl)"
        )
    return stack


def require_job(gw: Gateway, profile: str, job: str) -> dict[str, Any]:
    stack = find_job(gw, profile, job)
    if stack is None:
        raise NotFound(f"job {job!r} not found in profile {profile!r}; `{cmd('jobs')}` lists the jobs")
    return stack


def inventory(gw: Gateway, job: str, stack: dict[str, Any] | None = None) -> list[Host]:
    """The rendezvous server and the workers (and the warm pool's stopped ones): what Auto Scaling
    and EC2 say of each."""
    hosts: list[Host] = []
    for role, group in (("rdzv", gw.groups.rdzv_group(job)), ("worker", gw.groups.worker_group(job))):
        for inst in (group or {}).get("Instances", []):
            hosts.append(_host(role, inst))
    if stack is not None and int(parameters_of(stack).get("WarmPoolSize") or 0) > 0:
        hosts += [_host("worker", inst) for inst in gw.groups.warm_instances(naming.worker_group(job))]
    details = gw.compute.instances([h.instance_id for h in hosts if h.instance_id])
    for h in hosts:
        d = details.get(h.instance_id or "", {})
        h.private_ip = d.get("PrivateIpAddress")
        h.spot = d.get("InstanceLifecycle") == "spot"
        h.ssm = f"aws ssm start-session --target {h.instance_id} --region {gw.region}"
    return hosts


def _host(role: str, inst: dict[str, Any]) -> Host:
    return Host(
        role=role,
        instance_id=inst["InstanceId"],
        availability_zone=inst.get("AvailabilityZone"),
        lifecycle_state=inst.get("LifecycleState"),
        health=inst.get("HealthStatus"),
        instance_type=inst.get("InstanceType"),
    )


def hosts(gw: Gateway, profile: str, job: str) -> list[Host]:
    return inventory(gw, job, require_job(gw, profile, job))


def gather(gw: Gateway, profile: str, job: str, now: float | None = None) -> Facts:
    """Every fact a status is derived from: the stack, the worker group, the hosts, and what the
    agents and boot scripts published."""
    stack = require_job(gw, profile, job)
    # the agents' reports before the group: the agent that ends a job scales its groups to zero,
    # then publishes SUCCEEDED (node/ending.py), so a report read first that says SUCCEEDED means a
    # group read after it sees zero (read the other way round, a status showed SUCCEEDED with 2
    # workers still wanted)
    reports = gw.job_files.read_status(job)
    group = gw.groups.worker_group(job) or {}
    hosts_ = inventory(gw, job, stack)
    logs, tail = gw.job_files.boot_logs(job)
    docs = gw.job_files.boot_events(job)
    boot = boots.boot_summary(logs, tail, naming.job_prefix(job) + "boot/", docs)
    return Facts(job, stack, group, hosts_, reports, boot, docs, time.time() if now is None else now)


def boot_log(gw: Gateway, job: str, instance_id: str) -> bytes:
    """The whole boot log ``instance_id`` published when its boot failed (``logs --boot``); kept
    until kill-job, which deletes the job's S3 files."""
    check_job_name(job)
    if not re.fullmatch(r"i-[0-9a-z]{1,32}", instance_id):
        raise ConfigError(
            f"--boot {instance_id!r} is not an instance id (i-...); `{cmd('status ' + job)}` names them"
        )
    text = gw.job_files.boot_log(job, instance_id)
    if text is None:
        raise NotFound(
            f"no boot log of {instance_id} in job {job!r} (an instance publishes one only when its boot "
            f"fails); `{cmd('status ' + job)}` names the failed boots"
        )
    return text


def observe(job: str, gw: Gateway, profile: str) -> JobStatus:
    """The job's status (``petctl status``)."""
    return st.derive(gather(gw, profile, job))


@dataclass
class JobRow:
    """One line of ``petctl jobs``."""

    job: str
    state: str
    min: int | None
    max: int | None
    desired: int | None
    in_service: int
    created: str | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def list_jobs(gw: Gateway, profile: str, now: float | None = None) -> list[JobRow]:
    now = time.time() if now is None else now
    rows = []
    for s in gw.stacks.job_stacks(profile):
        job = naming.job_from_stack(s["StackName"]) or s["StackName"]
        group = gw.groups.worker_group(job) or {}
        reports = gw.job_files.read_status(job)
        agents = st.current_agents(reports, gw.groups.instance_ids(job), now)
        # Only a job that never trained can have failed at boot: skip the S3 list otherwise.
        failed_boot = False
        if not st.ever_trained(reports):
            logs, tail = gw.job_files.boot_logs(job)
            boot = boots.boot_summary(logs, tail, naming.job_prefix(job) + "boot/")
            failed_boot = st.boot_failed(boot, False, group.get("DesiredCapacity"))
        rows.append(
            JobRow(
                job=job,
                state=st.overall_state(s["StackStatus"], agents, group.get("DesiredCapacity"), failed_boot),
                min=group.get("MinSize"),
                max=group.get("MaxSize"),
                desired=group.get("DesiredCapacity"),
                in_service=st.in_service(group),
                created=boots.iso(s.get("CreationTime")),
            )
        )
    return rows


def wait_for_end(
    gw: Gateway,
    profile: str,
    job: str,
    on_poll: Callable[[JobStatus], None] | None = None,
    interval: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> JobStatus | None:
    """Poll the job's status until it has ended (SUCCEEDED, FAILED, or its stack is gone: None)."""
    while True:
        try:
            status = observe(job, gw, profile)
        except NotFound:
            return None
        if on_poll is not None:
            on_poll(status)
        if status.final:
            return status
        sleep(interval)
