#!/usr/bin/env python
"""Elastic DDP training that holds replicated fp32 state of a given size (``bench/bench_state.py``).

A tiny linear model trains with DDP (gloo, CPU) so every step is a real collective at the
current world size, and every rank also holds ``--state-gib`` GiB of replicated fp32 "ballast"
(64 MiB tensors, the same on every rank, as a replicated model and its optimizer state are). The
ballast is part of every checkpoint, so a checkpoint, a drain and a restore move all of it.
Element 0 of every ballast tensor holds the step it was last written at: a restore that loads a
torn, stale or partial state is caught (``state mismatch``, exit 3), never trained on.

``--io``:

- ``helper`` (default): ``ckpt.resume`` / ``ckpt.step`` (``petctl_agent.checkpoint``): EFS, or the
  agent's memory snapshots when they are on;
- ``plain``: what a script under plain ``torchrun`` does (under the local cloud's EFS limits,
  ``PETCTL_IO_HOOK``, its reads and writes are paced like the checkpoint layer's): rank 0 ``torch.save`` s the state into a
  temp file in the checkpoint directory, fsync, ``os.replace`` to ``state.pt``, fsync the directory,
  then a ``latest`` JSON pointer the same way; every rank ``torch.load`` s it back at start.
  Periodic checkpoints only (torchrun has no drain protocol).

Prints ``step=<n> world_size=<w> loss=<x> mono=<t>`` per step (``mono``: ``time.monotonic()``
when it ended, so the benchmark times steps exactly, not when the agent's log tailer forwarded
the line, up to 0.2 s later), and for the benchmark (rank 0)::

    bench: restored step=<s> seconds=<t> source=<memory|efs> gib=<g>
    bench: ckpt step=<s> blocked=<t> gib=<g> via=<memory|efs>   (periodic checkpoints: what
                                                       training waited, and what served it)
    bench: started seconds=<t> mono=<t>                (process start -> first step can run)
    bench: begun mono=<t> / grouped mono=<t>           (the script's first line; its process group
                                                       and DDP made: where a start's time goes)
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time

T_START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

CHUNK = 16 << 20  # fp32 elements per ballast tensor: 64 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-gib", type=float, default=0.1, help="replicated fp32 state per rank, GiB")
    p.add_argument("--total-steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.05, help="extra sleep per step")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--checkpoint-dir", default=None, help="used when PETCTL_CHECKPOINT_DIR is unset")
    p.add_argument("--io", choices=("helper", "plain"), default="helper")
    p.add_argument(
        "--start-delay", type=float, default=0.0,
        help="sleep this long before the process group, at every start (bench_state.py --start-delay: "
        "emulates a GPU worker's CUDA/NCCL set-up or a model's build)",
    )  # fmt: skip
    return p.parse_args(argv)


def make_ballast(gib: float) -> dict[str, torch.Tensor]:
    n = int(gib * 2**30) // 4
    out, i = {}, 0
    while n > 0:
        k = min(CHUNK, n)
        out[f"p{i:03d}"] = torch.empty(k, dtype=torch.float32).fill_(float(i))
        n -= k
        i += 1
    return out


def check_ballast(ballast: dict[str, torch.Tensor], gib: float, step: int) -> str:
    """'' if ``ballast`` is this size's state as written at ``step``; else what is wrong."""
    want = int(gib * 2**30) // 4
    have = sum(t.numel() for t in ballast.values())
    if have != want:
        return f"{have} elements, want {want}"
    bad = [k for k, t in ballast.items() if int(t[0].item()) != step]
    return f"element 0 of {bad[:3]} is not step {step}" if bad else ""


# ---- plain torchrun-style checkpoint (torch.save / torch.load, atomic) --------------------------
def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(path: str, mode: str):
    """``open()`` through the checkpoint layer's I/O hook: under the local cloud's EFS limits
    (``PETCTL_IO_HOOK``, beside ``PETCTL_EFS_EMULATION``) paced as the checkpoint layer's own I/O
    is, so that this script pays what EFS would charge it too; plain ``open()`` without."""
    if os.environ.get("PETCTL_IO_HOOK"):
        from petctl_agent.checkpointing import iohook

        return iohook.open(path, mode)
    return open(path, mode)


def _atomic(d: str, name: str, write) -> None:
    tmp = os.path.join(d, f".{name}.tmp")
    with _open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, name))
    _fsync_dir(d)


def plain_save(state: dict, step: int, d: str) -> None:
    if dist.get_rank() == 0:
        _atomic(d, "state.pt", lambda f: torch.save({"step": step, "state": state}, f))
        _atomic(d, "latest", lambda f: f.write(json.dumps({"file": "state.pt", "step": step}).encode()))
    dist.barrier()


def plain_load(d: str) -> tuple[dict, int] | None:
    path = os.path.join(d, "state.pt")
    if not os.path.exists(path):
        return None
    with _open(path, "rb") as f:
        doc = torch.load(f, map_location="cpu", weights_only=True)
    return doc["state"], int(doc["step"])


