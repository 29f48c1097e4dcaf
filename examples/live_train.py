"""Data-parallel training that survives joins, drains and losses without restarting (live mode).

    petctl run-job --live --min 2 --max 4 examples/live_train.py -- --state-mb 256 --step-time 0.1
    python examples/live_train.py --plain ...      # the same loop as plain DDP (the baseline)

Each replica group keeps ``--state-mb`` MiB of replicated fp32 state (a buffer in the model, so a
newcomer pulls it from a live peer with the weights) and prints one line per step:
``step=<n> world_size=<w> params=<hash> mono=<monotonic seconds>``. ``params`` hashes the
weights (equal on every replica group at the same step); ``mono`` is when the step ended, for
the benchmarks. The loop's change from plain DDP is the ``live`` lines (see README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
from torch import nn


def build(state_mb: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    model.register_buffer("ballast", torch.zeros(max(1, int(state_mb * 2**20 / 4))))
    return model


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--state-mb", type=float, default=1.0)
    p.add_argument("--step-time", type=float, default=0.1, help="seconds of compute per step")
    p.add_argument("--plain", action="store_true", help="plain torch DDP (the baseline)")
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="seconds to stay alive after leaving, as a drain's last checkpoint or lifecycle action does",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (this process's GPU: cuda:LOCAL_RANK)")
    p.add_argument(
        "--start-delay",
        type=float,
        default=0.0,
        help="seconds of set-up before joining, as a GPU's CUDA context, NCCL and model build take",
    )
    args = p.parse_args(argv)
    print(f"live_train: launched pid={os.getpid()} mono={time.monotonic():.3f}", flush=True)
    time.sleep(args.start_delay)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    model = build(args.state_mb).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")) + os.getpid())
    x, y = torch.randn(256, 32, generator=g).to(device), torch.randn(256, 1, generator=g).to(device)
    loss_fn = nn.MSELoss()

    if args.plain:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt, step, world = optimizer, 0, dist.get_world_size()
    else:
        from petctl_agent.live.run import start

        run = start(model, optimizer)  # live: join the quorum
        ddp, opt, step = run.model, run.optimizer, run.step

    print(
        f"live_train: started pid={os.getpid()} mono={time.monotonic():.3f} step={step} params={params_hash(model)}",
        flush=True,
    )
    while step < args.steps:
        rows = torch.randint(0, 256, (16,), generator=g)
        opt.zero_grad()  # live: starts this step's quorum, which runs beside the compute
        if args.step_time > 0:
            time.sleep(args.step_time)  # stands for the forward and backward of a real model
        loss_fn(ddp(x[rows]), y[rows]).backward()
        opt.step()
        if not args.plain:
            if not run.step_done():  # live: the node drains here, at a step boundary
                print(f"live_train: left after step={run.step} mono={time.monotonic():.3f}", flush=True)
                time.sleep(args.linger)
                return 0
            step, world = run.step, run.replicas
        else:
            step += 1
        model.ballast[0] = float(step)  # the state changes every step, as a model's does
        print(
            f"step={step} world_size={world} params={params_hash(model)} mono={time.monotonic():.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
