"""Every rank resumes from the same checkpoint-directory step (``checkpointing/loading.py``, ``load_agreed``).

Before: each rank read ``latest`` and fell back on its own, so a pointer moved by the agent's
persister between the ranks' reads, or one rank's unreadable copy, left the replicas at different
steps (DDP then averages gradients of different weights; a DCP load mixes steps). Real torch
processes over gloo on 127.0.0.1 (the harness of test_checkpoint.py); what moves the pointer is
the checkpoint's own atomic writer, ordered between the ranks' reads with a barrier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint import _result, _run_ranks

from petctl_agent import checkpoint as ckpt

#: rank 0's first read of `latest` returns what it read, then ``publish()`` moves the pointer;
#: the other ranks' first reads come after that (a barrier orders them)
MOVE_ON_FIRST_READ = """
    def move_on_first_read(publish):
        from petctl_agent.checkpointing import loading
        real, first = loading.read_pointer, [True]
        def read_pointer(dd):
            if not first[0]:
                return real(dd)
            first[0] = False
            if rank == 0:
                p = real(dd)
                publish()
                dist.barrier()
                return p
            dist.barrier()
            return real(dd)
        loading.read_pointer = read_pointer
"""

#: rank 0 reads `latest` (step 10); then step 15 is published (the persister's write, here
#: checkpoint's own writer on rank 0); then the other ranks read `latest` (step 15)
MOVED = (
    MOVE_ON_FIRST_READ
    + """
    from pathlib import Path
    from petctl_agent.checkpointing.files import write_file
    d = Path(os.environ["PETCTL_CHECKPOINT_DIR"])
    move_on_first_read(lambda: write_file({"w": torch.full((4,), 15.0)}, 15, d, 3))
    got = ckpt.resume()
    out["step"] = got[1]
    out["w"] = got[0]["w"].tolist()
"""
)


def test_a_pointer_moved_between_the_ranks_reads_every_rank_loads_one_step(tmp_path: Path) -> None:
    """Rank 0 saw step 10 in ``latest``, rank 1 step 15: both load step 15 (the newest pointer:
    ``latest`` only moves forward, so it was durable; before: rank 0 at 10, rank 1 at 15)."""
    d = tmp_path / "ck"
    ckpt.save({"w": torch.full((4,), 10.0)}, 10, d)
    res = [_result(cp) for cp in _run_ranks(tmp_path, MOVED, env={"PETCTL_CHECKPOINT_DIR": str(d)})]
    assert [r["step"] for r in res] == [15, 15], res
    assert all(r["w"] == [15.0] * 4 for r in res), res


#: the last rank's read of step 15's file returns one byte changed (an EFS client's bad read):
#: its sha256 check fails on that rank only
BAD_COPY = """
    import hashlib
    from petctl_agent.checkpointing import files
    real = files.file_sha256
    def file_sha256(path):
        if rank == dist.get_world_size() - 1 and os.path.basename(str(path)) == "ckpt-0000000015.pt":
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0xFF
            return hashlib.sha256(data).hexdigest()
        return real(path)
    files.file_sha256 = file_sha256
    got = ckpt.resume()
    out["step"] = got[1]
    out["w"] = got[0]["w"].tolist()
