"""A training script on a node that cannot train (issue #30): the node whose address is
``$BAD_NODE_ADDR`` raises at its third step, every round, as a node whose GPU errors does; the
others' collectives then fail ("Connection closed by peer"). No checkpoint: no progress resets the
count."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from petctl_agent import checkpoint as ckpt
from petctl_agent.distributed import init_process_group


def main() -> None:
    init_process_group("gloo")
    world = dist.get_world_size()
    bad = os.environ.get("PETCTL_LOCAL_ADDR") == os.environ.get("BAD_NODE_ADDR")
    t = torch.zeros(1)
    step = 0
    while True:
        step += 1
        if bad and step == 3:
            raise RuntimeError("NCCL error: unhandled cuda error (simulated: this node cannot train)")
        dist.all_reduce(t)
        time.sleep(0.05)
        print(f"step={step} world_size={world} loss=0.0", flush=True)
        ckpt.step(step, dict, every=0, world_size=world)


if __name__ == "__main__":
    main()
