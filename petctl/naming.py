"""Every name petctl gives a resource comes from here."""

from __future__ import annotations

import hashlib
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


def cleanup_group(job: str) -> str:
    """The one-shot group of ``kill-job --delete-checkpoints``."""
    return f"petctl-{job}-cleanup"


def job_prefix(job: str) -> str:
    """S3 key prefix of a job (no leading slash, trailing slash)."""
    return f"petctl/jobs/{job}/"


def log_group(profile: str) -> str:
    return f"/petctl/{profile}"


#: The range of the jobs' EFS uids/gids: above the ids of a distribution's users (below 65536) and
#: within what EFS access points accept (0 to 2**32 - 1), signed 32-bit for any tool that reads them.
EFS_POSIX_ID_MIN, EFS_POSIX_ID_MAX = 100_000, 2_147_483_647


def efs_posix_id(job: str) -> int:
    """The uid and gid of the job's files on EFS (its access point's PosixUser): the same for every
    run of one job name (its checkpoints stay its own), different for different names (all but
    certainly: 2**31 - 100000 values)."""
    digest = int.from_bytes(hashlib.sha256(f"petctl-efs:{job}".encode()).digest()[:8], "big")
    return EFS_POSIX_ID_MIN + digest % (EFS_POSIX_ID_MAX - EFS_POSIX_ID_MIN + 1)


__all__ = [
    "JOB_NAME_RE",
    "LIFECYCLE_HOOK",
    "PROFILE_RE",
    "RDZV_PORT",
    "base_stack",
    "checkpoint_dir",
    "efs_posix_id",
    "job_from_stack",
    "job_prefix",
    "job_stack",
    "log_group",
    "rdzv_group",
    "worker_group",
]
