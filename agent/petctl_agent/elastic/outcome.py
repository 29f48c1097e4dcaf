"""What :meth:`PetctlElasticAgent.run` returns (:class:`Outcome`); how a failure of the workers
reads is ``failures.py``.

torch-free at import (``node.ending`` reads the outcome without the torch agent).
"""

from __future__ import annotations

import enum


class Outcome(enum.Enum):
    """How :meth:`PetctlElasticAgent.run` ended for this node."""

    SUCCEEDED = "succeeded"  # every worker exited 0 (the job is done)
    DRAINED = "drained"  # this node left gracefully (a drain, or a leave while joining)
    JOIN_TIMEOUT = "join_timeout"  # never reached min_nodes: fails this node, not the job
    CLOSED = "closed"  # another node closed the rendezvous (the job ended or failed elsewhere)
    FAILED = "failed"  # unrecoverable here (restart budget spent, an unexpected error)
    #: failed rounds in a row began on this node: it left the job for good (elastic/culprit.py)
    EXCLUDED = "excluded"
