"""A sharded restore from node memory receives only the byte ranges each node's new layout reads
(checkpointing/ranges.py), after a check that they fit in the node's memory.

Four "nodes" (one rank each, their own ``PETCTL_SNAPSHOT_DIR``) save an FSDP2 model with Adam on
gloo (test_sharded_memory.py's harness, a wider model); each node then holds its own shard file,
the ring replica of the previous rank's and ``.metadata``. The restores move ranks to other nodes,
replace a node, or halve the world. What a node received is the module's own accounting
(``last_restore["fetched_bytes"]``, ``received`` in the node's ``restore.json``), and each rank
compares its own restored shards with the saved full state.

    python -m pytest -s tests/agent/test_sharded_ranges.py   # prints the bytes per node
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")

from test_sharded_memory import _result, _run  # noqa: E402

WIDE = {"WIDTH": "256"}  # ~0.8 MiB of state (parameters + Adam's two moments): .metadata is small beside it

TRAIN4 = """
for s in range(1, 3):
    train(s)
    reference(s)
    # with each rank's own entry (userstate.py): one opaque value DCP stores once, which every
    # rank's load reads: its range must come over too
    ckpt.step(s, lambda: {**state(), "per_rank": {"r": torch.tensor([10 * rank + s])}}, every=2)
sharded_memory.flush()
out["latest"] = ckpt.latest_step()
"""

# each rank restores, then compares its own part of every tensor with the saved full state
RESTORE_MINE = """
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
SPY = os.environ.get("SPY_TARGETS")
made = []
if SPY:  # every receive buffer (a node's receive file) the restore allocates
    try:
        from petctl_agent.checkpointing import ranges
        real_target = ranges._target
        def _target(path, size):
            made.append(str(path))
            return real_target(path, size)
        ranges._target = _target
    except ImportError:
        pass
if os.environ.get("TIGHT_RANK") == str(rank):  # this node's memory: nothing to spare past the reserve
    from petctl_agent.checkpointing.budget import RESERVE_MIN
    fake = os.path.join(os.environ["REF_DIR"], f"meminfo-{rank}")
    with open(fake, "w") as f:
        f.write(f"MemTotal: {(1 << 30) // 1024} kB\\nMemAvailable: {(RESERVE_MIN + 4096) // 1024} kB\\n")
    sharded_memory.MEMINFO_PATH = fake

