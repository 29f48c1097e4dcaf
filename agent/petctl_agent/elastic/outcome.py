"""What :meth:`PetctlElasticAgent.run` returns (:class:`Outcome`) and how a failure of the workers reads.

torch-free at import (``node.ending`` reads the outcome without the torch agent).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult


class Outcome(enum.Enum):
    """How :meth:`PetctlElasticAgent.run` ended for this node."""

    SUCCEEDED = "succeeded"  # every worker exited 0 (the job is done)
    DRAINED = "drained"  # this node left gracefully (a drain, or a leave while joining)
    JOIN_TIMEOUT = "join_timeout"  # never reached min_nodes: fails this node, not the job
    CLOSED = "closed"  # another node closed the rendezvous (the job ended or failed elsewhere)
    FAILED = "failed"  # unrecoverable here (restart budget spent, an unexpected error)


def describe_failures(result: RunResult) -> str:
    """One line per failed rank: its exit code and torch's message (the status document's reason)."""
    parts = []
    for rank, f in sorted(result.failures.items()):
        msg = ""
        try:
            msg = f.message if isinstance(f.message, str) else str(f.message)
        except Exception:  # noqa: BLE001
            pass
        parts.append(
            f"rank {rank} exit {f.exitcode}" + (f" ({msg[:200]})" if msg and "<N/A>" not in msg else "")
        )
    return "; ".join(parts) or "unknown"
