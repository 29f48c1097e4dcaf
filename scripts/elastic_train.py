#!/usr/bin/env python
"""Elastic DDP training example for petctl (runs unchanged under plain ``torchrun``).

A small MLP learns a fixed random "teacher" MLP on synthetic data generated
deterministically from ``--seed`` (no downloads). Steps count from 1. Step ``s``
always trains on the same global batch, ``--batch-size`` rows starting at
``(s-1) * batch_size`` (mod the dataset), split across ranks by ``rank::world_size``
— so resuming at a different world size continues the same data stream.

Trains on the rank's GPU when there is one (``cuda:<LOCAL_RANK>``, NCCL for the
gradients, DDP ``device_ids``), else on CPU with gloo; ``--device cpu`` forces CPU.

Checkpoints go through :mod:`petctl_agent.checkpoint` -- one ``ckpt.step`` call per
step: every ``--checkpoint-every`` steps, at the last step, and when the agents ask
for a drain (then the workers exit 75 after the save) -- to
``$PETCTL_CHECKPOINT_DIR`` or ``--checkpoint-dir``. Prints one line per step::

    step=<n> world_size=<w> loss=<x>

Examples::

    torchrun --nnodes 1 --nproc-per-node 2 scripts/elastic_train.py --checkpoint-dir /tmp/ck
    petctl run_job --min 2 --max 4 scripts/elastic_train.py -- --total-steps 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from petctl_agent import checkpoint as ckpt
from petctl_agent.distributed import init_process_group, rank_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (pacing for tests)")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None, help="used when PETCTL_CHECKPOINT_DIR is unset")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="auto: the rank's GPU if any")
    return p.parse_args(argv)


def make_data(n: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for prm in teacher.parameters():
            prm.copy_(0.5 * torch.randn(prm.shape, generator=g))
        y = teacher(x) + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def make_model(features: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed + 1)
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def shard_indices(step: int, batch_size: int, n: int, rank: int, world: int) -> torch.Tensor:
    """Rows of global step ``step`` (1-based) that belong to ``rank``."""
    start = (step - 1) * batch_size
    rows = torch.arange(start, start + batch_size) % n
    return rows[rank::world]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directory = os.environ.get("PETCTL_CHECKPOINT_DIR") or args.checkpoint_dir
    if not directory:
        print("set PETCTL_CHECKPOINT_DIR or pass --checkpoint-dir", file=sys.stderr)
        return 2
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = args.device == "auto" and torch.cuda.is_available()
    if distributed:
        backend = init_process_group(None if use_cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = rank_device()
    else:
        backend, rank, world = "none", 0, 1
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
        )
        if use_cuda:
            torch.cuda.set_device(device)
    torch.set_num_threads(1)

    x, y = make_data(args.dataset_size, args.features, args.seed)
    x, y = x.to(device), y.to(device)
    model = make_model(args.features, args.hidden, args.seed).to(device)
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    else:
        ddp = model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"training on device={device} backend={backend} world_size={world}", flush=True)

    step = 0
    restored = ckpt.resume(directory=directory)  # tensors land on `device`
    if restored is not None:
        state, step = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        if rank == 0:
            where = state["model"][next(iter(state["model"]))].device
            print(f"resumed from step={step} world_size={world} device={where}", flush=True)

    loss_fn = nn.MSELoss()
    while step < args.total_steps:
        step += 1
        idx = shard_indices(step, args.batch_size, args.dataset_size, rank, world).to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if args.step_time > 0:
            time.sleep(args.step_time)
        print(f"step={step} world_size={world} loss={loss.item():.6f}", flush=True)
        # progress, checkpoint/drain agreement, save; exits 75 on an agreed drain
        ckpt.step(
            step,
            lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
            every=args.checkpoint_every,
            directory=directory,
            last=step == args.total_steps,
            world_size=world,
        )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
