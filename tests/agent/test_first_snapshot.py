"""A start that restored nothing from memory makes its store's first file after its first step, so its
first snapshot (a periodic one, or with ``every=0`` a drain's or join's stop) does not allocate it
while every rank waits (``checkpointing/first_snapshot.py``). Single process, no agent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import first_snapshot, memory
from petctl_agent.checkpointing.memory_store import store_of

N = 1 << 18  # 1 MiB of fp32


def _state() -> dict:
    return {"w": torch.full((N,), 1.0), "b": torch.ones(3), "meta": {"lr": 0.1}}


@pytest.fixture
def store_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sdir = tmp_path / "shm" / "node"
    sdir.mkdir(parents=True)
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(sdir))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("PETCTL_PROGRESS_FILE", str(tmp_path / "progress"))
    yield sdir
    memory.close_persisters()


def _spares(sdir: Path) -> dict[str, int]:
    store = store_of(sdir)
    if store._spares is not None:
        store._spares.join(30)
    return {p.name: p.stat().st_ino for p in sdir.rglob("*spare*") if p.is_file()}


def test_the_first_step_after_nothing_from_memory_makes_the_file_the_first_write_takes(
    store_dir: Path,
) -> None:
    calls = []

    def state_fn() -> dict:
        calls.append(1)
        return _state()

    first_snapshot.after_step(state_fn)  # not armed: a step alone never calls state_fn
    assert calls == [] and _spares(store_dir) == {}
    first_snapshot.arm()
    first_snapshot.after_step(state_fn)
    spares = _spares(store_dir)
    assert calls == [1] and len(spares) == 1, f"not one file made for the first snapshot: {spares}"
    store = store_of(store_dir)
    size = N * 4 + 64  # each tensor at a 64-byte boundary
    assert [p.stat().st_size for p in store_dir.rglob("*spare*") if p.is_file()] == [size]
    assert store.write(_state(), 1, wait=True) == "ok"
    taken = {store.data_path(s).stat().st_ino for s in ("a", "b") if store.data_path(s).exists()}
    assert taken & set(spares.values()), "the first write allocated its own file"
    first_snapshot.after_step(state_fn)  # once per start
    assert calls == [1]


def test_ckpt_step_arms_on_an_empty_resume_and_a_save_disarms(store_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    assert ckpt.resume(directory=d) is None  # nothing in memory, nothing on EFS
    calls = []

    def state_fn() -> dict:
        calls.append(1)
        return _state()

    assert ckpt.step(1, state_fn, every=0, directory=d) is False  # snapshots only at changes
    assert calls == [1] and _spares(store_dir)
    ckpt.step(2, state_fn, every=0, directory=d)
    assert calls == [1]  # once

    first_snapshot.arm()
    assert ckpt.step(3, state_fn, every=3, directory=d) is True  # the save made the file itself
    assert calls == [1, 1]  # the save's own call, and no second one for the files


def test_no_file_without_snapshots_or_for_state_the_store_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PETCTL_SNAPSHOT_DIR", raising=False)
    first_snapshot.arm()
    calls = []
    first_snapshot.after_step(lambda: calls.append(1) or _state())
    assert calls == [1]  # every rank converts it, as a save would (its collectives match)
    assert not list(tmp_path.rglob("*spare*"))