"""


def test_one_ranks_unreadable_newest_sends_every_rank_to_the_same_older_step(tmp_path: Path) -> None:
    """Three ranks; rank 2's copy of the newest (step 15) fails its sha256: all three load step 10
    (before: ranks 0 and 1 at 15, rank 2 alone at 10)."""
    d = tmp_path / "ck"
    ckpt.save({"w": torch.full((4,), 10.0)}, 10, d)
    ckpt.save({"w": torch.full((4,), 15.0)}, 15, d)
    cps = _run_ranks(tmp_path, BAD_COPY, world=3, env={"PETCTL_CHECKPOINT_DIR": str(d)})
    res = [_result(cp) for cp in cps]
    assert [r["step"] for r in res] == [10, 10, 10], res
    assert all(r["w"] == [10.0] * 4 for r in res), res
    assert "checksum mismatch" in cps[2].stderr and "unreadable on rank(s) [2]" in cps[0].stderr


#: after the ranks agreed on step 10, and before rank 0 loads it, step 15 is published with
#: keep=1: step 10 is pruned (retention) under rank 0's feet
PRUNED = """
    from pathlib import Path
    from petctl_agent.checkpointing.files import write_file
    d = Path(os.environ["PETCTL_CHECKPOINT_DIR"])
    from petctl_agent.checkpointing import loading
    real, first = loading.load_file, [True]
    def load_file(path, *a, **k):
        if rank == 0 and first[0]:
            first[0] = False
            write_file({"w": torch.full((4,), 15.0)}, 15, d, 1)
        return real(path, *a, **k)
    loading.load_file = load_file
    got = ckpt.resume()
    out["step"] = None if got is None else got[1]
    out["w"] = None if got is None else got[0]["w"].tolist()
"""


def test_a_step_pruned_after_the_agreement_moves_every_rank_to_the_new_latest(tmp_path: Path) -> None:
    """The agreed step 10 is gone for rank 0 (pruned when step 15 was published, keep=1) and no
    older one is left: the ranks agree again, on the new ``latest`` (before: rank 0 resumed from
    nothing, rank 1 from step 10)."""
    d = tmp_path / "ck"
    ckpt.save({"w": torch.full((4,), 10.0)}, 10, d, keep=1)
    res = [_result(cp) for cp in _run_ranks(tmp_path, PRUNED, env={"PETCTL_CHECKPOINT_DIR": str(d)})]
    assert [r["step"] for r in res] == [15, 15], res
    assert all(r["w"] == [15.0] * 4 for r in res), res


#: the start of both sharded scripts: DCP checkpoints of steps 1 and 2, each rank its shard
SHARDED_STEPS_1_2 = """
    import os
    from pathlib import Path
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    d = Path(os.environ["PETCTL_CHECKPOINT_DIR"])
    full = torch.arange(32.0).reshape(8, 4)
    for s in (1, 2):
        ckpt.save({"model": {"w": distribute_tensor(full * s, mesh, [Shard(0)])}}, s, keep=3)
"""

#: sharded (DCP) steps 1 and 2; `latest` put back at step 1 (step 2's publish not yet done); rank 0
#: reads it, then publishes step 2 (what a sharded save's rank 0 does), then rank 1 reads it
SHARDED_MOVED = (
    SHARDED_STEPS_1_2
    + MOVE_ON_FIRST_READ
    + """
    import json
    from petctl_agent.checkpointing.files import write_pointer
    step2 = json.loads((d / "latest").read_text())
    if rank == 0:
        write_pointer(d, {**step2, "file": "ckpt-0000000001.dcp", "step": 1})
    dist.barrier()
    move_on_first_read(lambda: write_pointer(d, step2))
    into = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}}
    state, step = ckpt.resume(into)
    out["step"] = step
    out["local"] = state["model"]["w"].to_local().tolist()
