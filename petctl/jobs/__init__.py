"""Jobs: a request is validated, its code read, then planned (pure data: ``--dry-run`` prints it),
applied through the gateway, and observed.

    request.py   JobRequest and its validation            (no AWS, no file read but the target's)
    lookups.py   what the plan needs from AWS, looked up before it (instance types: cached)
    planning.py  Code (tarred, checked) and plan() -> Plan (pure)
    prepare.py   prepare(ctx, request) -> Plan: validation, lookups, code, plan, in that order
    apply.py     apply(plan, gateway) -> Started
    observe.py   find a job, gather its facts, observe() -> JobStatus, list_jobs, wait_for_end
    status.py    what status reports: JobStatus, Host, AgentStatus, BootFailures (to_dict: --output json)
    state.py     the status derived from gathered facts (pure)
    boots.py     what the boots left: the boot log summary, each boot's phases (pure)
    reasons.py   why a FAILED job failed, in one line: error lines, boot and agent reasons (pure)
    control.py   scale, kill_job, upload

A new job option goes into request.py (validation) and planning.py (spec, parameters); a new
fact of the status into observe.gather and state.derive.
"""

from petctl.jobs.apply import Started, apply
from petctl.jobs.boots import BOOT_LOG_LINES
from petctl.jobs.control import kill_job, scale, upload
from petctl.jobs.lookups import check_code_url, instance_facts, resolve_ami, resolve_vpc
from petctl.jobs.observe import boot_log, find_job, hosts, list_jobs, observe, require_job, wait_for_end
from petctl.jobs.planning import Code, Plan, plan, prepare_code
from petctl.jobs.prepare import prepare
from petctl.jobs.request import (
    DEFAULT_TORCH_VERSION,
    JobRequest,
    check_instance_types,
    default_job_name,
    sanitize_tag_value,
    validate_request,
)
from petctl.jobs.state import BOOT_FAILURES_TO_FAIL
from petctl.jobs.status import FINAL_STATES, Host, JobStatus

__all__ = [
    "boot_log",
    "BOOT_FAILURES_TO_FAIL",
    "BOOT_LOG_LINES",
    "DEFAULT_TORCH_VERSION",
    "FINAL_STATES",
    "Code",
    "Host",
    "JobRequest",
    "JobStatus",
    "Plan",
    "Started",
    "apply",
    "check_code_url",
    "check_instance_types",
    "default_job_name",
    "find_job",
    "hosts",
    "instance_facts",
    "kill_job",
    "list_jobs",
    "observe",
    "plan",
    "prepare",
    "prepare_code",
    "require_job",
    "resolve_ami",
    "resolve_vpc",
    "sanitize_tag_value",
    "scale",
    "upload",
    "validate_request",
    "wait_for_end",
]
