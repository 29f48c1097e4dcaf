"""The workers' ``PETCTL_*`` variables, each read by one function here (docs/agent.md, "Environment").

Standard library only. The agent sets most of them for its workers (``worker/env.py``), a job sets
the others (``run-job --env``); they are read in the workers (``petctl_agent.checkpoint``, the
``checkpointing`` and ``live`` rooms) and, where the agent bounds its own side by the workers'
setting, in the agent. One reader per variable keeps its default and how a bad value reads (a
number that does not parse is its default, as :func:`.settings.env_float` reads it) in one place;
``tests/unit/test_env_reads.py`` holds every variable to one reader. The agent's own knobs are
:class:`.settings.Settings`.

``env``: the mapping to read (default ``os.environ``), e.g. the environment a worker is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from petctl_agent.settings import env_float, env_int

#: checkpoints kept in the checkpoint directory
DEFAULT_KEEP = 3
#: seconds a checkpoint's collectives and its wait for EFS may take
DEFAULT_CHECKPOINT_TIMEOUT = 1800.0
#: seconds a restore from a peer's memory waits for a piece (and a joiner's fetch, for the agent)
DEFAULT_PEER_TIMEOUT = 60.0


def _get(name: str, env: Mapping[str, str] | None) -> str | None:
    return (os.environ if env is None else env).get(name) or None


def checkpoint_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``PETCTL_CHECKPOINT_DIR``: the job's checkpoint directory on EFS (None: unset or empty)."""
    return _get("PETCTL_CHECKPOINT_DIR", env)


def checkpoint_keep(env: Mapping[str, str] | None = None) -> int:
    """``PETCTL_CHECKPOINT_KEEP``: how many checkpoints a prune keeps (default 3)."""
    return env_int("PETCTL_CHECKPOINT_KEEP", DEFAULT_KEEP, env)


def checkpoint_timeout(env: Mapping[str, str] | None = None) -> float:
    """``PETCTL_CHECKPOINT_TIMEOUT``: seconds a checkpoint's collectives (its gloo group, the
    sharded save's EFS copy) and a wait for its persist may take (default 1800)."""
    return env_float("PETCTL_CHECKPOINT_TIMEOUT", DEFAULT_CHECKPOINT_TIMEOUT, env)


def snapshot_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``PETCTL_SNAPSHOT_DIR``: the node's memory-snapshot store (None: snapshots are off)."""
    return _get("PETCTL_SNAPSHOT_DIR", env)


def snapshot_peer_timeout(env: Mapping[str, str] | None = None) -> float:
    """``PETCTL_SNAPSHOT_PEER_TIMEOUT``: seconds a restore from a peer's memory waits per piece,
    and for its agent's fetch (default 60)."""
    return env_float("PETCTL_SNAPSHOT_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT, env)


def drain_file(env: Mapping[str, str] | None = None) -> str | None:
    """``PETCTL_DRAIN_FILE``: where the agent asks its workers to drain (None: no agent)."""
    return _get("PETCTL_DRAIN_FILE", env)


def progress_file(env: Mapping[str, str] | None = None) -> str | None:
    """``PETCTL_PROGRESS_FILE``: where local rank 0 records its last completed step (None: none)."""
    return _get("PETCTL_PROGRESS_FILE", env)


def local_addr(env: Mapping[str, str] | None = None) -> str | None:
    """``PETCTL_LOCAL_ADDR``: the node's address, which the workers bind to (None: unset)."""
    return _get("PETCTL_LOCAL_ADDR", env)
