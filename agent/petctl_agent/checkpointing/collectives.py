"""The sharded memory path's small collectives over the checkpoint's gloo group (``group.py``):
every rank's JSON-able value in rank order (no pickle), whether every rank says yes, a barrier.

``sharded_memory``'s save and restore agree through these, and so do the replica exchange
(``replicas.py``) and the byte-range receive (``ranges.py``, handed :func:`gather_json` and
:func:`group`). No torch at import.
"""

from __future__ import annotations

import json
from typing import Any

from petctl_agent.distributed import dist_on, dist_world


def group() -> Any:
    from petctl_agent.checkpointing.group import ckpt_group

    return ckpt_group()


def gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, over the checkpoint group. No pickle."""
    if not dist_on():
        return [obj]
    import torch
    import torch.distributed as dist

    g = group()
    raw = json.dumps(obj).encode()
    n = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist_world())]
    dist.all_gather(sizes, n, group=g)
    top = max(int(s) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.zeros(top, dtype=torch.uint8) for _ in range(dist_world())]
    dist.all_gather(outs, buf, group=g)
    return [json.loads(bytes(o[: int(s)].numpy())) for o, s in zip(outs, sizes)]


def first_said(value: Any) -> Any:
    """The first non-empty ``value`` any rank gave, in rank order (None: none did); one gather. How
    one rank's failure becomes every rank's, agreed before the collectives it would skip."""
    return next((v for v in gather_json(value) if v), None)


def all_ok(ok: bool) -> bool:
    if not dist_on():
        return ok
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group())
    return bool(int(t[0]))


def barrier() -> None:
    from petctl_agent.checkpointing.group import barrier

    barrier()
