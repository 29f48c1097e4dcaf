"""The agent's decisions that need no process, no etcd and no AWS (unit-tested as such)."""

from __future__ import annotations

import signal
from collections.abc import Iterable

from petctl_agent import DRAIN_EXIT_CODE

#: exit "codes" of local ranks torch terminated after a sibling stopped: SIGTERM, then SIGKILL
#: once its grace period ran out (``PContext.close``)
TERMINATED_BY_TORCH = frozenset({-int(signal.SIGTERM), -int(signal.SIGKILL)})


def classify_exits(codes: Iterable[int | None]) -> str:
    """``drain`` or ``failure``: why a node's worker processes stopped.

    ``drain``: at least one local rank exited ``DRAIN_EXIT_CODE`` (it stopped on purpose
    after the coordinated checkpoint) and every other failed rank did too or was
    terminated by torch afterwards (-15, or -9 past torch's grace period): when one
    local rank exits, torch SIGTERMs its siblings. Everything else is a ``failure``.
    ``codes`` are the exit codes of the failed ranks only (torch leaves out ranks that exited 0).
    """
    seen = [c for c in codes]
    if DRAIN_EXIT_CODE not in seen:
        return "failure"
    if all(c == DRAIN_EXIT_CODE or c in TERMINATED_BY_TORCH for c in seen):
        return "drain"
    return "failure"


def capacity_coming(capacity: dict[str, int] | None, min_nodes: int) -> bool | None:
    """Does the worker group still bring us to ``min_nodes``? None = unknown (no group, API error).

    Yes while it has instances pending (launching) or a desired capacity of at least ``min_nodes``.
    """
    if capacity is None:
        return None
    return capacity.get("pending", 0) > 0 or capacity.get("desired", 0) >= min_nodes


def keep_waiting(elapsed: float, join_timeout: float, coming: bool | None) -> bool:
    """Below MIN after a rendezvous attempt timed out: wait on (True) or fail (False)?

    Always within ``join_timeout``. Past it only while the group says capacity is still
    coming (instances pending, or desired >= MIN: a capacity shortage, slow spot), and
    never past twice ``join_timeout`` (a group that never delivers must not bill forever).
    """
    if elapsed < join_timeout:
        return True
    return bool(coming) and elapsed < 2 * join_timeout


def describe_capacity(capacity: dict[str, int] | None) -> str:
    if capacity is None:
        return "worker group capacity unknown"
    return (
        f"worker group desired {capacity.get('desired', '?')}, in service {capacity.get('in_service', '?')}, "
        f"pending {capacity.get('pending', '?')}"
    )
