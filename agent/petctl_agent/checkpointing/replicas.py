"""Where a sharded step's bytes go between nodes: the ring (each rank's replica goes to the next rank
on another node; each node's lowest rank, its leader, decides for it), what one step takes of each
node's memory (its ranks' shards plus the replicas it receives), and the exchange after
``dcp.save``: ``.metadata`` to every node, each rank's files to its ring target, bounded by
``PETCTL_SHARD_FETCH_TIMEOUT`` (default 300 s; the restore's fetch shares it).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import collectives, shardfiles


def fetch_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("PETCTL_SHARD_FETCH_TIMEOUT", "300")))


def local_bytes(obj: Any, depth: int = 0) -> int:
    """Upper bound of the bytes this rank's DCP files hold: every tensor's local part."""
    import torch

    if depth > 32:
        return 0
    if hasattr(obj, "to_local") and hasattr(obj, "device_mesh"):  # DTensor
        t = obj.to_local()
        return t.numel() * t.element_size()
    if hasattr(obj, "local_shards"):  # ShardedTensor
        return sum(s.tensor.numel() * s.tensor.element_size() for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_bytes(v, depth + 1) for v in obj)
    return 0


def _ring_target(rank: int, nodes: list[str]) -> int | None:
    """The first rank after ``rank`` (cyclically) on another node; None on a single node."""
    w = len(nodes)
    for k in range(1, w):
        s = (rank + k) % w
        if nodes[s] != nodes[rank]:
            return s
    return None


def leader(rank: int, nodes: list[str]) -> int:
    return min(r for r, n in enumerate(nodes) if n == nodes[rank])


def node_needs(info: list[dict[str, Any]], nodes: list[str]) -> dict[str, int]:
    """Bytes each node's memory takes for one step: its ranks' shards plus the replicas it receives."""
    need: dict[str, int] = {}
    multi = len(set(nodes)) > 1
    for r, i in enumerate(info):
        need[nodes[r]] = need.get(nodes[r], 0) + int(i["bytes"])
        t = _ring_target(r, nodes) if multi else None
        if t is not None:
            need[nodes[t]] = need.get(nodes[t], 0) + int(i["bytes"])
    return need


def exchange(
    stepdir: Path, rank: int, nodes: list[str], sizes: list[dict[str, int]], leader: bool
) -> dict[str, int]:
    """``.metadata`` to every node, each rank's files to its ring target. Returns what we received."""
    import torch
    import torch.distributed as dist

    g = collectives.group()
    got: dict[str, int] = {}
    msize = sizes[0][".metadata"]
    meta = (
        shardfiles.read_tensor(stepdir / ".metadata", msize)
        if rank == 0
        else torch.empty(msize, dtype=torch.uint8)
    )
    dist.broadcast(meta, src=0, group=g)
    if rank != 0 and leader and nodes[rank] != nodes[0]:
        shardfiles.write_atomic(stepdir / ".metadata", meta)
        got[".metadata"] = 0
    works = []
    recvs: list[tuple[str, int, Any]] = []
    target = _ring_target(rank, nodes)
    if target is not None:
        for i, n in enumerate(sorted(k for k in sizes[rank] if k != ".metadata")):
            works.append(
                dist.isend(shardfiles.read_tensor(stepdir / n, sizes[rank][n]), dst=target, group=g, tag=i)
            )
    for src in range(len(nodes)):
        if src != rank and _ring_target(src, nodes) == rank:
            for i, n in enumerate(sorted(k for k in sizes[src] if k != ".metadata")):
                buf = torch.empty(sizes[src][n], dtype=torch.uint8)
                works.append(dist.irecv(buf, src=src, group=g, tag=i))
                recvs.append((n, src, buf))
    for w in works:
        w.wait(fetch_timeout())
    for n, src, buf in recvs:
        shardfiles.write_atomic(stepdir / n, buf)
        got[n] = src
    return got