"""
)


def test_sharded_fallback_loads_one_step_on_every_rank(tmp_path: Path) -> None:
    """The same pointer move with DCP checkpoints: both ranks load step 2, each its own shard of it
    (before: rank 0 entered DCP's collective load of step 1, rank 1 of step 2)."""
    pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")
    d = tmp_path / "ck"
    env = {"PETCTL_CHECKPOINT_DIR": str(d), "PETCTL_CHECKPOINT_TIMEOUT": "30"}
    r0, r1 = (_result(cp) for cp in _run_ranks(tmp_path, SHARDED_MOVED, env=env))
    assert r0["step"] == r1["step"] == 2, (r0, r1)
    full = torch.arange(32.0).reshape(8, 4) * 2
    assert r0["local"] == full[:4].tolist() and r1["local"] == full[4:].tolist()
    assert json.loads((d / "latest").read_text())["step"] == 2


#: sharded (DCP) steps 1 and 2; then rank 0 truncates one shard file of step 2 (an EFS write cut
#: short, a damaged copy): DCP's load of step 2 fails on every rank with its CheckpointException
SHARDED_TRUNCATED = (
    SHARDED_STEPS_1_2
    + """
    if rank == 0:
        shards = sorted((d / "ckpt-0000000002.dcp").glob("*.distcp"))
        out["shards"] = [p.name for p in shards]
        os.truncate(shards[-1], shards[-1].stat().st_size // 2)
    dist.barrier()
    into = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}}
    state, step = ckpt.resume(into)
    out["step"] = step
    out["local"] = state["model"]["w"].to_local().tolist()
"""
)


def test_a_truncated_shard_of_the_newest_sharded_step_sends_every_rank_to_the_older_one(
    tmp_path: Path,
) -> None:
    """One shard file of the newest DCP step (2) cut in half: both ranks load step 1, each its own
    shard (before: DCP's CheckpointException, a BaseException, went past the agreement's
    ``except Exception`` and out of resume on every rank -- every restart hit the same step)."""
    pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")
    d = tmp_path / "ck"
    env = {"PETCTL_CHECKPOINT_DIR": str(d), "PETCTL_CHECKPOINT_TIMEOUT": "30"}
    cps = _run_ranks(tmp_path, SHARDED_TRUNCATED, env=env)
    r0, r1 = (_result(cp) for cp in cps)
    assert len(r0["shards"]) == 2, r0  # one file per rank: the truncated one is rank 1's
    assert r0["step"] == r1["step"] == 1, (r0, r1)
    full = torch.arange(32.0).reshape(8, 4)
    assert r0["local"] == full[:4].tolist() and r1["local"] == full[4:].tolist()
    assert "ckpt-0000000002.dcp unreadable on rank(s) [0, 1]; every rank tries older" in cps[0].stderr
    # one line per rank naming the rank whose shard failed (not DCP's multi-rank traceback)
    assert "ckpt-0000000002.dcp: DCP load failed on rank(s) [1]: RuntimeError" in cps[0].stderr
    assert "Traceback" not in cps[0].stderr + cps[1].stderr


#: rank 1's listing of the checkpoint directory fails (an EFS client's EIO); the script catches
#: what resume raises and goes on (here: a barrier on the default group, as training would)
LIST_FAILS = """
    import errno, time
    from petctl_agent.checkpointing.files import write_file
    if rank == 1:
        def list_checkpoints(d):
            raise OSError(errno.EIO, "Input/output error", str(d))
        from petctl_agent.checkpointing import loading
        loading.list_checkpoints = list_checkpoints
    t0 = time.monotonic()
    try:
        ckpt.resume()
        out["err"] = None
    except Exception as e:
        out["err"] = [type(e).__name__, getattr(e, "errno", None), str(e)]
    out["secs"] = time.monotonic() - t0
    dist.barrier()
"""


def test_one_ranks_failed_listing_raises_on_every_rank_without_a_hang(tmp_path: Path) -> None:
    """Rank 1 cannot list the directory (EIO): both ranks raise the same OSError naming rank 1, at
    once (before: rank 1 raised before the first gather and went on into its barrier; rank 0 waited
    in the gather until the checkpoint group's timeout -- 20 s here, 1800 s by default)."""
    d = tmp_path / "ck"
    ckpt.save({"w": torch.full((4,), 10.0)}, 10, d)
    env = {"PETCTL_CHECKPOINT_DIR": str(d), "PETCTL_CHECKPOINT_TIMEOUT": "20"}
    r0, r1 = (_result(cp) for cp in _run_ranks(tmp_path, LIST_FAILS, env=env, timeout=90))
    assert r0["err"] == r1["err"], (r0, r1)
    kind, eno, msg = r0["err"]
    assert kind == "OSError" and eno == 5, r0
    assert "rank 1 could not list" in msg and "Input/output error" in msg and "\n" not in msg, msg
    assert r0["secs"] < 10 and r1["secs"] < 10, (r0, r1)
