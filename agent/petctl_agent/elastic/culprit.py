"""Which node a failed round's failure began on, and how many failed rounds in a row began there.

A node that is alive but cannot train (a GPU that errors, a network path that drops) keeps its
lease, so no membership change explains the failures it causes: every rank of every node fails,
round after round, and the job spends its restart budget and fails. With gloo or NCCL one rank's
failure makes every other rank's collective fail a little later, so the node whose workers
failed *first* is the one a failure names (its **culprit**). After ``exclude_after`` (K) failed
rounds in a row that name the same node, with no progress in between, that node's own agent
leaves the job for good and marks its instance Unhealthy (``PetctlElasticAgent._exclude``).

Each node whose workers failed writes a :class:`Failure` beside the round
(``failurebook.py``: ``failures/<round>/<instance-id>``); once its failure grace is over
(no membership change explained it) it reads them all, and the first node to do so stores the
round's culprit with its count (``culprits/<round>``, create-if-absent: every node then reads the
same). Pure functions here (unit-tested as such): :func:`failure_time`, :func:`can_begin`,
:func:`first_failure`, :func:`count_for`, :func:`own_error`.

**What names the culprit**: the earliest :attr:`Failure.t`, the wall-clock time this node's first
worker began to fail: the worker's own note when its script raised (``$PETCTL_FAILURE_FILE``'s
``t``, written before the process exits), else the moment the agent saw the exit. A node whose
failed ranks all stopped for a drain (75) or were terminated by torch after a sibling (-15, -9)
never began a failure (:func:`can_begin`). **What resets the count**: progress, read as the job's
newest checkpoint step (``last_checkpoint_step``, the ``latest`` file on the shared filesystem):
a failure counts on from the previous one only when it names the same node *and* no newer
checkpoint was saved in between; otherwise it starts a new count at 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.elastic.decisions import TERMINATED_BY_TORCH

#: the default K: failed rounds in a row that name the same node before it is excluded
EXCLUDE_AFTER = 3


@dataclass(frozen=True)
class Failure:
    """One node's failure in one round, as it writes it beside the round."""

    node: str  #: its instance id
    t: float  #: when its first worker began to fail (wall clock: nodes' clocks are NTP-synced)
    begins: bool  #: can it have begun the round's failure (:func:`can_begin`)
    ckpt: int | None = None  #: the job's newest checkpoint step when it failed (progress)
    #: its workers' exception line, without the node (``failures.signature``'s): None for a signal
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Failure | None:
        try:
            ckpt = d.get("ckpt")
            return cls(
                node=str(d["node"]),
                t=float(d["t"]),
                begins=bool(d.get("begins", True)),
                ckpt=int(ckpt) if ckpt is not None else None,
                error=d.get("error"),
            )
        except (KeyError, TypeError, ValueError):
            return None


def failure_time(noted_at: float | None, exit_seen_at: float | None, now: float) -> float:
    """When this node's workers began to fail: the earliest of a worker's failure note (its
    script raised, before the process exited) and the agent's sight of the first exit; ``now``
    when neither is known."""
    known = [t for t in (noted_at, exit_seen_at) if t is not None]
    return min(known) if known else now


def can_begin(codes: Iterable[int | None], noted: bool) -> bool:
    """Can this node's failure be the one a round's failure began with? Yes when a worker's
    script raised (``noted``) or a rank exited with a code of its own; never when every failed
    rank stopped for a drain (75) or was terminated by torch after a sibling (-15, -9)."""
    if noted:
        return True
    return any(c is not None and c != DRAIN_EXIT_CODE and c not in TERMINATED_BY_TORCH for c in codes)


def first_failure(failures: Iterable[Failure]) -> Failure | None:
    """The round's culprit: the earliest failure that can begin one (ties: the smaller id, so that
    every node picks the same). None when none can, or when only one node failed: a failure that
    did not spread to another node names nobody (a node alone in its job keeps today's rules:
    its restart budget and the deterministic-failure rule)."""
    failures = list(failures)
    if len({f.node for f in failures}) < 2:
        return None
    cands = [f for f in failures if f.begins]
    return min(cands, key=lambda f: (f.t, f.node)) if cands else None


def count_for(first: Failure, previous: Mapping[str, Any] | None) -> int:
    """How many failed rounds in a row, this one included, began on ``first.node``.

    ``previous``: the culprit record of the newest earlier failed round (``node``, ``count``,
    ``ckpt``), or None. The count goes on only if that round named the same node and no newer
    checkpoint was saved since (the job made no progress in between); else it starts at 1."""
    if not previous or previous.get("node") != first.node:
        return 1
    if first.ckpt != previous.get("ckpt"):
        return 1  # a newer checkpoint since: the rounds in between trained
    try:
        return int(previous.get("count", 0)) + 1
    except (TypeError, ValueError):
        return 1


#: an exception line that can come from the node rather than the script: its GPU, its driver,
#: its network path or its process group (a script's own bug raises something else: an
#: AssertionError, a KeyError, a ValueError of its own)
NODE_FAULT = re.compile(
    r"CUDA|cuda|NCCL|nccl|cuDNN|cublas|CUBLAS|ECC|Xid|device-side|illegal memory access|out of memory"
    r"|[Cc]onnection (closed|reset|refused)|[Bb]roken pipe|[Ss]ocket|[Tt]imed? ?out|[Ww]atchdog"
    r"|gloo|Gloo|libfabric|EFA|ProcessGroup|DistBackendError|DistNetworkError"
)


def own_error(mine: Failure, failures: Iterable[Failure]) -> bool:
    """Is this node's error its own, a fault of the node: an error of its GPU, driver or network
    (:data:`NODE_FAULT`) or a death without a Python error (a signal), that no other node of the
    round had? Then the deterministic-failure rule (``failures.RepeatWatch``) does not end the
    job for it and the count excludes the node at K. A script's bug stays the script's even when
    only one rank raises it (code that runs on rank 0 alone: its evaluation, its logging): the
    rule ends the job at its second identical failure, as before, rather than replacing one
    healthy node after another. False when no other node failed."""
    others = [f for f in failures if f.node != mine.node]
    if not others:
        return False  # nobody else failed: nothing says the error is this node's rather than the script's
    if mine.error and not NODE_FAULT.search(mine.error):
        return False
    return not mine.error or not any(f.error == mine.error for f in others)


def culprit_record(first: Failure, count: int, round_: int | None) -> dict[str, Any]:
    """What ``culprits/<round>`` holds."""
    return {"node": first.node, "t": first.t, "count": count, "ckpt": first.ckpt, "round": round_}
