"""Sharded (FSDP2 / DCP) checkpoints through node memory with ring replicas (checkpointing/sharded_memory.py).

Real torch processes on gloo, FSDP2 ``fully_shard`` on CPU. Two "nodes" are two ranks with their
own ``PETCTL_SNAPSHOT_DIR``; a lost node is its directory removed. The EFS checkpoint directory is
removed (or replaced by the copy it was at an earlier step) to prove where a restore came from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks

pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")

RANK = textwrap.dedent(
    """
    import json, os, shutil, sys, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.checkpointing import sharded_memory
    from petctl_agent.distributed import init_process_group
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    W = int(os.environ.get("WIDTH", "64"))  # the model's width (test_sharded_ranges.py: larger)
    model = torch.nn.Sequential(torch.nn.Linear(W, W), torch.nn.Linear(W, 16))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    D = os.environ["PETCTL_CHECKPOINT_DIR"]
    REF = os.environ["REF_DIR"]

    def train(s):
        torch.manual_seed(1000 + s)
        model(torch.randn(8, W)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    def state():
        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    def full():
        m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"model": m, "optim": o}

    def reference(s):  # the full state after step s, for the restore to be compared with
        f = full()
        if rank == 0:
            torch.save(f, os.path.join(REF, f"ref-{s}.pt"))

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    out = {}
    exec(open(sys.argv[1]).read())
    print("RESULT " + json.dumps(out), flush=True)
    """
)

# 2 ranks: checkpoints at steps 2 and 4 (periodic: memory + replica, EFS in the background);
# EFS as it was after step 2 is copied aside; then the workers die (after the memory copy completed)
TRAIN = """
for s in range(1, 6):
    train(s)
    reference(s)
    ckpt.step(s, state, every=2)
    if s == 3:
        sharded_memory.flush()  # step 2 is on EFS now (rank 0 published it)
        dist.barrier()
        if rank == 0:
            shutil.copytree(D, D + ".at2")
sharded_memory.flush()
out["latest"] = ckpt.latest_step()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # killed: no clean shutdown
"""

# 2 ranks: rank 1's node is told to leave at step 3; both agree at step 4, save, exit 75
DRAIN = """
for s in range(1, 9):
    train(s)
    reference(s)
    if rank == 1 and s == 3:
        with open(os.environ["PETCTL_DRAIN_FILE"], "w") as f:
            f.write("leave")  # the node leaves (an empty file is a join's stop: not durable)
    ckpt.step(s, state, every=0, last=s == 8)
"""

RESTORE = """
st = state()
got = ckpt.resume(st)
out["step"] = None if got is None else got[1]
if got is not None:
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    ref = torch.load(os.path.join(REF, f"ref-{got[1]}.pt"), weights_only=True)
    out["same"] = same(full(), ref)
