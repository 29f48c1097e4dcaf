"""Worker script for test_forkserver_exit.py: PyTorch's DDP tutorial in miniature (gloo, CPU).

``plain``: ends without ``destroy_process_group`` (the group dies with the process).
``tutorial``: as the ddp-tutorial-series scripts do, ``main()`` calls
``destroy_process_group()`` while the trainer holding the DDP model is still alive,
so the model's Reducer is freed (with the GIL held) when ``main()`` returns.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self) -> None:
        self.model = DDP(torch.nn.Linear(20, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad()
            self.model(torch.rand(8, 20)).sum().backward()
            self.optimizer.step()


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    trainer = Trainer()
    trainer.train(5)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    print(f"rank {dist.get_rank()} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')} done", flush=True)
    if mode == "tutorial":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
