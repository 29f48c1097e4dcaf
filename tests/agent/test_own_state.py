"""What comes back per rank: every rank's own state, with the calls docs/agent.md shows.

Real torch processes on gloo, two ranks. Each test saves through ``ckpt.step`` in one process
group and resumes in a fresh one (a restart), then compares what each rank got back with what
that very rank saved, by value: the optimizer's moments of an FSDP2 model, each rank's own RNG
state and data position (the EFS path, the memory snapshot path and the sharded path), and a
per-rank value saved outside ``state["per_rank"]``, which must be refused, not collapsed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checkpoint import _result, _run_ranks

pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")

FSDP = """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def moments():
        total = 0.0
        for st in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                total += float(st[k].to_local().abs().sum()) if k in st else 0.0
        t = torch.tensor([total])
        dist.all_reduce(t)
        return float(t)

    def weights():
        return [p.full_tensor().sum().item() for p in model.parameters()]

    mode = os.environ["MODE"]
    if mode == "save":
        for s in (1, 2, 3):
            torch.manual_seed(100 + s)
            model(torch.randn(8, 16)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(s, lambda: {"model": model, "optim": opt}, every=0, last=s == 3)
        out["moments"] = moments()
        out["weights"] = weights()
        out["steps"] = [float(st["step"]) for st in opt.state.values()]
    elif mode == "objects":  # the documented usage: the model and a fresh optimizer themselves
        state, step = ckpt.resume({"model": model, "optim": opt})
        out["step"] = step
        out["moments"] = moments()
        out["weights"] = weights()
        out["steps"] = [float(st["step"]) for st in opt.state.values()]
    else:  # a fresh optimizer's state_dict(): nothing to fill the moments into
        if mode == "dicts-eio" and rank == 1:  # and rank 1's first read of .metadata fails (EFS: EIO)
            from petctl_agent.checkpointing import sharded
            real_load, calls = sharded._safe_metadata_load, [0]
            def failing_load(*a, **kw):
                calls[0] += 1
                if calls[0] == 1:
                    raise OSError(5, "injected EFS I/O error")
                return real_load(*a, **kw)
            sharded._safe_metadata_load = failing_load
        try:
            ckpt.resume({"model": model.state_dict(), "optim": opt.state_dict()})
            out["error"] = None
        except ckpt.MissingStateError as e:
            out["error"] = str(e)
"""


def test_fsdp2_optimizer_moments_come_back_into_a_fresh_optimizer(tmp_path: Path) -> None:
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck")}
    saved = [_result(cp) for cp in _run_ranks(tmp_path, FSDP, env={**env, "MODE": "save"})]
    assert saved[0]["moments"] > 0
    back = [_result(cp) for cp in _run_ranks(tmp_path, FSDP, env={**env, "MODE": "objects"})]
    for r in back:
        assert r["step"] == 3
        assert r["moments"] == pytest.approx(saved[0]["moments"], rel=1e-6)
        assert r["weights"] == pytest.approx(saved[0]["weights"], rel=1e-6)
        assert r["steps"] == saved[0]["steps"]  # Adam's step counts too, not the init's 1.0
    # the dict of a fresh optimizer lacks the moments: an error on every rank, not a silent loss
    dicts = [_result(cp) for cp in _run_ranks(tmp_path, FSDP, env={**env, "MODE": "dicts"})]
    for r in dicts:
        assert r["error"] and "lacks" in r["error"] and "exp_avg" in r["error"], r
        assert "\n" not in r["error"]
    # the same when rank 1 could not read .metadata to check (it went into DCP's collectives while
    # rank 0 raised: a hang until the checkpoint timeout)
    eio = [_result(cp) for cp in _run_ranks(tmp_path, FSDP, env={**env, "MODE": "dicts-eio"}, timeout=90)]
    assert [r["error"] for r in eio] == [r["error"] for r in dicts], eio


PER_RANK = """
    torch.manual_seed(1234 + 7 * rank)  # every rank its own stream
    sharded = os.environ.get("SHARDED") == "1"
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        def weights(v):
            return {"w": distribute_tensor(torch.full((4, 2), float(v)), mesh, [Shard(0)])}
    else:
        def weights(v):
            return {"w": torch.full((4, 2), float(v))}

    def state(s):
        return {"model": weights(s), "step": s,
                "per_rank": {"rng": torch.get_rng_state(), "position": 1000 * rank + s}}

    if os.environ["MODE"] == "save":
        for s in (1, 2):
            torch.rand(3)  # training draws from this rank's stream
            ckpt.step(s, lambda: state(s), every=0, last=s == 2)
        out["rng"] = torch.get_rng_state().tolist()
    else:
        got = ckpt.resume(lambda: {"model": weights(0), "step": 0})
        st, step = got
        out["step"] = step
        out["position"] = st["per_rank"]["position"]
        out["rng"] = st["per_rank"]["rng"].tolist()
        torch.set_rng_state(st["per_rank"]["rng"])
        out["next"] = torch.rand(2).tolist()
"""


@pytest.mark.parametrize("path", ["efs", "memory-self", "memory-peer", "sharded"])
def test_each_rank_gets_its_own_rng_state_and_position_back(tmp_path: Path, path: str) -> None:
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck"), "SHARDED": "1" if path == "sharded" else "0"}
    if path.startswith("memory"):  # each rank a node of its own, with its own store
        env["PETCTL_SNAPSHOT_DIR"] = str(tmp_path / "shm-{rank}")
        if path == "memory-self":  # each its node's local rank 0, which writes the store: restores from it
            env["LOCAL_RANK"] = "0"  # (else rank 1 holds nothing and receives from rank 0)
    per_rank_env = [{k: v.replace("{rank}", str(r)) for k, v in env.items()} for r in range(2)]
    saved = [
        _result(cp) for cp in _run_ranks(tmp_path, PER_RANK, env={"MODE": "save"}, per_rank=per_rank_env)
    ]
    assert saved[0]["rng"] != saved[1]["rng"]
    back = [_result(cp) for cp in _run_ranks(tmp_path, PER_RANK, env={"MODE": "load"}, per_rank=per_rank_env)]
    for rank, r in enumerate(back):
        assert r["step"] == 2
        assert r["position"] == 1000 * rank + 2
        assert r["rng"] == saved[rank]["rng"], f"rank {rank} got another rank's RNG state"
    assert back[0]["next"] != back[1]["next"]


DIFFERS = """
    import torch
    state = {"w": torch.ones(3), "sampler_position": 10 + rank}
    try:
        ckpt.step(1, lambda: state, every=0, last=True)
        out["error"] = None
    except ckpt.PerRankStateError as e:
        out["error"] = str(e)
    out["files"] = sorted(os.listdir(os.environ["PETCTL_CHECKPOINT_DIR"])) if os.path.isdir(os.environ["PETCTL_CHECKPOINT_DIR"]) else []
"""


def test_a_per_rank_value_outside_per_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck")}
    got = [_result(cp) for cp in _run_ranks(tmp_path, DIFFERS, env=env)]
    for r in got:
        assert r["error"] and "state['sampler_position'] differs between ranks 0 and 1" in r["error"], r
        assert "per_rank" in r["error"]
        assert r["files"] == []  # nothing written


LIVE = """
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    mode = os.environ["MODE"]
    if mode == "save":  # saved wrapped, as a script trains
        ddp = DDP(model)
        for s in (1, 2, 3):
            torch.manual_seed(s)
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step(); opt.zero_grad(); sched.step()
            ckpt.step(s, lambda: {"model": ddp, "optim": opt, "sched": sched}, every=0, last=s == 3)
    elif mode == "load":  # resumed bare, before wrapping, into fresh objects
        state, out["step"] = ckpt.resume({"model": model, "optim": opt, "sched": sched})
        out["per_rank"] = state.get("per_rank", "absent")
    else:  # a key the checkpoint does not have
        try:
            ckpt.resume({"model": model, "optimizer": opt})
            out["error"] = None
        except ckpt.MissingStateError as e:
            out["error"] = str(e)
    out["weight"] = model.weight.sum().item()
    out["momentum"] = sum(float(st["momentum_buffer"].sum()) for st in opt.state.values())
    out["lr"], out["epoch"] = opt.param_groups[0]["lr"], sched.last_epoch
"""


def test_a_ddp_model_optimizer_and_scheduler_come_back_into_fresh_objects(tmp_path: Path) -> None:
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck")}
    saved = [_result(cp) for cp in _run_ranks(tmp_path, LIVE, env={**env, "MODE": "save"})]
    back = [_result(cp) for cp in _run_ranks(tmp_path, LIVE, env={**env, "MODE": "load"})]
    for r in back:
        assert r["step"] == 3 and r["per_rank"] == "absent"  # nothing was saved per rank
        for k in ("weight", "momentum", "lr", "epoch"):
            assert r[k] == pytest.approx(saved[0][k]), k
    assert saved[0]["epoch"] == 3 and saved[0]["lr"] == pytest.approx(0.05)
    wrong = [_result(cp) for cp in _run_ranks(tmp_path, LIVE, env={**env, "MODE": "wrong"})]
    for r in wrong:
        assert r["error"] and "no 'optimizer'" in r["error"] and "\n" not in r["error"], r


SOME_PER_RANK = """
    state = {"w": torch.ones(3)}
    if rank == 1:
        state["per_rank"] = {"position": 7}
    try:
        ckpt.step(1, lambda: state, every=0, last=True)
        out["error"] = None
    except ckpt.PerRankStateError as e:
        out["error"] = str(e)
"""


def test_a_per_rank_entry_on_some_ranks_only_is_refused_not_a_hang(tmp_path: Path) -> None:
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck")}
    for r in (_result(cp) for cp in _run_ranks(tmp_path, SOME_PER_RANK, env=env, timeout=60)):
        assert r["error"] and "is on rank(s) [1] only" in r["error"], r


def test_a_sharded_checkpoint_at_another_world_size_gives_rank_0_its_own_entry(tmp_path: Path) -> None:
    import torch

    from petctl_agent import checkpoint as ckpt

    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "ck"), "SHARDED": "1", "MODE": "save"}
    saved = [_result(cp) for cp in _run_ranks(tmp_path, PER_RANK, env=env)]
    # one process, no process group: DCP reshards the 2 ranks' shards into the whole tensor
    state, step = ckpt.resume({"model": {"w": torch.zeros(4, 2)}, "step": 0}, directory=tmp_path / "ck")
    assert step == 2 and torch.equal(state["model"]["w"], torch.full((4, 2), 2.0))
    assert state["per_rank"]["position"] == 2 and state["per_rank"]["rng"].tolist() == saved[0]["rng"]
