"""Every name petctl gives a resource comes from here."""

from __future__ import annotations

import re

# The job-name rule and the checkpoint path are the agent's too: defined once, in the job spec.
from petctl_agent.spec import JOB_NAME_RE, checkpoint_dir

# Profile names become stack names (petctl-<profile>): letters, digits, '-' only. "job-*" would
# collide with job stacks (petctl-job-<job>).
PROFILE_RE = re.compile(r"^(?!job-)[A-Za-z0-9][A-Za-z0-9-]{0,31}$")
LIFECYCLE_HOOK = "petctl-drain"
RDZV_PORT = 2379


def base_stack(profile: str) -> str:
    return f"petctl-{profile}"


def job_stack(job: str) -> str:
    return f"petctl-job-{job}"


def job_from_stack(stack_name: str) -> str | None:
    prefix = "petctl-job-"
    return stack_name[len(prefix) :] if stack_name.startswith(prefix) else None


def worker_group(job: str) -> str:
    return f"petctl-{job}-workers"


def rdzv_group(job: str) -> str:
    return f"petctl-{job}-rdzv"


def job_prefix(job: str) -> str:
    """S3 key prefix of a job (no leading slash, trailing slash)."""
    return f"petctl/jobs/{job}/"


def log_group(profile: str) -> str:
    return f"/petctl/{profile}"


__all__ = [
    "JOB_NAME_RE",
    "LIFECYCLE_HOOK",
    "PROFILE_RE",
    "RDZV_PORT",
    "base_stack",
    "checkpoint_dir",
    "job_from_stack",
    "job_prefix",
    "job_stack",
    "log_group",
    "rdzv_group",
    "worker_group",
]
