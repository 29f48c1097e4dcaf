"""Sharded checkpoints (any ``DTensor``/``ShardedTensor`` in the state, e.g. FSDP2 state dicts).

Every rank writes its own shard with ``torch.distributed.checkpoint`` into a hidden temp
directory, which rank 0 renames to ``ckpt-<step:010d>.dcp`` once all are written. It loads at
any world size (DCP reshards), into the state dict the caller passes. The DCP coordination
(plans, metadata) runs on the checkpoint group (:mod:`petctl_agent.checkpointing.group`): same timeout.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing.atomic import fsync_dir
from petctl_agent.checkpointing.files import CKPT_RE, prune, write_pointer
from petctl_agent.checkpointing.group import barrier, ckpt_group
from petctl_agent.distributed import dist_on, dist_rank, dist_world


class NeedsStateError(TypeError):
    """The checkpoint is sharded: loading it needs the state dict to load into."""


def is_sharded(obj: Any, _depth: int = 0) -> bool:
    """Does ``obj`` (nested dicts/lists) hold a DTensor or ShardedTensor?

    Only looks for the classes when their modules are loaded: no sharded tensor can
    exist otherwise, and plain scripts do not pay for importing them.
    """
    kinds = []
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and hasattr(dt, "DTensor"):
        kinds.append(dt.DTensor)
    st = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st is not None and hasattr(st, "ShardedTensor"):
        kinds.append(st.ShardedTensor)
    if not kinds:
        return False
    kinds_t = tuple(kinds)

    def walk(o: Any, depth: int) -> bool:
        if isinstance(o, kinds_t):
            return True
        if depth > 32:
            return False
        if isinstance(o, dict):
            return any(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return any(walk(v, depth + 1) for v in o)
        return False

    return walk(obj, _depth)


def save_sharded(state: dict[str, Any], step: int, d: Path, keep: int) -> Path | None:
    """Every rank writes its shard; rank 0 publishes the directory and ``latest``. Collective."""
    import torch.distributed.checkpoint as dcp

    name = f"ckpt-{step:010d}.dcp"
    tmp = d / f".{name}.tmp"
    group = ckpt_group() if dist_on() else None
    rank0 = dist_rank() == 0
    if rank0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a writer killed earlier at this step
        tmp.mkdir()
    barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), process_group=group)
    out: Path | None = None
    if rank0:
        fsync_dir(tmp)
        final = d / name
        if final.exists():  # saved this step before (a retry): replace it
            trash = d / f".{name}.old.tmp"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(d)
        write_pointer(d, {"file": name, "step": step, "format": "dcp", "world_size": dist_world()})
        prune(d, keep, name)
        out = final
    barrier()
    return out


def load_sharded(path: Path, into: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
    """Load the DCP checkpoint ``path`` in place into ``into`` (collective): ``(into, step)``."""
    import torch.distributed.checkpoint as dcp

    if into is None:
        raise NeedsStateError(
            f"{path.name} is a sharded (torch.distributed.checkpoint) checkpoint: pass the state "
            "dict to load into, e.g. resume({'model': model.state_dict(), ...})"
        )
    group = ckpt_group() if dist_on() else None
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)
    return into, int(CKPT_RE.match(path.name).group(1))
