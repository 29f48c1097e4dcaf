"""``petctl-etcd`` in torch's handler registry: the creator that reads ``--rdzv-conf``, and
``python -m petctl_agent.rendezvous`` (the entry point is :mod:`.entry`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous.api import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

from petctl_agent.rendezvous.config import BACKEND, DEFAULT_PREFIX, Config

if TYPE_CHECKING:
    from petctl_agent.rendezvous.handler import PetctlRendezvousHandler


def create_handler(params: RendezvousParameters) -> PetctlRendezvousHandler:
    """Creator for torch's registry; ``--rdzv-conf`` keys: ttl, refresh, settle, hint_wait,
    hint_max, join_timeout, store_timeout, watch_timeout, watch_silence, request_timeout, record_ttl, straggler, join_window,
    stop_wait, reconnect_grace, key_prefix, and TLS: protocol, cacert, cert, key (see :class:`.Config`)."""
    # here, not at the top: torch may load our entry point while handler.py is being imported
    from petctl_agent.rendezvous.handler import PetctlRendezvousHandler

    knobs = ("ttl", "refresh", "settle", "hint_wait", "hint_max", "join_timeout", "store_timeout", "watch_timeout",
             "watch_silence", "request_timeout", "record_ttl", "straggler", "join_window", "stop_wait", "reconnect_grace")  # fmt: skip
    cfg = Config(
        **{k: float(params.get(k)) for k in knobs if params.get(k) is not None},
        protocol=str(params.get("protocol", "http")),
        cacert=params.get("cacert"),
        cert=params.get("cert"),
        key=params.get("key"),
    )
    return PetctlRendezvousHandler(
        params.run_id,
        params.endpoint,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        config=cfg,
        prefix=str(params.get("key_prefix", DEFAULT_PREFIX)),
    )


def register() -> None:
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:  # already registered (e.g. through the entry point): keep that one
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m petctl_agent.rendezvous <torchrun args>``: torchrun with ``petctl-etcd`` registered."""
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)
