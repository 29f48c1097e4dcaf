"""Which history a checkpoint belongs to: its *epoch* (issue 29, item 3; docs/agent.md, "Memory
snapshots", "Two timelines").

A step number alone does not name a state. After a fallback to EFS (a restore whose memory copy
failed its check, a save that did not fit in memory) the job trains again from an older step, and
the steps it reaches are numbered as the abandoned ones were: two nodes could then each hold
"step N" from different histories, and each load its own (the replicas diverge, silently), or a
node could bring back a step of the abandoned history that is numbered higher than the live one's.

So every checkpoint also carries the *epoch* of the worker generation that wrote it: a memory
snapshot's header (``epoch``), the sharded path's markers, the persisted file's dict and the
``latest`` pointer. A generation -- the workers of one rendezvous round -- agrees on one epoch when
it first restores (or, with no restore before it, first saves): the largest ``time.time_ns()`` of
its ranks, raised to 1 + the largest epoch any rank saw among the checkpoints it could restore (a
hybrid logical clock). Rounds train one after another, so a later generation's epoch is larger
than that of every generation it descends from, whatever the clocks say; and, clocks being in step
to far better than a round's restart (EC2 keeps them within a millisecond), larger than that of an
earlier round it never saw either. Checkpoints are ordered by ``(epoch, step)``: the newest
generation's newest step is the live timeline's head, and an abandoned history, however high its
step numbers, never wins over it. A header or pointer without an epoch (written before this
field) counts as epoch 0.

Import-light: no torch unless a collective is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: the key of "nothing": below every checkpoint's
NONE = (0, -1)

_epoch: int | None = None


def epoch_of(d: Any) -> int:
    """The ``epoch`` of a header, marker or pointer (0: none, or not a whole number >= 0)."""
    e = d.get("epoch", 0) if isinstance(d, dict) else 0
    return e if isinstance(e, int) and not isinstance(e, bool) and e >= 0 else 0


def key(d: Any) -> tuple[int, int]:
    """``(epoch, step)`` of a header, marker or pointer: the order of checkpoints; :data:`NONE`
    for None or one without a step."""
    if not isinstance(d, dict) or "step" not in d:
        return NONE
    try:
        step = int(d["step"])
    except (TypeError, ValueError):
        return NONE
    return (epoch_of(d), step)


def current() -> int | None:
    """This process's generation's epoch, once agreed (None before)."""
    return _epoch


def begin(seen: int, clock: int) -> int:
    """Start this process's generation at ``max(clock, seen + 1)`` -- ``clock`` the largest of its
    ranks' ``time.time_ns()``, ``seen`` the largest epoch among the checkpoints any of them saw --
    with every rank passing the same two (a restore gathers them anyway). Returns the epoch."""
    global _epoch
    _epoch = max(int(clock), int(seen) + 1)
    return _epoch


def adopt(epoch: int) -> int:
    """Take ``epoch``, agreed elsewhere (rank 0's, gathered), as this generation's."""
    global _epoch
    _epoch = int(epoch)
    return _epoch


def ensure(seen: Callable[[], int]) -> int:
    """This generation's epoch; the first save of a generation that never restored agrees on one
    first: one all-reduce (MAX) of two int64s over the checkpoint's gloo group, once per process.
    ``seen()``: the largest epoch this rank can see (its node's store, ``latest``)."""
    if _epoch is not None:
        return _epoch
    vals = [time.time_ns(), int(seen()) + 1]
    from petctl_agent.distributed import dist_on

    if dist_on():
        import torch
        import torch.distributed as dist

        from petctl_agent.checkpointing.group import ckpt_group

        t = torch.tensor(vals, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ckpt_group())
        vals = [int(v) for v in t]
    return begin(vals[1] - 1, vals[0])


def reset() -> None:
    """Forget the generation's epoch (tests: the next restore or save starts a new one)."""
    global _epoch
    _epoch = None
