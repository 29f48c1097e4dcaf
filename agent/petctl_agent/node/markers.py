"""The job's marker files in its checkpoint dir, each carrying the run that wrote it.

The checkpoint dir (``<efs>/petctl/jobs/<job>/checkpoints``) is kept across runs of the same job
name, so a marker alone says "some run of this name"; a marker holds the spec's ``run_id`` and
counts only for that run. A spec without a ``run_id`` (an older petctl) is an unknown run: no
marker is of it.

- ``WORKERS_MARKER``: written by each node before its workers start; a terminal failure after that
  is not "every node keeps failing" (``node/failure.py``).
- ``SUCCESS_MARKER``: written once a node saw the workers succeed; a node that arrives after the job
  ended finds the rendezvous closed and this marker, and succeeds too (``node/ending.py``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

WORKERS_MARKER = ".petctl-workers-started"
SUCCESS_MARKER = ".petctl-job-succeeded"


def of_run(path: Path, run_id: str) -> bool:
    """Whether the marker ``path`` was written by the run ``run_id`` (never for an empty id)."""
    if not run_id:
        return False
    try:
        return path.read_text().strip() == run_id
    except OSError:  # absent, or the shared filesystem is unreadable
        return False


def mark(path: Path, run_id: str) -> None:
    """Make ``path`` a marker of ``run_id``, replacing one of an earlier run. Written whole under a
    temporary name and renamed, so a node reading it meanwhile never sees it half-written."""
    if of_run(path, run_id):
        return
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
