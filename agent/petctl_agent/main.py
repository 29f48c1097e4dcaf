"""``petctl-agent run``: the command line. The agent itself is :class:`petctl_agent.node.agent.Agent`.

Environment contract: docs/contracts.md ("Agent environment") and docs/agent.md, read once
into :class:`petctl_agent.settings.Settings`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Protocol

from petctl_agent.cloud.imds import Imds
from petctl_agent.node.agent import Agent
from petctl_agent.settings import Settings
from petctl_agent.spec import SpecError

log = logging.getLogger("petctl_agent")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="petctl-agent", description="petctl node agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run this node's part of the job")
    r.add_argument("--spec", help="job spec: s3://..., file://... or a path (default: IMDS tag petctl:spec)")
    r.add_argument(
        "--rdzv-endpoint", help="etcd HOST[:PORT] (default: IMDS tag petctl:rdzv + spec rdzv_port)"
    )
    r.add_argument("--local-addr", help="this node's address (default: IMDS local-ipv4)")
    return p.parse_args(argv)


class _Leaves(Protocol):
    def request_leave(self, reason: str) -> None: ...


def _install_signal_handlers(agent: _Leaves) -> None:
    """SIGTERM and SIGINT make the agent leave (spot reclaim, scale-in, systemd's stop).

    The leave runs on a thread of its own, which the handler only wakes. A handler runs in the
    main thread, inside whatever it was doing, and the leave takes locks and joins threads:
    run there, it met a keepalive thread half-started (``Lease.start``) and failed the agent,
    and a lock the main thread held would hang it. Waking an Event takes no lock the main
    thread can hold. The first signal's name is the reason."""
    reasons: list[str] = []
    asked = threading.Event()

    def leave_when_asked() -> None:
        asked.wait()
        agent.request_leave(reasons[0])

    threading.Thread(target=leave_when_asked, name="petctl-signal-leave", daemon=True).start()

    def on_signal(signum: int, _frame: Any) -> None:
        if not reasons:
            reasons.append(f"signal {signal.Signals(signum).name}")
        asked.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``petctl-agent``."""
    args = _parse(argv)
    settings = Settings.from_env()
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(settings.torch_log)
    for noisy in ("botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from petctl_agent.elastic.tracebacks import quiet_worker_exit_tracebacks

    quiet_worker_exit_tracebacks()
    agent = Agent(args, settings, Imds(settings.imds_url))
    _install_signal_handlers(agent)
    try:
        rc = agent.run()
    except SpecError as e:  # before the status publisher exists: nowhere to report but here
        log.error("FAILED: %s", e)
        return 1
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
