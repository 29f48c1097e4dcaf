"""Joining a rendezvous round: how long to keep trying, and which errors to try again.

torch's join timeout is one attempt (``PETCTL_AGENT_RDZV_ATTEMPT``); the job's bound is
``join_timeout``, and past it the node still waits while its worker group says capacity is
coming (``decisions.keep_waiting``). Errors torch lets escape a join (an etcd restart, a peer
dying between "round complete" and "MASTER_ADDR published") are retried within the same bound.
A leave request ends the wait after any attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from petctl_agent.elastic.decisions import capacity_coming, describe_capacity, keep_waiting
from petctl_agent.elastic.handlers import TRANSIENT_RDZV_ERRORS, LeftRendezvous, reset_lost_state

log = logging.getLogger("petctl_agent.elastic")  # the torch agent's lines, under its logger as before


def join_round(
    join: Callable[[], None],
    handler: Any,
    mine: Any,
    leave: threading.Event,
    *,
    join_timeout: float,
    min_nodes: int,
    capacity_probe: Callable[[], dict[str, int] | None],
    retry: bool,
    waiting: Callable[[str], None],
) -> None:
    """Call ``join`` (one attempt) until a round is complete.

    Args:
        join: one join attempt (torch's ``SimpleElasticAgent._rendezvous``).
        handler: the rendezvous handler; ``mine``: the same when it is petctl-etcd's, else None.
        leave: set when this node must leave; then raises :class:`LeftRendezvous`.
        capacity_probe: the worker group's capacity (None: unknown); read at each timed-out attempt.
        retry: retry the transient errors (the ``RDZV_RETRY`` workaround).
        waiting: told the reason while the node waits on below ``min_nodes``.

    Raises:
        RendezvousClosedError: another node closed the rendezvous.
        RendezvousTimeoutError: the bound is up.
        LeftRendezvous: a leave was requested (or petctl-etcd's handler left) while joining.
    """
    t0 = time.monotonic()
    attempt = 0
    while True:
        try:
            join()
            return
        except RendezvousClosedError:
            raise
        except RendezvousGracefulExitError as e:  # petctl-etcd: we left (request_leave) while joining
            raise LeftRendezvous(f"left the rendezvous while joining ({e})") from None
        except RendezvousTimeoutError:
            elapsed = time.monotonic() - t0
            capacity = _probe(capacity_probe)
            coming = capacity_coming(capacity, min_nodes)
            if not keep_waiting(elapsed, join_timeout, coming):
                raise RendezvousTimeoutError(
                    f"below min_nodes for {elapsed:.0f}s (join_timeout {join_timeout:.0f}s; "
                    f"{describe_capacity(capacity)})"
                ) from None
            log.info(
                "still below min_nodes after %.0fs (%s); waiting on", elapsed, describe_capacity(capacity)
            )
            waiting(f"waiting for nodes ({describe_capacity(capacity)})")
        except TRANSIENT_RDZV_ERRORS as e:
            attempt += 1
            if not retry:
                raise
            if time.monotonic() - t0 > join_timeout:
                raise RendezvousTimeoutError(
                    f"no complete round within the join timeout; last error {type(e).__name__}: {e}"
                ) from e
            # torch lets these escape agent.run(), which would kill the agent. Retry: the next
            # attempt exits and re-joins a round.
            log.warning("rendezvous attempt %d failed (%s: %s); retrying", attempt, type(e).__name__, e)
            reset_lost_state(handler)
            time.sleep(min(0.5 * attempt, 3.0))
        if leave.is_set():
            if mine is not None:
                mine.leave()
            raise LeftRendezvous("asked to leave while waiting to join")


def _probe(capacity_probe: Callable[[], dict[str, int] | None]) -> dict[str, int] | None:
    try:
        return capacity_probe()
    except Exception as e:  # noqa: BLE001 - unknown capacity: decide on the join timeout alone
        log.warning("cannot read the worker group's capacity (%s)", e)
        return None
