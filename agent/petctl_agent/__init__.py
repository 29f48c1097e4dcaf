"""petctl node agent (``petctl-agent``) and the helpers user training scripts import.

Kept import-light on purpose: user scripts import :mod:`petctl_agent.checkpoint`
and must not pay for boto3 or the agent machinery. This package never imports
``petctl``; the contract between the CLI and the agent is the job spec
(docs/contracts.md).
"""

__all__ = ["DRAIN_EXIT_CODE"]

#: Exit code a worker uses after a coordinated drain checkpoint: "I stopped on
#: purpose at a checkpoint; re-rendezvous me, this is not a failure".
#: (75 = EX_TEMPFAIL, "try again later".)
DRAIN_EXIT_CODE = 75