out["restore"] = sharded_memory.last_restore
rep = os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "restore.json")  # for the agent's event
out["report"] = json.load(open(rep)) if os.path.exists(rep) else None
out["node_files"] = sorted(os.listdir(os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "sharded")))
"""


def _run(
    tmp: Path,
    body: str,
    nodes: list[int],
    env: dict | None = None,
    timeout: float = 120,
    no_store: tuple = (),
) -> list:
    """Run ``body`` on one rank per entry of ``nodes`` (the node directory each rank uses); the
    ranks in ``no_store`` have none (their agent's ``snapshot_off``)."""
    (tmp / "rank.py").write_text(RANK)
    (tmp / "body.py").write_text(textwrap.dedent(body))
    (tmp / "ref").mkdir(exist_ok=True)
    envs = [
        {
            "LOCAL_RANK": "0",
            "PETCTL_CHECKPOINT_DIR": str(tmp / "efs"),
            "PETCTL_SNAPSHOT_DIR": str(tmp / f"node{node}"),
            "PETCTL_SHARDED_MEMORY": "1",
            "PETCTL_DRAIN_FILE": str(tmp / f"drain-{node}"),
            "REF_DIR": str(tmp / "ref"),
            **(env or {}),
            **({"PETCTL_SNAPSHOT_DIR": ""} if r in no_store else {}),
        }
        for r, node in enumerate(nodes)
    ]
    return run_ranks([sys.executable, str(tmp / "rank.py"), str(tmp / "body.py")], envs, timeout=timeout)


def _result(cp: subprocess.CompletedProcess) -> dict:
    for line in cp.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result (rc {cp.returncode}):\n{cp.stderr[-3000:]}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two nodes' memories and EFS after a 2-rank job checkpointed steps 2 and 4, then died."""
    tmp = tmp_path_factory.mktemp("trained")
    r0, r1 = (_result(cp) for cp in _run(tmp, TRAIN, [0, 1]))
    assert r0["latest"] == 4  # step 4 reached EFS in the background, with latest last
    efs = tmp / "efs" / "ckpt-0000000004.dcp"
    assert sorted(os.listdir(efs)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((tmp / "efs.at2" / "latest").read_text())["step"] == 2
    for node in (0, 1):  # own shard + the other's replica + .metadata, each with a marker
        sd = tmp / f"node{node}" / "sharded"
        assert sorted(os.listdir(sd)) == ["ckpt-0000000002.dcp", "ckpt-0000000004.dcp"]
        files = sorted(os.listdir(sd / "ckpt-0000000004.dcp"))
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", f"petctl-rank-{node}.json"], files
    return tmp


def _scenario(trained: Path, tmp: Path) -> Path:
    shutil.copytree(trained, tmp, dirs_exist_ok=True)
    return tmp


def test_hard_loss_restores_from_own_shard_and_replica_without_efs(trained: Path, tmp_path: Path) -> None:
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node1")  # node 1 is gone with its memory
    shutil.rmtree(t / "efs")  # and EFS is not read: a load from it would find nothing
    (cp,) = _run(t, RESTORE, [0])
    r = _result(cp)
    assert r["step"] == 4 and r["same"] is True, cp.stderr[-2000:]
    assert r["restore"]["source"] == "memory" and r["restore"]["world_size"] == 2
    assert r["restore"]["fetched_bytes"] == 0
    assert "restored step 4 from node memory at world size 1 (saved at 2" in cp.stderr
    # the agent's event: every shard from this node's own memory (its own and the replica it held)
    rep = r["report"]
    assert rep["source"] == "self" and rep["step"] == 4 and rep["shards"] == {"self": [0, 1]}, rep
    assert rep["newest"] == 4 and rep["back_to"] is None and rep["bytes"] > 0


def test_loss_of_rank_0s_node_restores_from_the_other_node_alone(trained: Path, tmp_path: Path) -> None:
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node0")  # rank 0's node (the one that wrote .metadata) is gone
    shutil.rmtree(t / "efs")
    (cp,) = _run(t, RESTORE, [1])  # node 1's worker restarts as rank 0 of world size 1
    r = _result(cp)
    assert r["step"] == 4 and r["same"] is True, cp.stderr[-2000:]
    assert r["restore"]["source"] == "memory" and r["restore"]["fetched_bytes"] == 0


def test_both_copies_of_a_shard_gone_goes_back_to_efs_and_names_the_step(
    trained: Path, tmp_path: Path
) -> None:
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node1")
    (t / "node0" / "sharded" / "ckpt-0000000004.dcp" / "__1_0.distcp").unlink()  # rank 1's replica
    shutil.rmtree(t / "node0" / "sharded" / "ckpt-0000000002.dcp")  # and no older step in memory
    shutil.rmtree(t / "efs")
    (t / "efs.at2").rename(t / "efs")  # step 4's background write had not reached EFS
    (cp,) = _run(t, RESTORE, [0])
    r = _result(cp)
    assert r["step"] == 2 and r["same"] is True, cp.stderr[-2000:]
    assert r["restore"] == {"source": "efs", "step": 2, "newest": 4, "back_to": 2}
    assert "step 4 is not in the survivors' memory (no intact copy of rank 1's shard)" in cp.stderr
    assert "going back to step 2" in cp.stderr
    rep = r["report"]  # the agent's event: every shard from EFS, back to step 2 of 4
    assert rep["source"] == "efs" and rep["step"] == 2 and rep["shards"] == {"efs": [0, 1]}, rep
    assert rep["newest"] == 4 and rep["back_to"] == 2


MOVED = (
    """
if rank == 1:  # a persister moved `latest` to step 6 just before this rank read it (rank 0 read 4)
    real = sharded_memory.read_pointer

    def read_pointer(d):
        p = real(d)
        return {**p, "step": 6} if p else p

    sharded_memory.read_pointer = read_pointer
"""
    + RESTORE
)


def test_ranks_that_read_latest_at_different_steps_agree(trained: Path, tmp_path: Path) -> None:
    """Memory holds step 4 on both nodes; rank 0 reads EFS's `latest` at 4, rank 1 (a persister
    moved it meanwhile) at 6. Each rank planned from its own read: rank 0 a restore of step 4 from
    memory (DCP's collective load), rank 1 none (EFS is newer than memory): the job hung. The reads
    are gathered: no rank restores memory older than the newest `latest` any rank saw, and both
    take the same path (EFS, where the checkpoint directory's agreement then picks one step)."""
    t = _scenario(trained, tmp_path)
    r0, r1 = (_result(cp) for cp in _run(t, MOVED, [0, 1], timeout=90))
    # (the full state, cpu_offload'ed, is whole on rank 0 only: compared there)
    assert r0["step"] == r1["step"] == 4 and r0["same"] is True
    assert r0["restore"]["source"] == r1["restore"]["source"] == "efs"
    assert r0["restore"]["step"] == r1["restore"]["step"] == 6


def test_torn_memory_shard_is_never_loaded(trained: Path, tmp_path: Path) -> None:
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node1")
    own = t / "node0" / "sharded" / "ckpt-0000000004.dcp" / "__0_0.distcp"
    raw = bytearray(own.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte off: only the CRC tells
    own.write_bytes(bytes(raw))
    shutil.rmtree(t / "efs")
    (t / "efs.at2").rename(t / "efs")
    (cp,) = _run(t, RESTORE, [0])
    r = _result(cp)
    assert r["step"] == 2 and r["same"] is True, cp.stderr[-2000:]  # step 2, not the torn 4
    assert r["restore"]["source"] == "memory"  # the older step node 0's memory still holds intact
    rep = r["report"]  # the agent's event names the step gone back to
    assert rep["source"] == "self" and rep["step"] == 2 and rep["newest"] == 4 and rep["back_to"] == 2
    assert "step 4 is not in the survivors' memory (no intact copy of rank 0's shard)" in cp.stderr
    assert "going back to step 2" in cp.stderr


def test_torn_own_shard_is_fetched_from_the_peer_replica(trained: Path, tmp_path: Path) -> None:
    t = _scenario(trained, tmp_path)
    own = t / "node0" / "sharded" / "ckpt-0000000004.dcp" / "__0_0.distcp"
    own.write_bytes(own.read_bytes()[:100])  # torn
    shutil.rmtree(t / "efs")
    r0, r1 = (_result(cp) for cp in _run(t, RESTORE, [0, 1]))
    assert r0["step"] == r1["step"] == 4 and r0["same"] is True
    assert r0["restore"]["source"] == "memory" and r0["restore"]["fetched_bytes"] > 100
    assert r1["restore"]["fetched_bytes"] == 0
    # the agents' events: node 0 got rank 0's shard from the peer's replica, rank 1's from itself
    assert r0["report"]["source"] == "peer" and r0["report"]["shards"] == {"self": [1], "peer": [0]}
    assert r1["report"]["source"] == "self" and r1["report"]["shards"] == {"self": [0, 1]}
    fetched = t / "node0" / "sharded" / "ckpt-0000000004.dcp" / "__0_0.distcp"
    assert (
        fetched.read_bytes()
        == (t / "node1" / "sharded" / "ckpt-0000000004.dcp" / "__0_0.distcp").read_bytes()
    )


def test_a_newcomer_gets_every_shard_from_the_survivors_memory_and_says_so(
    trained: Path, tmp_path: Path
) -> None:
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node1")  # node 1 is lost; node 2 joins with empty memory
    shutil.rmtree(t / "efs")
    r0, r2 = (_result(cp) for cp in _run(t, RESTORE, [0, 2]))
    assert r0["step"] == r2["step"] == 4 and r0["same"] is True
    assert r0["report"]["source"] == "self" and r0["report"]["shards"] == {"self": [0, 1]}
    # it received the byte ranges its rank reads (rank 1's shard, from node 0's replica), not every
    # shard file (ranges.py): no part of rank 0's file, which its layout does not read
    assert r2["report"]["source"] == "peer" and r2["report"]["shards"] == {"peer": [1]}, r2["report"]
    assert r2["report"]["step"] == 4 and r2["report"]["back_to"] is None
    step4 = t / "node0" / "sharded" / "ckpt-0000000004.dcp"
    own1 = (step4 / "__1_0.distcp").stat().st_size + (step4 / ".metadata").stat().st_size
    assert 0 < r2["report"]["received"] == r2["restore"]["fetched_bytes"] <= own1


def test_a_newcomer_that_cannot_make_its_store_sends_every_rank_to_efs(trained: Path, tmp_path: Path) -> None:
    """As above, but node 2 cannot make its sharded store (a file stands where it goes: mkdir
    fails, as on a tmpfs out of inodes): the ranks agree on it before the transfer's collectives,
    and every rank restores step 4 from EFS."""
    t = _scenario(trained, tmp_path)
    shutil.rmtree(t / "node1")
    (t / "node2").mkdir()
    (t / "node2" / "sharded").write_text("not a directory")
    c0, c2 = _run(t, RESTORE_EFS, [0, 2], timeout=90)
    r0, r2 = _result(c0), _result(c2)
    assert r0["step"] == r2["step"] == 4 and r0["same"] is True
    assert r0["restore"]["source"] == r2["restore"]["source"] == "efs", (r0, r2)
    assert "a node could not make its sharded store (FileExistsError" in c0.stderr, c0.stderr[-2000:]


def test_peer_dying_mid_transfer_fails_fast_then_efs(trained: Path, tmp_path: Path) -> None:
    t = _scenario(trained, tmp_path)
    (t / "node0" / "sharded" / "ckpt-0000000004.dcp" / "__0_0.distcp").unlink()
    shutil.rmtree(t / "efs")
    (t / "efs.at2").rename(t / "efs")
    # node 1's worker dies as it starts sending node 0 the replica (the fault, injected in its script)
    dying = (
        "if rank == 1:\n"
        "    from petctl_agent.checkpointing import shardfiles\n"
        "    shardfiles.read_tensor = lambda *a: os._exit(9)\n" + RESTORE
    )
    t0 = time.monotonic()
    c0, c1 = _run(t, dying, [0, 1], env={"PETCTL_SHARD_FETCH_TIMEOUT": "20"}, timeout=90)
    assert c1.returncode == 9
    assert c0.returncode != 0 and time.monotonic() - t0 < 60, c0.stderr[-2000:]  # failed, did not hang
    assert not [n for n in os.listdir(t / "node0" / "sharded" / "ckpt-0000000004.dcp") if n.endswith(".tmp")]
    shutil.rmtree(t / "node1")  # the agent restarts the survivor alone: node 1's memory is gone
    (cp,) = _run(t, RESTORE, [0])
    r = _result(cp)
    assert r["step"] == 2 and r["same"] is True, cp.stderr[-2000:]  # step 4 lost rank 0's shard
    assert "going back to step 2" in cp.stderr


def test_drain_then_survivor_restores_from_memory_at_world_1(tmp_path: Path) -> None:
    c0, c1 = _run(tmp_path, DRAIN, [0, 1])
    from petctl_agent import DRAIN_EXIT_CODE

    assert c0.returncode == c1.returncode == DRAIN_EXIT_CODE, c0.stderr[-2000:] + c1.stderr[-2000:]
    pointer = json.loads((tmp_path / "efs" / "latest").read_text())
    assert pointer["step"] == 4 and pointer["format"] == "dcp"  # a drain waits for EFS
    for f in (tmp_path / "efs" / "ckpt-0000000004.dcp").glob("*.distcp"):
        f.unlink()  # a restore that read EFS would fail
    shutil.rmtree(tmp_path / "node1")  # node 1 left, its memory freed
    (cp,) = _run(tmp_path, RESTORE, [0])
    r = _result(cp)
    assert r["step"] == 4 and r["same"] is True, cp.stderr[-2000:]
    assert r["restore"]["source"] == "memory"


def test_memory_off_without_snapshot_dir_keeps_the_efs_path(tmp_path: Path) -> None:
    from petctl_agent.checkpointing import sharded_memory

    os.environ.pop("PETCTL_SNAPSHOT_DIR", None)
    assert sharded_memory.memory_root() is None
    assert sharded_memory.save({"w": torch.zeros(2)}, 1, tmp_path, 3, wait=True) is False
    assert sharded_memory.resume({"w": torch.zeros(2)}, tmp_path) is None


def test_sharded_memory_is_off_unless_the_job_opts_in(tmp_path: Path) -> None:
    # off by default: it cost more than DCP to EFS in every timed case (docs/benchmarks.md)
    c0, c1 = _run(tmp_path, TRAIN, [0, 1], env={"PETCTL_SHARDED_MEMORY": ""})
    assert c0.returncode == c1.returncode == 0, c0.stderr[-2000:] + c1.stderr[-2000:]
    for node in (0, 1):
        assert not (tmp_path / f"node{node}" / "sharded").exists()
    assert json.loads((tmp_path / "efs" / "latest").read_text())["format"] == "dcp"


RESTORE_EFS = """
st = state()
got = ckpt.resume(st)
out["step"] = None if got is None else got[1]
set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
out["same"] = same(full(), torch.load(os.path.join(REF, f"ref-{got[1]}.pt"), weights_only=True))
out["restore"] = sharded_memory.last_restore
"""


def test_a_node_without_a_store_takes_every_rank_to_efs_together(tmp_path: Path) -> None:
    """Rank 1's node has no store: every rank saves through DCP to EFS and restores from there, the
    same step and state on both (a rank gathering for the memory path beside one writing DCP: gloo
    aborts on the mismatch)."""
    cps = _run(tmp_path, TRAIN, [0, 1], no_store=(1,))
    assert [_result(cp)["latest"] for cp in cps] == [4, 4]
    assert not (tmp_path / "node0" / "sharded").exists()  # node 0's store was never used
    assert "has no memory snapshot store" in cps[0].stderr
    res = [_result(cp) for cp in _run(tmp_path, RESTORE_EFS, [0, 1], no_store=(1,))]
    assert [(r["step"], r["restore"]) for r in res] == [(4, None)] * 2
    assert res[0]["same"] is True  # the full state (cpu_offload: rank 0's) is step 4's, moments included


# 2 ranks of one node (one snapshot dir). Each rank's own need fits the (fake, small) free memory
# alone; the node's two ranks together do not: the node must say no, and the job write to EFS.
ONE_NODE_TIGHT = """
from petctl_agent.checkpointing import replicas
from petctl_agent.checkpointing.budget import RESERVE_MIN
own = replicas.local_bytes(state())
fake = os.path.join(os.environ["REF_DIR"], f"meminfo-{rank}")
with open(fake, "w") as f:  # room for 1.5x this rank's shard bytes: each rank alone fits
    f.write(f"MemTotal: {(1 << 30) // 1024} kB\\nMemAvailable: {(RESERVE_MIN + 3 * own // 2) // 1024} kB\\n")
sharded_memory.MEMINFO_PATH = fake
train(1)
ckpt.step(1, state, every=1)
sharded_memory.flush()
out["latest"] = ckpt.latest_step()
out["memory"] = sorted(os.listdir(os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "sharded")))
"""


def test_fit_is_decided_for_the_whole_node(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, ONE_NODE_TIGHT, [0, 0])
    a, b = _result(r0), _result(r1)
    assert a["memory"] == b["memory"] == [], r0.stderr[-2000:]  # nothing written to the node's memory
    assert a["latest"] == 1  # the EFS path took the step
    assert "sharded snapshot of step 1 does not fit in memory (node of rank 0:" in r0.stderr
    assert sorted(os.listdir(tmp_path / "efs" / "ckpt-0000000001.dcp")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]


# 2 nodes, one machine (one ledger, one MemAvailable): both nodes' needs fit it together. Before
# step 2 another allocation of this machine is in flight (a ledger entry of a live process: here
# rank 0's own pid, as another store's): with it, the second node to reserve does not fit, so
# step 2 goes to EFS; once it is done, step 3 to memory again.
LEDGER_HOG = """
from petctl_agent.checkpointing import replicas
from petctl_agent.checkpointing.budget import RESERVE_MIN
from petctl_agent.checkpointing.processes import this_process
ledger = os.environ["PETCTL_SNAPSHOT_LEDGER"]
seen = []
for s in range(1, 4):
    train(s)
    if s == 1:  # after the first step: Adam's state exists, the shard's bytes are what a save holds
        own = replicas.local_bytes(state())
        fake = os.path.join(os.environ["REF_DIR"], f"meminfo-{rank}")
        # the machine's room: 5x a shard's bytes; each node needs 2x (own + replica): both fit (4x)
        with open(fake, "w") as f:
            f.write(f"MemTotal: {(1 << 30) // 1024} kB\\nMemAvailable: {(RESERVE_MIN + 5 * own) // 1024} kB\\n")
        sharded_memory.MEMINFO_PATH = fake
    if s == 2 and rank == 0:
        pid, start = this_process()
        with open(ledger, "a") as f:  # 2x a shard promised to another allocation, none of it taken
            f.write(json.dumps({"pid": pid, "start": start, "id": "hog", "need": 2 * own, "fd": -1}) + "\\n")
    dist.barrier()
    ckpt.step(s, state, every=1)
    sharded_memory.flush()
    seen.append(sorted(os.listdir(os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "sharded"))))
    if s == 2 and rank == 0:
        with open(ledger, "w") as f:  # the other allocation is done
            pass
    dist.barrier()
out["seen"] = seen
out["latest"] = ckpt.latest_step()
"""


def test_a_sharded_step_counts_the_machines_allocations_in_flight(tmp_path: Path) -> None:
    """The sharded path's per-node decision reserves in the machine's ledger, as the replicated
    path's writes do: an allocation of another store in flight (not yet in MemAvailable) makes a
    step that fits MemAvailable alone go to EFS, never both into memory (never an OOM)."""
    r0, r1 = _run(tmp_path, LEDGER_HOG, [0, 1], env={"PETCTL_SNAPSHOT_LEDGER": str(tmp_path / "ledger")})
    a, b = _result(r0), _result(r1)
    step1, step3 = ["ckpt-0000000001.dcp"], ["ckpt-0000000001.dcp", "ckpt-0000000003.dcp"]
    assert a["seen"] == b["seen"] == [step1, step1, step3], (a["seen"], r0.stderr[-2000:])
    assert "sharded snapshot of step 2 does not fit in memory (node of rank" in r0.stderr, r0.stderr[-2000:]
    assert "step 1 does not fit" not in r0.stderr and "step 3 does not fit" not in r0.stderr
    assert (tmp_path / "efs" / "ckpt-0000000002.dcp").is_dir() and a["latest"] == 3
    assert (tmp_path / "ledger").read_text() == ""  # every reservation ended with its write


# rank 1's EFS copy of step 2 fails (an I/O error on EFS, injected in its process only); the default
# PETCTL_CHECKPOINT_TIMEOUT (30 min) stays: rank 0 must give step 2 up at once, the job go on
COPY_FAILS = """
import time as _t
real = shutil.copyfileobj
def eio(src, dst, n=0):
    if "ckpt-0000000002" in dst.name:
        raise OSError(5, "injected EFS I/O error")
    return real(src, dst, n)
if rank == 1:
    shutil.copyfileobj = eio
seen = []
t0 = _t.monotonic()
for s in range(1, 7):
    train(s)
    ckpt.step(s, state, every=2, last=s == 6)
    seen.append(ckpt.latest_step())
out["seen"] = seen
out["secs"] = _t.monotonic() - t0
out["efs"] = sorted(os.listdir(D))
"""


def test_a_rank_failing_its_efs_copy_gives_the_step_up_at_once(tmp_path: Path) -> None:
    t0 = time.monotonic()
    c0, c1 = _run(tmp_path, COPY_FAILS, [0, 1], timeout=90)
    a, b = _result(c0), _result(c1)
    assert a["seen"][-1] == 6 and 2 not in a["seen"] + b["seen"], c0.stderr[-2000:]
    assert "rank 1 could not copy its shard of step 2" in c0.stderr, c0.stderr[-2000:]
    assert not [n for n in a["efs"] if ".tmp" in n or n == "ckpt-0000000002.dcp"], a["efs"]
    assert time.monotonic() - t0 < 80


# rank 0's EFS copy of the last step fails: every rank raises, together (rank 0 raising alone left
# rank 1 in the barrier for PETCTL_CHECKPOINT_TIMEOUT, or with a broken group's error)
LAST_COPY_FAILS = """
real = shutil.copyfileobj
def eio(src, dst, n=0):
    if "ckpt-0000000003" in dst.name:
        __import__("time").sleep(2)  # rank 1's copy is done by then: only rank 0 fails
        raise OSError(5, "injected EFS I/O error")
    return real(src, dst, n)
if rank == 0:
    shutil.copyfileobj = eio
for s in range(1, 4):
    train(s)
    try:
        ckpt.step(s, state, every=2, last=s == 3)
    except RuntimeError as e:
        out["error"] = str(e)
out["latest"] = ckpt.latest_step()
"""


def test_a_failed_copy_of_the_last_step_fails_every_rank_together(tmp_path: Path) -> None:
    c0, c1 = _run(tmp_path, LAST_COPY_FAILS, [0, 1], timeout=90)
    a, b = _result(c0), _result(c1)
    assert "persisting step 3" in a["error"] and "injected EFS I/O error" in a["error"], a
    assert b["error"].startswith("persisting step 3 ") and "another rank failed" in b["error"], b
    assert a["latest"] == b["latest"] == 2  # step 3 never named by latest


# EFS is slow: every rank's copy takes 8 s. Periodic saves at every step must not wait for it:
# steps whose predecessor is still being copied stay in memory only; the last step waits for EFS.
# (8 s, not 4: a periodic save -- a gloo agreement and a snapshot -- takes a fraction of a second
# idle but can take seconds on a loaded CI box; the bound between "no wait" and "waited for EFS"
# sits at half the copy)
SLOW_EFS = """
import time as _t
real = shutil.copyfileobj
def slow(src, dst, n=0):
    _t.sleep(8)
    return real(src, dst, n)
shutil.copyfileobj = slow
took = []
held = []
for s in range(1, 7):
    train(s)
    reference(s)
    t0 = _t.monotonic()
    ckpt.step(s, state, every=1, last=s == 6)
    took.append(_t.monotonic() - t0)
    held.append(len(os.listdir(os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "sharded"))))
out["took"] = took
out["held"] = held
out["latest"] = ckpt.latest_step()
out["efs"] = sorted(n for n in os.listdir(D) if n.startswith("ckpt-"))
"""


def test_periodic_saves_do_not_wait_for_a_slow_efs_copy(tmp_path: Path) -> None:
    c0, c1 = _run(tmp_path, SLOW_EFS, [0, 1], timeout=240)  # a hang guard: 69 s seen under load
    a, b = _result(c0), _result(c1)
    assert max(a["took"][1:5] + b["took"][1:5]) < 4, (a["took"], b["took"])  # no 8 s wait on EFS
    assert a["took"][5] > 7  # the last step waits for its copy
    assert a["latest"] == 6 and a["efs"][-1] == "ckpt-0000000006.dcp"
    assert "ckpt-0000000002.dcp" not in a["efs"]  # skipped: step 1 was still being copied
    assert "step 2: kept in node memory only; step 1 is still being copied" in c0.stderr
    assert max(a["held"] + b["held"]) <= 3  # the copied step, the newest complete one, the new one


def test_a_marker_of_the_zlib_era_is_not_offered(tmp_path: Path) -> None:
    """A node's memory can hold a sharded step across an agent upgrade: a ``petctl-sharded-1``
    marker (zlib crc32s under ``crc32``) vouches for nothing the CRC-32C code offers a peer or
    loads; the same file under a marker of today's format is offered."""
    import zlib

    from petctl_agent.checkpointing import crcs, shardfiles, shardplan

    stepdir = tmp_path / "ckpt-0000000004.dcp"
    stepdir.mkdir()
    data = bytes(range(256)) * 64
    (stepdir / "__0_0.distcp").write_bytes(data)

    def marker(fmt: str, key: str, crc: int) -> None:
        body = {"format": fmt, "step": 4, "id": "s1", "world_size": 1, "rank": 0, "counts": {"0": 1},
                "files": {"__0_0.distcp": {"owner": 0, "size": len(data), key: crc}}}  # fmt: skip
        (stepdir / "petctl-rank-0.json").write_text(json.dumps(body))

    marker("petctl-sharded-1", "crc32", zlib.crc32(data))
    assert shardplan.inventory(tmp_path) == {}
    marker(shardfiles.MARKER_FMT, "crc32c", crcs.crc(data))
    assert shardplan.inventory(tmp_path)["4"]["files"] == {"__0_0.distcp": [0, len(data), crcs.crc(data)]}
