"""Two timelines, one step number (issue 29, item 3): a memory snapshot is known by its epoch (the
worker generation that wrote it: checkpointing/timeline.py) and its step, not its step alone.

After a fallback to EFS the job trains again from an older step, so two nodes can hold "step N"
of two histories, and a node can hold a step of the abandoned history numbered higher than the
live one's. Each rank used to restore the newest *step* and, when its own node held it, load its
own copy: the replicas diverged with no error. Real torch processes over gloo on 127.0.0.1 and
real ``SnapshotStore``s in temp directories, as in test_memory_restore.py; the stores of the two
histories are made by rewriting their headers' epoch (what two generations' writes leave), and
EFS's ``latest`` likewise, so each test also runs against code that knows nothing of epochs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import test_memory_restore as tmr
import torch

from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import memory
from petctl_agent.checkpointing.files import LATEST
from petctl_agent.checkpointing.header import header_crc
from petctl_agent.checkpointing.snapshot import SnapshotStore


def _history(d: Path, step: int, salt: float, epoch: int, k: int = 4, n: int = 1 << 14) -> dict[str, float]:
    """Node ``d`` holds ``step`` of the history ``epoch`` (its values set by ``salt``); returns the
    per-tensor sums a rank restoring exactly that copy reports."""
    state = {"w": torch.full((4,), float(step) + salt)}
    state.update({f"x{i}": torch.full((n,), step * 100.0 + i + salt) for i in range(k)})
    s = SnapshotStore(d, memory.NAME)
    assert s.write(state, step, wait=True) == "ok"
    c = s.newest()
    s.close()
    h = dict(c.header, epoch=epoch)  # as that generation's write leaves it (its own CRC again)
    h["header_crc"] = header_crc(h)
    s.header_path(c.slot).write_text(json.dumps(h))
    return {key: float(v.double().sum()) for key, v in state.items()}


def _efs(efs: Path, step: int, epoch: int | None) -> None:
    """EFS's ``latest`` names ``step`` (its file readable), of history ``epoch`` (None: no epoch,
    as a pointer written before epochs)."""
    ckpt.save({"w": torch.full((4,), float(step))}, step, efs)
    p = json.loads((efs / LATEST).read_text())
    p.pop("epoch", None)
    if epoch is not None:
        p["epoch"] = epoch
    (efs / LATEST).write_text(json.dumps(p))


def _restore(tmp_path: Path, nodes: list[str], efs: Path, total: int) -> list[dict]:
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": str(total), "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    cps = tmr._ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / n)} for n in nodes])
    return [tmr._res(cp) for cp in cps]


def test_two_nodes_holding_one_step_of_two_histories_all_restore_the_newer_one(tmp_path: Path) -> None:
    """Node A holds step 6 of an older history, node B step 6 of a newer one (other values), node
    C nothing. Every rank restores B's copy, checked by value on each rank: A is no holder of the
    agreed snapshot (another epoch) and receives B's like the newcomer does. (Before: A loaded its
    own step 6 and B its own -- two replicas of one job, silently different -- and C got A's.)"""
    efs = tmp_path / "efs"
    _efs(efs, 4, epoch=None)
    old = _history(tmp_path / "A", 6, salt=0.25, epoch=1_000)
    new = _history(tmp_path / "B", 6, salt=0.5, epoch=2_000)
    assert old != new
    res = _restore(tmp_path, ["A", "B", "C"], efs, total=6)
    assert [r["sums"] for r in res] == [new, new, new], [r["sums"] for r in res]
    assert [r["start"] for r in res] == [7, 7, 7]
    assert [r["report"]["source"] for r in res] == ["peer", "self", "peer"], res
    # A kept the copy it received: its next restart restores the live history from itself
    a = SnapshotStore(tmp_path / "A", memory.NAME).newest()
    assert (a.epoch, a.step) == (2_000, 6)


def test_an_abandoned_history_never_comes_back_however_high_its_step(tmp_path: Path) -> None:
    """Node A holds step 8 of the abandoned history (its epoch older), node B step 6 of the live
    one. Both restore B's step 6 (before: step 8 was the newest step, B received A's abandoned
    state and the live history's steps 7-8 were lost to it). The generation that restores gets
    an epoch above every one it saw, a clock far ahead included (a hybrid logical clock): the
    `latest` it leaves names the live history."""
    efs = tmp_path / "efs"
    _efs(efs, 4, epoch=None)
    ahead = time.time_ns() + 10**15  # B's generation's clock ran 11 days ahead
    _history(tmp_path / "A", 8, salt=0.25, epoch=ahead - 10**12)
    live = _history(tmp_path / "B", 6, salt=0.5, epoch=ahead)
    res = _restore(tmp_path, ["A", "B"], efs, total=8)
    assert [r["sums"] for r in res] == [live, live], [r["sums"] for r in res]
    assert [r["start"] for r in res] == [7, 7]
    assert [r["report"]["source"] for r in res] == ["peer", "self"]
    latest = json.loads((efs / LATEST).read_text())
    assert latest["step"] == 8 and latest["epoch"] > ahead, latest


def test_efs_of_a_newer_history_wins_over_a_higher_step_in_memory(tmp_path: Path) -> None:
    """Both nodes hold step 6 of one history; EFS's `latest` names step 5 of a newer one (a later
    generation fell back to EFS and persisted there, while these stores kept their old snapshot).
    Every rank loads EFS's step 5 (before: memory's step 6, by its number alone)."""
    efs = tmp_path / "efs"
    _efs(efs, 5, epoch=3_000)
    _history(tmp_path / "A", 6, salt=0.5, epoch=2_000)
    _history(tmp_path / "B", 6, salt=0.5, epoch=2_000)
    res = _restore(tmp_path, ["A", "B"], efs, total=6)
    assert [r["start"] for r in res] == [6, 6]
    assert [r["sums"] for r in res] == [{"w": 20.0}, {"w": 20.0}]
    assert [r["report"]["source"] for r in res] == ["efs", "efs"]


def test_memory_of_a_newer_history_wins_over_a_higher_step_on_efs(tmp_path: Path) -> None:
    """Both nodes hold step 6 of the live history; EFS's `latest` names step 7 of an older one
    (an abandoned history's step that a persister put there). Every rank restores memory's step
    6 (before: EFS's step 7, by its number alone), and the live history's step 7, once trained,
    replaces the abandoned one's on EFS: the last step's wait for `latest` is not fooled by the
    abandoned step 7 already there."""
    efs = tmp_path / "efs"
    _efs(efs, 7, epoch=1_000)
    live = _history(tmp_path / "A", 6, salt=0.5, epoch=2_000)
    _history(tmp_path / "B", 6, salt=0.5, epoch=2_000)
    res = _restore(tmp_path, ["A", "B"], efs, total=7)
    assert [r["sums"] for r in res] == [live, live]
    assert [r["start"] for r in res] == [7, 7]
    assert [r["report"]["source"] for r in res] == ["self", "self"]
    assert [r["w"] for r in res] == [[7.5] * 4, [7.5] * 4]
    p = json.loads((efs / LATEST).read_text())
    assert p["step"] == 7 and p["epoch"] > 2_000, p
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 7 and torch.equal(state["w"], torch.full((4,), 7.5))
