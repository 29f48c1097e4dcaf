"""A plain torchrun script, as in PyTorch's DDP tutorial: no petctl import, its own snapshot.

It reads RANK/WORLD_SIZE/LOCAL_RANK (through ``init_process_group``'s env:// and
the environment), keeps a snapshot at the *relative* path ``snapshot.pt`` (rank 0
saves it every ``--save-every`` steps) and resumes from it when it exists. It
prints ``step=<n> world_size=<w> loss=<x>`` per step so the test harness can follow it.

    torchrun --nproc-per-node 2 plain_torchrun_script.py --total-steps 100
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SNAPSHOT = "snapshot.pt"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--total-steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group(backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    step = 0
    if os.path.exists(SNAPSHOT):
        snap = torch.load(SNAPSHOT, map_location="cpu")
        model.load_state_dict(snap["MODEL_STATE"])
        step = snap["STEPS_RUN"]
        print(
            f"Resuming training from snapshot at step {step} (rank {rank}, local rank {local_rank})",
            flush=True,
        )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g)
    while step < args.total_steps:
        step += 1
        rows = torch.arange((step * 32) % 256, (step * 32) % 256 + 32)[rank::world]
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        print(f"step={step} world_size={world} loss={loss.item():.6f}", flush=True)
        if rank == 0 and step % args.save_every == 0:
            torch.save({"MODEL_STATE": model.state_dict(), "STEPS_RUN": step}, SNAPSHOT + ".tmp")
            os.replace(SNAPSHOT + ".tmp", SNAPSHOT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
