"""Worker exits in the agent's log without torch's agent-side traceback (the first drain stalled on it)."""

from __future__ import annotations

import logging


class _NoAgentTraceback(logging.Filter):
    """Log a worker's exit without the agent-side traceback (its text stays in the message).

    torch logs every worker exit with ``logger.exception``; torch's log formatter imports
    ``torch._dynamo`` the first time it formats an exception: 1-3 s in the agent on a busy
    2-core box, spent between the workers' exit and the re-rendezvous (measured: the first
    drain of every agent stalled ~2 s in ``MultiprocessContext._poll``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_worker_exit_tracebacks() -> None:
    """Install :class:`_NoAgentTraceback` on torch's worker-process logger (idempotent)."""
    lg = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoAgentTraceback) for f in lg.filters):
        lg.addFilter(_NoAgentTraceback())
