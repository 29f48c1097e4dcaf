"""Two timelines, one step number, on the sharded memory path (issue 29, item 3;
checkpointing/sharded_memory.py, checkpointing/timeline.py).

A node's step directory is known by its markers' epoch (the worker generation that saved it) and
save id, not its step number alone. The plan used to take the newest step *number* any nodes'
memories covered, and among two save ids of one step the first in the ids' sort order: an
abandoned history's higher step came back, and of two histories' "step 4" a random one won. Real
FSDP2 ranks on gloo, as in test_sharded_memory.py (its trained job and harness); the two
histories are made by rewriting the markers' epoch, step and save id (what two generations'
saves leave), so each test also runs against code that knows nothing of epochs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_sharded_memory import _result, _run, _scenario
from test_sharded_memory import trained as trained  # the trained job: a fixture, shared

pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")

#: every rank restores, then compares the whole model (all-gathered: every rank holds it) with the
#: trained job's reference after each step it saved
RESTORE_EVERY_RANK = """
st = state()
got = ckpt.resume(st)
out["step"] = None if got is None else got[1]
if got is not None:
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    m, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for s in (2, 4):
        ref = torch.load(os.path.join(REF, f"ref-{s}.pt"), weights_only=True)["model"]
        out[f"model_is_{s}"] = same(m, ref)
out["restore"] = sharded_memory.last_restore
"""


def _mark(stepdir: Path, **fields: object) -> None:
    """Rewrite the markers of ``stepdir`` (their step, epoch, save id) as another save leaves them."""
    for p in stepdir.glob("petctl-rank-*.json"):
        m = json.loads(p.read_text())
        m.update(fields)
        p.write_text(json.dumps(m))


def _pointer(efs: Path, **fields: object) -> None:
    p = json.loads((efs / "latest").read_text())
    p.update(fields)
    (efs / "latest").write_text(json.dumps(p))


def test_an_abandoned_sharded_history_never_comes_back_however_high_its_step(
    trained: Path, tmp_path: Path
) -> None:
    """Node 0's memory holds step 4 of the abandoned history; node 1's holds step 2 of the live
    one (a later generation's, after a fallback to EFS's step 2); each covers its step alone.
    Every rank restores step 2 from memory, checked by value on each rank (before: step 4, the
    higher number, and node 1 fetched the abandoned shards)."""
    t = _scenario(trained, tmp_path)
    mem = "sharded/ckpt-0000000002.dcp", "sharded/ckpt-0000000004.dcp"
    shutil.rmtree(t / "node0" / mem[0])
    shutil.rmtree(t / "node1" / mem[1])
    _mark(t / "node0" / mem[1], epoch=1_000)
    _mark(t / "node1" / mem[0], epoch=2_000)
    shutil.rmtree(t / "efs")
    (t / "efs.at2").rename(t / "efs")
    _pointer(t / "efs", epoch=2_000)  # EFS's step 2 is the live history's
    r0, r1 = (_result(cp) for cp in _run(t, RESTORE_EVERY_RANK, [0, 1]))
    assert r0["step"] == r1["step"] == 2, (r0, r1)
    assert r0["model_is_2"] is r1["model_is_2"] is True
    assert r0["restore"]["source"] == r1["restore"]["source"] == "memory"
    assert r0["restore"]["fetched_bytes"] > 0 and r1["restore"]["fetched_bytes"] == 0


def test_two_sharded_histories_of_one_step_all_restore_the_newer_one(trained: Path, tmp_path: Path) -> None:
    """Node 0's memory holds "step 4" of an older history (save id 000...), node 1's "step 4" of
    a newer one (other values: the trained step 2's state; save id fff...); each covers its own.
    Every rank restores the newer history's, checked by value on each rank (before: the save id
    first in sort order, here the older history's)."""
    t = _scenario(trained, tmp_path)
    mem = "sharded/ckpt-0000000002.dcp", "sharded/ckpt-0000000004.dcp"
    shutil.rmtree(t / "node0" / mem[0])
    shutil.rmtree(t / "node1" / mem[1])
    (t / "node1" / mem[0]).rename(t / "node1" / mem[1])
    _mark(t / "node0" / mem[1], epoch=1_000, id="0" * 32)
    _mark(t / "node1" / mem[1], epoch=2_000, id="f" * 32, step=4)
    shutil.rmtree(t / "efs")
    r0, r1 = (_result(cp) for cp in _run(t, RESTORE_EVERY_RANK, [0, 1]))
    assert r0["step"] == r1["step"] == 4, (r0, r1)
    assert r0["model_is_2"] is r1["model_is_2"] is True, (r0, r1)
    assert r0["restore"]["source"] == r1["restore"]["source"] == "memory"
    assert r0["restore"]["fetched_bytes"] > 0 and r1["restore"]["fetched_bytes"] == 0
