"""A snapshot is known by (epoch, step), in one process (issue 29, item 3; checkpointing/timeline.py):
the store's load, the persister's order of `latest`, the agent's fetch, a restore of one rank.
The restores of several ranks are in test_memory_restore_timelines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import fetch, memory, persisting, timeline
from petctl_agent.checkpointing.files import LATEST, read_pointer, write_file, write_pointer
from petctl_agent.checkpointing.snapshot import SnapshotStore


@pytest.fixture(autouse=True)
def _fresh_generation():
    timeline.reset()
    yield
    timeline.reset()


def test_the_order_is_epoch_then_step_and_no_epoch_is_epoch_0() -> None:
    assert timeline.key(None) == timeline.NONE == (0, -1)
    assert timeline.key({"step": 7}) == (0, 7)  # a pointer or header from before epochs
    assert timeline.key({"step": 7, "epoch": 5}) == (5, 7)
    for bad in (-1, "5", 1.5, True, None):
        assert timeline.key({"step": 7, "epoch": bad}) == (0, 7), bad
    assert timeline.key({"step": 3, "epoch": 6}) > timeline.key({"step": 9, "epoch": 5})
    # a generation's epoch: the clock, raised above every epoch seen (a hybrid logical clock)
    assert timeline.begin(seen=10, clock=5) == 11 and timeline.current() == 11
    assert timeline.begin(seen=10, clock=50) == 50


def test_a_load_of_a_step_takes_only_the_copy_of_the_history_asked_for(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path, memory.NAME)
    assert s.write({"w": torch.full((3,), 1.0)}, 6, wait=True, epoch=10) == "ok"
    assert s.write({"w": torch.full((3,), 2.0)}, 6, wait=True, epoch=20) == "ok"
    assert sorted(c.key for c in s.complete()) == [(10, 6), (20, 6)]
    assert torch.equal(s.load(6, epoch=10)["w"], torch.full((3,), 1.0))
    assert torch.equal(s.load(6, epoch=20)["w"], torch.full((3,), 2.0))
    assert s.load(6, epoch=30) is None
    s.close()


def test_latest_moves_only_to_a_newer_history_or_a_newer_step_of_its_own(tmp_path: Path) -> None:
    """The persister never puts an abandoned history's step over the live one's `latest`, however
    high its number, and does put the live one's over an abandoned one's, even at a lower step."""
    efs = tmp_path / "efs"
    s = SnapshotStore(tmp_path / "shm", memory.NAME)
    assert s.write({"w": torch.full((3,), 9.0)}, 9, wait=True, epoch=10) == "ok"  # abandoned
    efs.mkdir()
    write_pointer(efs, {"file": "x", "step": 5, "epoch": 20})
    assert persisting.persist_newest(s, efs) is None
    assert read_pointer(efs)["step"] == 5
    assert s.write({"w": torch.full((3,), 3.0)}, 3, wait=True, epoch=30) == "ok"  # a later generation's
    write_pointer(efs, {"file": "x", "step": 9, "epoch": 10})  # an abandoned step that got there
    assert persisting.persist_newest(s, efs) == 3
    p = read_pointer(efs)
    assert (p["step"], p["epoch"]) == (3, 30)
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    raw = torch.load(efs / p["file"], weights_only=True)
    assert raw["epoch"] == 30  # the file says which history it is of too
    s.close()


def test_a_forward_only_write_is_ordered_by_epoch_too(tmp_path: Path) -> None:
    efs = tmp_path / "efs"
    efs.mkdir()
    write_pointer(efs, {"file": "x", "step": 9, "epoch": 10})
    write_file({"w": torch.ones(2)}, 6, efs, 3, forward_only=True, epoch=20)  # newer history: written
    assert timeline.key(read_pointer(efs)) == (20, 6)
    write_file({"w": torch.ones(2)}, 8, efs, 3, forward_only=True, epoch=10)  # older history: not
    assert timeline.key(read_pointer(efs)) == (20, 6)


def test_a_pointer_gets_this_generations_epoch_once_agreed(tmp_path: Path) -> None:
    write_pointer(tmp_path, {"file": "x", "step": 1})
    assert "epoch" not in json.loads((tmp_path / LATEST).read_text())  # none agreed yet
    timeline.begin(0, 1234)
    write_pointer(tmp_path, {"file": "x", "step": 2})
    assert json.loads((tmp_path / LATEST).read_text())["epoch"] == 1234
    write_pointer(tmp_path, {"file": "x", "step": 3, "epoch": 77})  # a persisted snapshot's own
    assert json.loads((tmp_path / LATEST).read_text())["epoch"] == 77


def test_the_agents_fetch_takes_the_newest_history_not_the_highest_step() -> None:
    def h(step: int, epoch: int, crc: int) -> dict:
        return {
            "step": step,
            "epoch": epoch,
            "size": 64,
            "tensors": [{"offset": 0, "nbytes": 4, "crc32c": crc}],
        }

    a, b, c = ("a", 1, ""), ("b", 2, ""), ("c", 3, "")
    picked = fetch.choose([(a, h(9, 10, 1)), (b, h(6, 20, 2)), (c, h(6, 20, 2))])
    assert picked is not None
    header, holders = picked
    assert (header["epoch"], header["step"]) == (20, 6) and holders == [b, c]


def test_one_ranks_restore_takes_efs_when_its_history_is_newer(tmp_path: Path, monkeypatch) -> None:
    """Without a process group: the node's step 6 is of an older history than EFS's step 5."""
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PETCTL_DRAIN_FILE", "PETCTL_PROGRESS_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(shm))
    s = SnapshotStore(shm, memory.NAME)
    assert s.write({"w": torch.full((3,), 6.0)}, 6, wait=True, epoch=10) == "ok"
    s.close()
    write_file({"w": torch.full((3,), 5.0)}, 5, efs, 3, epoch=20)
    try:
        state, step = ckpt.resume(directory=efs)
        assert step == 5 and torch.equal(state["w"], torch.full((3,), 5.0))
        assert timeline.current() > 20  # the restoring generation's epoch: above every one it saw
        write_file({"w": torch.full((3,), 6.0)}, 6, efs, 3, epoch=5)  # an older history's step 6
        timeline.reset()
        state, step = ckpt.resume(directory=efs)
        assert step == 6 and torch.equal(state["w"], torch.full((3,), 6.0))  # memory: (10, 6) > (5, 6)
    finally:
        memory.close_persisters()
