"""petctl node agent (``petctl-agent``) and the helpers user training scripts import.

Kept import-light on purpose: user scripts import :mod:`petctl_agent.checkpoint`
and must not pay for boto3 or the agent machinery. This package never imports
``petctl``; the contract between the CLI and the agent is the job spec
(docs/contracts.md).
"""

__all__ = ["DRAIN_EXIT_CODE", "EXIT_FAILED", "EXIT_JOIN_TIMEOUT", "EXIT_TERMINAL", "TERMINAL_EXITS"]

#: Exit code a worker uses after a coordinated drain checkpoint: "I stopped on
#: purpose at a checkpoint; re-rendezvous me, this is not a failure".
#: (75 = EX_TEMPFAIL, "try again later".)
DRAIN_EXIT_CODE = 75

# Exit statuses of ``petctl-agent run`` (the unit's main process). systemd restarts the agent on
# a failure (``Restart=on-failure``) unless its status is listed in the unit's
# ``RestartPreventExitStatus=`` (cfn_templates/user_data/worker.sh.j2 lists TERMINAL_EXITS; a
# unit test keeps them equal). docs/contracts.md, "Agent exit statuses".

#: A crash or a failure a restart may cure (S3 or IMDS unreachable at start): systemd restarts.
EXIT_FAILED = 1
#: A terminal failure no restart can cure: a bad spec, the wrong torch, an unwritable checkpoint or
#: work directory, the job's workers failed for good (78 = EX_CONFIG). The agent marks its
#: instance Unhealthy and counts it as a failed boot.
EXIT_TERMINAL = 78
#: This node's rendezvous timed out (``join_timeout``): terminal like EXIT_TERMINAL.
EXIT_JOIN_TIMEOUT = 79
#: The statuses systemd must not restart (the unit's ``RestartPreventExitStatus=``).
TERMINAL_EXITS = (EXIT_TERMINAL, EXIT_JOIN_TIMEOUT)
