"""``init_process_group`` that binds to the node's own address (for user scripts).

Under petctl every node has its own private IP (and in the local cloud its own
127.x.y.z address). torch's defaults would bind the worker TCPStore to the
wildcard address and pick the gloo interface from the hostname. When the agent
exports ``PETCTL_LOCAL_ADDR`` this helper binds both to that address; without it
(plain ``torchrun``) it is exactly ``dist.init_process_group(backend)``.
"""

from __future__ import annotations

import datetime
import os
import socket

__all__ = ["init_process_group"]


def init_process_group(backend: str | None = None, timeout_s: float | None = None) -> str:
    """Initialise the default process group from the torchrun environment.

    Args:
        backend: ``nccl``/``gloo``; default nccl when CUDA is available, else gloo.
        timeout_s: collective/store timeout; default ``$PETCTL_COLLECTIVE_TIMEOUT`` or 60 s
            (torch's default is 30 min for gloo: a lost peer in init would stall that long).

    Returns:
        The backend used.
    """
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(
        seconds=timeout_s or float(os.environ.get("PETCTL_COLLECTIVE_TIMEOUT", "60"))
    )
    addr = os.environ.get("PETCTL_LOCAL_ADDR")
    if not addr:
        dist.init_process_group(backend, timeout=timeout)
        return backend

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    master_addr = os.environ["MASTER_ADDR"]
    master_port = int(os.environ["MASTER_PORT"])
    kwargs = {}
    if rank == 0 and master_addr == addr:
        # TCPStore has no bind-address option and listens on the wildcard address;
        # handing it a socket we bound ourselves keeps it on the node address.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, master_port))
        sock.listen(512)
        kwargs["master_listen_fd"] = sock.detach()
    store = dist.TCPStore(master_addr, master_port, world, rank == 0, timeout=timeout, **kwargs)
    pg_options = None
    if backend == "gloo":
        pg_options = dist.ProcessGroupGloo._Options()
        pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, pg_options=pg_options
    )
    return backend