def spy_memory_restore() -> list[bool]:
    """Note whether ``ckpt.resume`` restored from the agent's memory snapshots: ``[True]`` once it
    did. Wraps ``petctl_agent.checkpointing.memory.resume`` (what ``ckpt.resume`` calls first when
    snapshots are on); an empty list when that function is not there (its layout changed)."""
    hit: list[bool] = []
    try:
        from petctl_agent.checkpointing import memory
    except ImportError:
        return hit
    orig = getattr(memory, "resume", None)
    if orig is None:
        return hit

    def resume(*a, **kw):
        got = orig(*a, **kw)
        hit.append(got is not None)
        return got

    memory.resume = resume
    return hit


def spy_memory_save() -> list[bool]:
    """Note, per ``ckpt.step`` checkpoint, whether the agent's memory snapshots served it: wraps
    ``petctl_agent.checkpointing.memory.save`` (``ckpt.step`` calls it first when snapshots are on;
    False: some node's snapshot did not fit, or was unsupported, and every rank took the EFS path).
    The list gets one bool per call; empty when that function is not there (its layout changed)."""
    got: list[bool] = []
    try:
        from petctl_agent.checkpointing import memory
    except ImportError:
        return got
    orig = getattr(memory, "save", None)
    if orig is None:
        return got

    def save(*a, **kw):
        ok = orig(*a, **kw)
        got.append(bool(ok))
        return ok

    memory.save = save
    return got


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    directory = os.environ.get("PETCTL_CHECKPOINT_DIR") or args.checkpoint_dir
    if not directory:
        print("set PETCTL_CHECKPOINT_DIR or pass --checkpoint-dir", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("run under petctl-agent or torchrun (RANK/WORLD_SIZE unset)", file=sys.stderr)
        return 2
    print(f"bench: begun mono={T_START:.3f}", flush=True)
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.distributed import init_process_group

    torch.set_num_threads(1)
    if args.start_delay > 0:
        time.sleep(args.start_delay)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    model = nn.Linear(32, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    print(f"bench: grouped mono={time.monotonic():.3f}", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    snapshots = args.io == "helper" and bool(os.environ.get("PETCTL_SNAPSHOT_DIR"))
    hit = spy_memory_restore() if snapshots else [False]
    # per checkpoint: memory or EFS (a snapshot that does not fit falls back to EFS)
    saved_to = spy_memory_save() if snapshots else []
    t = time.monotonic()
    restored = plain_load(directory) if args.io == "plain" else ckpt.resume(directory=directory)
    t_restore = time.monotonic() - t
    step = 0
    if restored is not None:
        state, step = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        ballast = state["ballast"]
        bad = check_ballast(ballast, args.state_gib, step)
        if bad:
            print(f"state mismatch after restoring step {step}: {bad}", file=sys.stderr, flush=True)
            return 3
        # every rank: a newcomer's restore may differ from a survivor's
        source = ("memory" if hit[-1] else "efs") if hit else "unknown"
        print(
            f"bench: restored step={step} seconds={t_restore:.3f} source={source} gib={args.state_gib:g}",
            flush=True,
        )
    else:
        ballast = make_ballast(args.state_gib)
    print(f"bench: started seconds={time.monotonic() - T_START:.3f} mono={time.monotonic():.3f}", flush=True)

    keys = list(ballast)
    # where a failure's time goes (bench_state.py): when this rank saw it, and when it began to exit
    atexit.register(lambda: print(f"bench: exiting mono={time.monotonic():.3f}", flush=True))
    try:
        train(args, ddp, opt, model, ballast, keys, step, rank, world, directory, ckpt, saved_to)
    except BaseException:
        print(f"bench: raised mono={time.monotonic():.3f}", flush=True)
        raise
    dist.barrier()
    dist.destroy_process_group()
    return 0


def train(args, ddp, opt, model, ballast, keys, step, rank, world, directory, ckpt, saved_to) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g)
    loss_fn = nn.MSELoss()
    while step < args.total_steps:
        step += 1
        rows = torch.arange((step * 16) % 256, (step * 16) % 256 + 16)[rank::world]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[rows]), y[rows])
        loss.backward()
        opt.step()
        for k in keys:  # the state changes every step, as a model's does
            ballast[k][0] = float(step)
        if args.step_time > 0:
            time.sleep(args.step_time)
        # mono: when the step ended, for bench_state.py (the agent's log tailer polls every 0.2 s)
        print(
            f"step={step} world_size={world} loss={loss.item():.6f} mono={time.monotonic():.3f}", flush=True
        )
        last = step == args.total_steps
        t = time.monotonic()
        n_saves = len(saved_to)
        if args.io == "plain":
            saved = args.checkpoint_every > 0 and (step % args.checkpoint_every == 0 or last)
            if saved:
                plain_save(
                    {"model": model.state_dict(), "optim": opt.state_dict(), "ballast": ballast},
                    step,
                    directory,
                )
        else:
            saved = ckpt.step(
                step,
                lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "ballast": ballast},
                every=args.checkpoint_every,
                directory=directory,
                last=last,
                world_size=world,
            )
        if saved and rank == 0 and not last:
            blocked = time.monotonic() - t
            # memory: every node's snapshot fit; efs: the EFS path (snapshots off, or a fallback)
            via = "memory" if len(saved_to) > n_saves and saved_to[-1] else "efs"
            print(
                f"bench: ckpt step={step} blocked={blocked:.3f} gib={args.state_gib:g} via={via}", flush=True
            )


if __name__ == "__main__":
    sys.exit(main())
