"""Every name petctl gives a resource comes from here."""

from __future__ import annotations

import re

JOB_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
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


def checkpoint_dir(job: str) -> str:
    """Checkpoint directory relative to the shared filesystem mount."""
    return f"petctl/jobs/{job}/checkpoints"


def log_group(profile: str) -> str:
    return f"/petctl/{profile}"
