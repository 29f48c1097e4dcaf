"""``init_process_group`` for user scripts: the rank's GPU, NCCL + gloo, the node's address.

- **Device.** With CUDA, every rank binds ``cuda:<LOCAL_RANK>`` (``torch.cuda.set_device``
  and ``device_id=``) *before* the first collective, and the process group is
  ``cpu:gloo,cuda:nccl``: CUDA tensors go through NCCL, CPU tensors (the
  checkpoint helper's barriers, user bookkeeping) through gloo. Without
  ``device_id`` every local rank's first NCCL call lands on GPU 0. NCCL refuses
  two ranks on one GPU, so ``LOCAL_RANK >= device_count`` is an error here, with
  the numbers, instead of a hang or an NCCL error at the first all-reduce.
  The decision is :func:`select_device`, a pure function (unit-tested on CPU).
- **Address.** Under petctl every node has its own private IP (in the local cloud its
  own 127.x.y.z address). When the agent exports ``PETCTL_LOCAL_ADDR`` the worker
  TCPStore listens on that address (a pre-bound socket passed as ``master_listen_fd``).
  For pure gloo the gloo device is also requested on it; torch 2.13 ignores gloo
  ``pg_options`` (``_new_process_group_helper`` builds ``ProcessGroupGloo`` from the
  timeout alone), so gloo picks its interface from the hostname as usual.
- **Timeout.** 60 s (``PETCTL_COLLECTIVE_TIMEOUT``) instead of gloo's 30 min / NCCL's
  10 min: a lost peer is noticed quickly. Checkpoint barriers do not use it (see
  :mod:`petctl_agent.checkpoint`).

Without ``PETCTL_LOCAL_ADDR`` (plain ``torchrun``) the store comes from the usual
``env://`` variables; device binding is the same.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from petctl_agent import knobs

__all__ = ["DevicePlan", "init_process_group", "rank_device", "select_device"]

MIXED_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class DevicePlan:
    """What :func:`init_process_group` does on this rank.

    ``backend``: the string passed to ``torch.distributed.init_process_group``;
    ``device``: ``"cuda:<i>"`` (then ``set_device(i)`` and ``device_id=cuda:i``) or ``"cpu"``.
    """

    backend: str
    device: str
    local_rank: int

    @property
    def cuda_index(self) -> int | None:
        return int(self.device.split(":", 1)[1]) if self.device.startswith("cuda:") else None


def select_device(
    env: Mapping[str, str], cuda_available: bool, device_count: int, backend: str | None = None
) -> DevicePlan:
    """Choose backend and device for this rank (pure: no torch, no CUDA calls).

    Args:
        env: the process environment (``LOCAL_RANK``; default 0).
        cuda_available: ``torch.cuda.is_available()``.
        device_count: ``torch.cuda.device_count()`` (after ``CUDA_VISIBLE_DEVICES``).
        backend: explicit backend; default ``cpu:gloo,cuda:nccl`` with CUDA, else ``gloo``.

    Raises:
        ValueError: a bad ``LOCAL_RANK``; a CUDA backend without CUDA; more local ranks
            than visible GPUs (NCCL forbids two ranks on one GPU).
    """
    raw = env.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    if backend is None:
        backend = MIXED_BACKEND if cuda_available else "gloo"
    wants_cuda = "nccl" in backend or "cuda:" in backend
    if not wants_cuda:
        return DevicePlan(backend, "cpu", local_rank)
    if not cuda_available or device_count <= 0:
        raise ValueError(f"backend {backend!r} needs CUDA, but no GPU is visible to this process")
    if local_rank >= device_count:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {device_count} GPU(s) are visible"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + f": NCCL forbids two ranks on one GPU; run at most {device_count} process(es) per node"
        )
    return DevicePlan(backend, f"cuda:{local_rank}", local_rank)


def rank_device():  # -> torch.device
    """The device this rank computes on: where checkpoints load and the drain agreement runs.

    The default process group's bound device (set by :func:`init_process_group`), else
    ``cuda:<current>`` for an NCCL group or a process that already uses CUDA, else CPU.
    Never initialises CUDA by itself.
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        if bound is not None:
            return bound
        if "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(backend: str | None = None, timeout_s: float | None = None) -> str:
    """Initialise the default process group from the torchrun environment.

    Args:
        backend: default ``cpu:gloo,cuda:nccl`` when CUDA is available, else ``gloo``.
        timeout_s: collective/store timeout; default ``$PETCTL_COLLECTIVE_TIMEOUT`` or 60 s.

    Returns:
        The backend used.

    Raises:
        ValueError: see :func:`select_device`.
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    plan = select_device(os.environ, cuda, torch.cuda.device_count() if cuda else 0, backend)
    kwargs = {}
    if plan.cuda_index is not None:
        # before any collective: NCCL communicators and barriers use the current device
        torch.cuda.set_device(plan.cuda_index)
        kwargs["device_id"] = torch.device("cuda", plan.cuda_index)
    timeout = datetime.timedelta(
        seconds=timeout_s or float(os.environ.get("PETCTL_COLLECTIVE_TIMEOUT", "60"))
    )
    addr = knobs.local_addr()
    if not addr:
        dist.init_process_group(plan.backend, timeout=timeout, **kwargs)
        return plan.backend

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    master_addr = os.environ["MASTER_ADDR"]
    master_port = int(os.environ["MASTER_PORT"])
    store_kwargs = {}
    # rank 0's agent serves the store (torchrun's way, petctl's default), listening before any
    # worker starts: every rank is a client
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if serves and master_addr == addr:
        # TCPStore has no bind-address option and listens on the wildcard address;
        # handing it a socket we bound ourselves keeps it on the node address.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, master_port))
        sock.listen(512)
        store_kwargs["master_listen_fd"] = sock.detach()
    elif not serves:
        await_listener(master_addr, master_port, timeout.total_seconds())
    store = dist.TCPStore(master_addr, master_port, world, serves, timeout=timeout, **store_kwargs)
    if plan.backend == "gloo":
        # (NCCL rejects gloo options: only for a pure gloo group.)
        pg_options = dist.ProcessGroupGloo._Options()
        pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
        kwargs["pg_options"] = pg_options
    dist.init_process_group(plan.backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return plan.backend


#: the longest a rank polls for rank 0's store before torch's own client (and its timeout) takes
#: over: the poll must not add a second whole timeout to a start whose rank 0 never comes
AWAIT_LISTENER_MAX = 60.0


def await_listener(addr: str, port: int, timeout_s: float) -> bool:
    """Wait until ``addr:port`` accepts a connection (rank 0's store listens); False when it did not
    within ``min(timeout_s, AWAIT_LISTENER_MAX)`` or the name does not resolve.

    torch's ``TCPStore`` client meets a refused connection with an exponential backoff with
    jitter: a rank that starts before rank 0's store listens connected 0.36-0.56 s (median) after
    it did, up to 0.67 s (``bench/bench_store_connect.py``). After a membership change every
    rank starts at once, so one often does; this poll (10 ms apart) lets the client's own first
    connect succeed. Its probe closes without a byte, which the store's server drops (a worker is
    counted by the client's ``add`` on the init key, which a probe never sends). The name is
    resolved once, not at every poll (a VPC's resolver limits packets per interface). After it,
    the client's own timeout and error take over, as without it."""
    deadline = time.monotonic() + min(timeout_s, AWAIT_LISTENER_MAX)
    try:
        # every address of the name, as torch's client tries them (localhost: ::1, then 127.0.0.1)
        targets = [
            (f, k, p, sa) for f, k, p, _, sa in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        ]
    except OSError:
        return False
    while True:
        for family, kind, proto, sockaddr in targets:
            try:
                with socket.socket(family, kind, proto) as s:
                    s.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                    s.connect(sockaddr)
                    return True
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def dist_on() -> bool:
    """Is a default process group initialised in this process?"""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def dist_rank() -> int:
    """This process's rank: the process group's, else ``$RANK``, else 0."""
    if dist_on():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def dist_world() -> int:
    """The process group's size, or 1 without one."""
    if dist_on():
        import torch.distributed as dist

        return dist.get_world_size()
    return 1