def mine(a, ref):
    if isinstance(a, DTensor):
        shape, off = compute_local_shape_and_global_offset(ref.shape, a.device_mesh, a.placements)
        return torch.equal(a.to_local(), ref[tuple(slice(o, o + n) for o, n in zip(off, shape))])
    if isinstance(a, torch.Tensor):
        return torch.equal(a, ref)
    if isinstance(a, dict):
        return a.keys() == ref.keys() and all(mine(a[k], ref[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(ref) and all(mine(x, y) for x, y in zip(a, ref))
    return a == ref

got = ckpt.resume(state())
out["step"] = None if got is None else got[1]
if got is not None:
    ref = torch.load(os.path.join(REF, f"ref-{got[1]}.pt"), weights_only=True)
    out["mine"] = mine({k: v for k, v in got[0].items() if k != "per_rank"}, ref)
    out["tensors"] = sum(1 for v in got[0]["model"].values() if isinstance(v, DTensor))
    out["own"] = got[0]["per_rank"]["r"].tolist()
out["restore"] = sharded_memory.last_restore
out["made"] = made
rep = os.path.join(os.environ["PETCTL_SNAPSHOT_DIR"], "restore.json")
out["report"] = json.load(open(rep)) if os.path.exists(rep) else None
"""


@pytest.fixture(scope="module")
def trained4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four nodes' memories and EFS after a 4-rank job checkpointed step 2."""
    tmp = tmp_path_factory.mktemp("trained4")
    res = [_result(cp) for cp in _run(tmp, TRAIN4, [0, 1, 2, 3], env=WIDE, timeout=240)]
    assert res[0]["latest"] == 2
    for node in range(4):  # own shard + the previous rank's replica + .metadata
        files = sorted(os.listdir(tmp / f"node{node}" / "sharded" / "ckpt-0000000002.dcp"))
        want = sorted([".metadata", f"__{node}_0.distcp", f"__{(node - 1) % 4}_0.distcp"])
        assert [f for f in files if not f.startswith("petctl-")] == want, files
    return tmp


def _data_bytes(t: Path) -> int:
    """The step's shard files' bytes (the state as DCP stores it), from EFS's copy."""
    return sum(f.stat().st_size for f in (t / "efs" / "ckpt-0000000002.dcp").glob("__*.distcp"))


def _restore(trained4: Path, tmp: Path, nodes: list[int], env: dict | None = None) -> tuple[list, list]:
    shutil.copytree(trained4, tmp, dirs_exist_ok=True)
    cps = _run(tmp, RESTORE_MINE, nodes, env={**WIDE, **(env or {})}, timeout=240)
    return cps, [_result(cp) for cp in cps]


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param([2, 3, 0, 1], id="ranks-moved"),  # each rank's shard is on no node it now runs on
        pytest.param([0, 1, 2, 4], id="newcomer"),  # node 3 lost (its shard's replica is on node 0)
        pytest.param([0, 2], id="world-4-to-2"),
        pytest.param([4, 4, 0, 2], id="newcomer-with-2-ranks"),  # its leader receives for both
    ],
)
def test_each_node_receives_at_most_1_5x_its_share(trained4: Path, tmp_path: Path, nodes: list[int]) -> None:
    cps, res = _restore(trained4, tmp_path, nodes)
    # each rank's node's share of the state (its ranks' part) and what the node received
    share = [_data_bytes(tmp_path) * nodes.count(n) / len(nodes) for n in nodes]
    got = [r["restore"]["fetched_bytes"] if r["restore"] else None for r in res]
    print(f"\nnodes {nodes} (by rank): shares {[round(s) for s in share]} B; received {got}")
    for r, cp in zip(res, cps):
        assert r["step"] == 2 and r["restore"]["source"] == "memory", cp.stderr[-3000:]
        assert r["mine"] is True and r["tensors"] == 4  # every rank's own shards, as saved
    assert [r["own"] for r in res] == [[10 * r + 2] for r in range(len(nodes))]  # and its own entry
    assert all(g <= 1.5 * s for g, s in zip(got, share)), (got, share)
    assert sum(got) > 0  # some node lacked its part: the ranges came over
    for r in res:  # the node's report for the agent says the same
        assert r["report"]["received"] == r["restore"]["fetched_bytes"]
    if nodes == [0, 1, 2, 4]:  # the newcomer received its shard (the survivors: small replicated
        # entries, e.g. Adam's step counts, that DCP stored once, in a file they lack)
        assert max(got[:3]) < 0.1 * share[0] and got[3] > 0.9 * share[3], (got, share)
        assert 3 in res[3]["report"]["shards"]["peer"] and "self" not in res[3]["report"]["shards"]


@pytest.mark.parametrize(
    ("nodes", "tight"),
    [
        pytest.param([2, 3, 0, 1], 1, id="ranks-moved"),  # every node lacks its new rank's shard
        pytest.param([0, 1, 2, 4], 3, id="newcomer"),  # refused before its .metadata comes over
    ],
)
def test_a_restore_whose_bytes_do_not_fit_falls_back_before_any_receive(
    trained4: Path, tmp_path: Path, nodes: list[int], tight: int
) -> None:
    """The node of rank ``tight`` has no memory to spare (a fake MemAvailable): every rank goes to
    EFS before any node allocated a receive buffer, and the node's restore report (for the agent's
    ``snapshot_restored``) and rank 0's line say why."""
    env = {"TIGHT_RANK": str(tight), "SPY_TARGETS": "1"}
    step = Path("sharded") / "ckpt-0000000002.dcp"
    before = {n: sorted(os.listdir(trained4 / f"node{n}" / step)) for n in range(4)}
    cps, res = _restore(trained4, tmp_path, nodes, env)
    for r, cp in zip(res, cps):
        assert r["step"] == 2 and r["mine"] is True, cp.stderr[-3000:]  # from EFS, every rank's own
        assert r["restore"]["source"] == "efs", (r["restore"], cp.stderr[-3000:])
        assert (
            f"node of rank {tight}:" in r["restore"]["reason"] and "MiB to receive" in r["restore"]["reason"]
        )
        assert r["made"] == []  # no receive buffer on any node
    assert [r["own"] for r in res] == [[10 * r + 2] for r in range(4)]
    for n in nodes:  # nothing received into any node's memory
        d = tmp_path / f"node{n}" / step
        assert (sorted(os.listdir(d)) if d.exists() else None) == before.get(n), n
    rep = res[tight]["report"]  # the restore report of the node that said no
    assert rep["source"] == "efs" and rep["step"] == 2 and "do not fit in node memory" in rep["reason"], rep
    assert f"do not fit in node memory (node of rank {tight}:" in cps[0].stderr
    assert "going back to step 2 from" in cps[0].stderr


def test_merge_joins_overlapping_and_adjacent_ranges() -> None:
    from petctl_agent.checkpointing.ranges import merge

    assert merge([(10, 5), (0, 10), (30, 0), (40, 8), (44, 2), (20, 5)]) == [(0, 15), (20, 5), (40, 8)]


def test_assign_takes_each_node_its_missing_ranges_from_the_least_loaded_holder() -> None:
    from petctl_agent.checkpointing.ranges import assign, received_by

    # leaders 0, 2, 4; file A held by 0 and 2, B by 2; node 4 lacks both, node 0 lacks B
    wants = {4: {"A": [(0, 100), (100, 50)], "B": [(10, 20)]}, 0: {"B": [(0, 40)]}}
    moves = assign(wants, {"A": [0, 2], "B": [2]}, {"A": 200, "B": 60})
    assert moves == [("B", 2, 0, 60, [(0, 40)]), ("A", 0, 4, 200, [(0, 150)]), ("B", 2, 4, 60, [(10, 20)])]
    assert received_by(moves, 4) == 170 and received_by(moves, 0) == 40 and received_by(moves, 2) == 0
