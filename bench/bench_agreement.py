#!/usr/bin/env python
"""Per-step cost of the checkpoint/drain agreement (``petctl_agent.checkpoint``).

Starts ``--world`` ranks on this machine (127.0.0.1), each running the same small
training-like step ``--steps`` times per mode, modes interleaved for ``--rounds``
rounds (median per mode):

- ``none``:  the step alone;
- ``async``: the step + the agreement as ``should_checkpoint`` runs it (default mode:
  all-reduce started without waiting, result read one step later);
- ``sync``:  the step + a blocking all-reduce read at once (``PETCTL_AGREEMENT=sync``;
  what the helper did before).

The agreement is called the way ``should_checkpoint`` calls it (drain-file stat +
exchange), also with ``--world 1`` (``should_checkpoint`` itself skips it there), so
one GPU can measure its device-side cost. Prints a table and one JSON line
(``--json PATH`` also writes it).

    python bench/bench_agreement.py                          # 2 gloo ranks, CPU
    python bench/bench_agreement.py --device cuda --world 1  # one GPU, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "async", "sync")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=500, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--width", type=int, default=0, help="MLP width (default 128 on CPU, 2048 on CUDA)")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from petctl_agent.checkpointing import drain
    from petctl_agent.distributed import init_process_group, rank_device

    backend = init_process_group(None if args.device == "cuda" else "gloo")
    device = rank_device()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = args.width or (2048 if device.type == "cuda" else 128)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64 if device.type == "cpu" else 256, width, device=device)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    agreement = drain._get_agreement()

    def agree(sync: bool) -> bool:  # what should_checkpoint does with world > 1
        return agreement.exchange(drain._local_drain_flag(), sync)

    def sync_all() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def run(mode: str, n: int) -> float:
        sync_all()
        t0 = time.perf_counter()
        for _ in range(n):
            train_step()
            if mode != "none":
                agree(mode == "sync")
        agreement.collect()  # the last pending exchange belongs to this mode's time
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter() - t0
        slowest = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # CPU tensor: gloo
        return float(slowest[0])

    for mode in MODES:  # warm-up: allocator, NCCL/gloo connections, kernels
        run(mode, 30)
    per: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            per[mode].append(run(mode, args.steps) / args.steps * 1e6)
    if dist.get_rank() == 0:
        import torch.version

        info = {
            "device": str(device),
            "backend": backend,
            "world": dist.get_world_size(),
            "steps": args.steps,
            "rounds": args.rounds,
            "width": width,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "per_step_us": {m: round(statistics.median(v), 1) for m, v in per.items()},
            "samples_us": {m: [round(s, 1) for s in v] for m, v in per.items()},
        }
        base = info["per_step_us"]["none"]
        info["overhead_us"] = {m: round(info["per_step_us"][m] - base, 1) for m in ("async", "sync")}
        print("RESULT " + json.dumps(info), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from harness import free_port

    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench-agreement-"))
    procs = []
    for r in range(args.world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PETCTL_DRAIN_FILE": str(tmp / f"drain-{r}"),  # never created: the flag stays 0
            "OMP_NUM_THREADS": "1",
        }
        env.pop("PETCTL_LOCAL_ADDR", None)
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    result = None
    rc = 0
    for p in procs:
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("bench_agreement: timed out", file=sys.stderr)
            return 1
        rc = rc or p.returncode
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
    if rc or result is None:
        print(f"bench_agreement: a rank failed (exit {rc})", file=sys.stderr)
        return 1
    print(
        f"agreement cost: {result['world']} rank(s), {result['backend']} on {result['device']}, "
        f"{result['steps']} steps x {result['rounds']} rounds (median), torch {result['torch']}"
    )
    print(f"{'mode':<6} {'us/step':>10} {'overhead us':>12}")
    for m in MODES:
        over = "" if m == "none" else f"{result['overhead_us'][m]:+.1f}"
        print(f"{m:<6} {result['per_step_us'][m]:>10.1f} {over:>12}")
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
