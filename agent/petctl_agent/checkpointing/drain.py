"""The worker side of the drain protocol: every rank agrees, at the same step, to stop.

The agent raises the flag (``$PETCTL_DRAIN_FILE``); :func:`should_checkpoint` exchanges it
one step late (or at once with ``PETCTL_AGREEMENT=sync``). The protocol, for the user scripts
that reach these calls through ``petctl_agent.checkpoint``, is described in that module's doc.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from petctl_agent import DRAIN_EXIT_CODE, knobs
from petctl_agent.checkpointing.atomic import atomic_write
from petctl_agent.distributed import dist_world

_agreed_drain = 0  # the drain decision all ranks took at the last should_checkpoint(): 0, STOP, LEAVE
#: the drain file's flag: the workers stop for a membership change (a join: every node stays)...
STOP = 1
#: ...or a node leaves (the agent wrote ``leave`` into the file): its memory leaves with it
LEAVE = 2


def _local_drain_flag() -> int:
    f = knobs.drain_file()
    if not f:
        return 0
    try:
        with open(f, "rb") as fh:
            return LEAVE if fh.read(16).startswith(b"leave") else STOP
    except FileNotFoundError:
        return 0
    except OSError:
        return LEAVE  # unreadable but there: the safe reading


class _Agreement:
    """All-reduce MAX of the local drain flag on ``device``; the result is read one call later."""

    def __init__(self, group: Any, device: Any) -> None:
        import torch

        self.group = group
        self.device = device
        self.cuda = device.type == "cuda"
        self.work: Any = None  # CPU: the pending all-reduce
        self.tensor: Any = None
        self.host = torch.empty(1, dtype=torch.int32, pin_memory=True) if self.cuda else None
        self.event: Any = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def _tensor(self, flag: bool) -> Any:
        import torch

        # torch.full: a fill kernel, no host-to-device copy (a pageable copy would sync)
        return torch.full((1,), int(flag), dtype=torch.int32, device=self.device)

    def collect(self) -> int:
        """Result of the all-reduce started by the previous call (0 if none)."""
        if not self.pending:
            return 0
        self.pending = False
        if self.cuda:
            self.event.synchronize()  # only waits for the GPU work queued before the previous call
            return int(self.host[0])
        self.work.wait()
        v = int(self.tensor[0])
        self.work = self.tensor = None
        return v

    def launch(self, flag: int) -> None:
        import torch.distributed as dist

        t = self._tensor(flag)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if self.cuda:
            work.wait()  # NCCL: the current stream waits for the all-reduce; the host does not
            self.host.copy_(t, non_blocking=True)
            self.event.record()
        else:
            self.work, self.tensor = work, t
        self.pending = True

    def exchange(self, flag: int, sync: bool) -> int:
        if sync:
            import torch.distributed as dist

            self.collect()  # (a mode switch mid-run: finish the pending one first)
            t = self._tensor(flag)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            return int(t.item())
        decided = self.collect()
        self.launch(flag)
        return decided


_agreement: _Agreement | None = None


def _get_agreement() -> _Agreement:
    global _agreement
    import torch.distributed as dist

    world = dist.group.WORLD
    if _agreement is None or _agreement.group is not world:
        from petctl_agent.distributed import rank_device

        _agreement = _Agreement(world, rank_device())
    return _agreement


def _sync_mode() -> bool:
    return os.environ.get("PETCTL_AGREEMENT", "async").strip().lower() == "sync"


def drain_requested() -> bool:
    """True when the last :func:`should_checkpoint` call agreed (on every rank) to drain.

    The local drain file alone never counts: a rank that stopped on its own would
    leave its peers blocked in their next collective.
    """
    return _agreed_drain > 0


def drain_leaving() -> bool:
    """True when the agreed drain is because some node leaves (not only a join's stop): the
    checkpoint must then be on EFS before the workers exit (the leaving node's memory goes)."""
    return _agreed_drain >= LEAVE


def should_checkpoint(step: int, every: int) -> bool:
    """Return True when this step must be checkpointed: every ``every`` steps, or on an agreed drain.

    A collective when a process group with more than one rank is initialised and the
    agent set ``$PETCTL_DRAIN_FILE``: call it on every rank at every step. The drain
    flag seen at one call is decided at the next (see the module doc); every rank
    returns the same value at the same step.
    """
    global _agreed_drain
    flag = _local_drain_flag()
    if dist_world() > 1 and knobs.drain_file():
        flag = _get_agreement().exchange(flag, _sync_mode())
    _agreed_drain = int(flag)
    return bool(flag) or (every > 0 and step % every == 0)


def exit_for_drain() -> None:
    """Stop this worker at once after a drain checkpoint, with :data:`DRAIN_EXIT_CODE`.

    ``os._exit``: the checkpoint is durable (``save`` ended in a barrier), and a
    clean ``destroy_process_group`` + interpreter shutdown took ~10 s with gloo
    here while peers tear down -- time every rank would spend not training.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(DRAIN_EXIT_CODE)


def report_progress(step: int, world_size: int) -> None:
    """Record the last completed step in ``$PETCTL_PROGRESS_FILE`` (local rank 0 only; atomic)."""
    f = knobs.progress_file()
    if not f or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    body = json.dumps({"step": int(step), "world_size": int(world_size), "t": time.time()}).encode()
    try:
        atomic_write(Path(f), body)
    except OSError:
        pass  # progress is advisory
