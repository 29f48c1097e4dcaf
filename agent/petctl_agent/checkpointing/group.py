"""The checkpoint's own process group: a gloo group over all ranks whose timeout
(``PETCTL_CHECKPOINT_TIMEOUT``, default 1800 s) is independent of the collective timeout.

Why a separate gloo group rather than ``barrier()`` on the default group: under NCCL a barrier
is an NCCL collective, and the watchdog aborts the process when it is still pending after the
group's timeout (60 s here) -- while rank 0 is writing a large checkpoint to EFS. Gloo has no
watchdog; its timeout is per operation.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from petctl_agent import knobs
from petctl_agent.distributed import dist_on

_ckpt_group_for: tuple[Any, Any] | None = None  # (default group it was made for, gloo group)


def _barrier_timeout() -> timedelta:
    return timedelta(seconds=knobs.checkpoint_timeout())


def ckpt_group() -> Any:
    """The gloo checkpoint group (created on first use, again for a new default group; collective)."""
    global _ckpt_group_for
    import torch.distributed as dist

    world = dist.group.WORLD
    if _ckpt_group_for is None or _ckpt_group_for[0] is not world:
        _ckpt_group_for = (world, dist.new_group(backend="gloo", timeout=_barrier_timeout()))
    return _ckpt_group_for[1]


def barrier() -> None:
    """Every rank waits here until all arrived (no-op without a process group).

    ``monitored_barrier`` on the checkpoint group: CPU-only, its own timeout, and on
    timeout rank 0 names the ranks that never arrived.
    """
    if not dist_on():
        return
    import torch.distributed as dist

    dist.monitored_barrier(group=ckpt_group(), timeout=_barrier_timeout(), wait_all_ranks=True)
