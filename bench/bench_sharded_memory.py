"""Sharded state (FSDP2, 2 ranks) through node memory vs today's DCP-to-EFS path.

    python bench/bench_sharded_memory.py --gib 1 --reps 3 --out /tmp/bench_sharded.json

Two ranks on this machine stand for two nodes (each its own ``PETCTL_SNAPSHOT_DIR`` under
``--shm``); ``--efs`` stands in for EFS: a local directory with the local cloud's EFS limits (AWS's
Elastic-mode figures, ``petctl/local/efs_rate.py``: 1,500 MiB/s per node, 5 GiB/s of writes in
all), paid by the checkpoint layer's reads and writes, each rank its own EFS client;
``--no-efs-limits`` turns them off (a local disk: a lower bound).
The state is an FSDP2 model (8 bias-free ``Linear(4096, 2730)``) with Adam: parameters and two
moments, ``--gib`` GiB in all, half per rank. Timed, medians of ``--reps``:

- ``block``: what a periodic ``ckpt.step`` blocks training, per rank (max of the two ranks):
  ``efs`` today's path (``dcp.save`` to EFS, fsync, rename, ``latest``) vs ``memory`` (``dcp.save``
  into node memory + the replica to the peer; the crc32s and the EFS copy go on in a thread);
- ``drain_save``: the durable checkpoint of a drain (memory path: it also waits for EFS);
- ``restore`` at world size 1 after a drain (node 1 left) and after a hard loss (node 1's memory
  gone, EFS removed): ``ckpt.resume`` in the survivor's new process, vs ``efs`` (DCP load from EFS);
- ``replace``: world size 2 again with a fresh node (empty memory): its shards and replicas
  fetched from the survivor over gloo;
- ``process``: the restarted process's wall time (torch import, process group, model, resume).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, time, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import sharded_memory
from petctl_agent.distributed import init_process_group
t_start = float(os.environ["T_START"])
init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
gib = float(os.environ["GIB"])
width = int(gib * 2**30 / 12 / 8 / 4096)  # params + 2 Adam moments, fp32, 8 layers of 4096 x width
model = torch.nn.Sequential(*[torch.nn.Linear(4096 if i % 2 == 0 else width, width if i % 2 == 0 else 4096, bias=False) for i in range(8)])
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
def train():
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    opt.zero_grad()
def state():
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}
out = {"rank": rank}
phase = os.environ["PHASE"]
if phase == "train":
    blocks = []
    reps = int(os.environ["REPS"])
    for s in range(1, reps + 1):
        train()
        dist.barrier()
        t = time.perf_counter()
        ckpt.step(s, state, every=1)
        blocks.append(time.perf_counter() - t)
        sharded_memory.flush()  # the next rep starts with EFS caught up (not timed)
        dist.barrier()
    out["block"] = blocks
    train()
    dist.barrier()
    t = time.perf_counter()
    ckpt.save(state(), reps + 1)
    out["drain_save"] = time.perf_counter() - t
    out["bytes"] = sum(v.to_local().numel() * v.element_size() for v in model.parameters()) * 3
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)
else:
    st = state()
    t = time.perf_counter()
    got = ckpt.resume(st)
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    out["restore"] = time.perf_counter() - t
    out["process"] = time.time() - t_start
    out["step"] = got[1]
    out["source"] = (sharded_memory.last_restore or {}).get("source", "efs")
    out["fetched"] = (sharded_memory.last_restore or {}).get("fetched_bytes", 0)
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(tmp: Path, nodes: list[int], env: dict[str, str], memory: bool, rates: object = None) -> list[dict]:
    """``rates``: the local cloud's ``EfsRates`` (every node an EFS client of ``tmp/efs``), or None."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import free_port

    from petctl.local import efs_rate

    script = tmp / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for r, node in enumerate(nodes):
        e = {
            **os.environ,
            **env,
            "RANK": str(r),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(len(nodes)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # under <efs root>/<file system id>/, where the EFS emulation paces I/O
            "PETCTL_CHECKPOINT_DIR": str(tmp / "efs" / "fs-bench" / "ckpt"),
            "PETCTL_CHECKPOINT_KEEP": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "T_START": repr(time.time()),
        }
        e.pop("PETCTL_SNAPSHOT_DIR", None)
        e.pop(efs_rate.ENV, None)
        e.pop(efs_rate.HOOK_ENV, None)
        e.update(efs_rate.instance_env(tmp, f"i-node{node}", rates))  # type: ignore[arg-type]
        if memory:
            e["PETCTL_SNAPSHOT_DIR"] = str(tmp / "shm" / f"node{node}")
            e["PETCTL_SHARDED_MEMORY"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    res = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"worker failed (rc {p.returncode}):\n{err[-4000:]}")
        res.append(json.loads(line[-1][7:]))
        if "going back" in err or "restored step" in err:
            res[-1]["said"] = [x for x in err.splitlines() if x.startswith("petctl checkpoint")]
    return res


def _keep(tmp: Path, shm: Path, saved: Path) -> None:
    """Copy EFS and the newest step of each node's memory aside (memory stays in tmpfs)."""
    shutil.copytree(tmp / "efs", saved / "efs")
    for node in shm.iterdir():
        steps = sorted((node / "sharded").iterdir())
        shutil.copytree(steps[-1], saved / "shm" / node.name / "sharded" / steps[-1].name)


def _back(tmp: Path, shm: Path, saved: Path) -> None:
    shutil.rmtree(tmp / "efs", ignore_errors=True)
    shutil.copytree(saved / "efs", tmp / "efs")
    for node in list(shm.iterdir()):
        shutil.rmtree(node)
    shutil.copytree(saved / "shm", shm, dirs_exist_ok=True)


def one(gib: float, reps: int, shm_root: Path, efs_root: Path, rates: object = None) -> dict:
    out: dict = {"efs_limits": rates is not None}
    env = {"GIB": str(gib), "REPS": str(reps), "OMP_NUM_THREADS": "1"}
    for mode in ("efs", "memory"):
        mem = mode == "memory"
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-sharded-{mode}-", dir=efs_root))
        shm = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=shm_root))
        saved = Path(tempfile.mkdtemp(prefix="bench-sharded-saved-", dir=shm_root))
        (tmp / "shm").symlink_to(shm)
        try:
            tr = _run(tmp, [0, 1], {**env, "PHASE": "train"}, mem, rates)
            out[f"{mode}_bytes"] = sum(r["bytes"] for r in tr)
            blocks = [max(a, b) for a, b in zip(tr[0]["block"], tr[1]["block"])]
            out[f"{mode}_block"] = statistics.median(blocks)
            out[f"{mode}_block_all"] = blocks
            out[f"{mode}_drain_save"] = max(r["drain_save"] for r in tr)
            if mem:
                _keep(tmp, shm, saved)
                shutil.rmtree(shm / "node1")  # node 1 drained: the agent freed its memory
            (r,) = _run(tmp, [0], {**env, "PHASE": "restore"}, mem, rates)
            out[f"{mode}_drain_restore"], out[f"{mode}_drain_process"] = r["restore"], r["process"]
            out[f"{mode}_drain_source"] = r["source"]
            if mem:
                # hard loss: node 1 gone, and the step not on EFS either
                _back(tmp, shm, saved)
                shutil.rmtree(shm / "node1")
                shutil.rmtree(tmp / "efs")
                (r,) = _run(tmp, [0], {**env, "PHASE": "restore"}, mem, rates)
                out["memory_hardloss_restore"], out["memory_hardloss_process"] = r["restore"], r["process"]
                out["memory_hardloss_source"] = r["source"]
                # a replacement node (empty memory) joins the survivor: world size 2 again
                _back(tmp, shm, saved)
                shutil.rmtree(shm / "node1")
                rs = _run(tmp, [0, 2], {**env, "PHASE": "restore"}, mem, rates)
                out["memory_replace_restore"] = max(x["restore"] for x in rs)
                out["memory_replace_fetched"] = sum(x["fetched"] for x in rs)
                out["memory_replace_source"] = rs[0]["source"]
        finally:
            for p in (tmp, shm, saved):
                shutil.rmtree(p, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state in all (params + Adam), GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="whole runs (restores: median over runs)")
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--efs", default=tempfile.gettempdir())
    ap.add_argument("--no-efs-limits", action="store_true", help="--efs as fast as the local disk")
    ap.add_argument("--out")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from petctl.local import efs_rate

    rates = None if a.no_efs_limits else efs_rate.EfsRates()
    runs = [one(a.gib, a.reps, Path(a.shm), Path(a.efs), rates) for _ in range(a.runs)]
    res = {
        k: (statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else runs[0][k])
        for k in runs[0]
    }
    res["runs"] = runs
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
