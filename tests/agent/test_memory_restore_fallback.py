"""The EFS fallback of a restore from memory loads the step memory held, not an older one (review
of issue 20): after a drain of the rank-0 node, the drained step may be only in a staying node's
memory (the drain did not wait for EFS); if the restore from memory then fails on every rank, the
holder persists the step first. Real torch processes over gloo, as in test_memory_restore.py."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_memory_restore as tmr
import torch
from test_memory_restore import Pub

from petctl_agent import checkpoint as ckpt
from petctl_agent import filelocks
from petctl_agent.checkpointing import memory, memory_keep, memory_store, persist
from petctl_agent.node import snapshots
from petctl_agent.node.snapshots import SnapshotArea

#: the receiving ranks see one byte of the snapshot's data flipped in transit (after the header):
#: their CRC check fails, so the restore from memory fails on every rank (the group agrees)
CORRUPT = """
import torch, torch.distributed as dist
_real, _seen = dist.broadcast, [0]
class _Done:
    def wait(self):
        return True
def _corrupting(t, src, group=None, async_op=False, **kw):
    out = _real(t, src, group=group, **kw)  # waited for: a flip before the bytes land is lost
    if dist.get_rank() != src and t.dtype == torch.uint8:
        _seen[0] += 1
        if _seen[0] == 2 and t.numel():  # 1: the header; 2: the first chunk of the data
            t[0] ^= 0xFF
    return _Done() if async_op else out
dist.broadcast = _corrupting
"""


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sdirs: list[Path], efs: Path) -> list[dict]:
    monkeypatch.setattr(tmr, "RESTORE", CORRUPT + tmr.RESTORE)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "8"}
    return [
        tmr._res(cp) for cp in tmr._ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(d)} for d in sdirs])
    ]


def test_a_failed_restore_after_a_drain_falls_back_to_the_drained_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EFS holds step 4; the drained step 6 is only in node 0's memory (the node that stayed; no
    agent persister here). Node 1 (a newcomer) needs it from node 0, and the transfer arrives
    corrupt: every rank falls back to EFS, which now holds step 6: both resume at 7 (before: at 5,
    two steps lost on a drain)."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    tmr._snap(tmp_path / "n0", 6)
    res = _run(tmp_path, monkeypatch, [tmp_path / "n0", tmp_path / "n1"], efs)
    assert [r["report"]["source"] for r in res] == ["efs", "efs"], res
    assert [r["report"]["step"] for r in res] == [6, 6], res
    assert [r["start"] for r in res] == [7, 7], res
    assert all(r["w"] == [8.0] * 4 for r in res)
    assert ckpt.latest_step(efs) == 8


@pytest.fixture
def shm() -> Iterator[Path]:
    """A store base on /dev/shm (a tmpfs, as the agent needs), removed after."""
    base = Path("/dev/shm") / f"petctl-test-{os.getpid()}-{time.monotonic_ns()}"
    if snapshots.fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_the_holders_agent_persister_writes_it(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the agent's side: node 0's store is a real ``SnapshotArea`` whose persister
    process serves it (what a staying node has). The holder asks its persister; the step it wrote
    is what every rank loads."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    area = SnapshotArea.open(shm, "j", "i-f0", Pub())
    assert area is not None
    try:
        _until_served(area.dir)
        tmr._snap(area.dir, 6)
        res = _run(tmp_path, monkeypatch, [area.dir, tmp_path / "n1"], efs)
        assert [r["report"]["step"] for r in res] == [6, 6], res
        assert [r["start"] for r in res] == [7, 7], res
        assert persist.state(area.dir).get("step", 0) >= 6  # its persister wrote step 6 (then 8)
    finally:
        area.close()


def _until_served(sdir: Path) -> None:
    deadline = time.monotonic() + 10
    while not persist.served(sdir):
        assert time.monotonic() < deadline, "the persister never took its lock"
        time.sleep(0.05)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of this process alone (rank 0 of 1) on 127.0.0.1, destroyed after."""
    import sys

    import torch.distributed as dist

    sys.path.insert(0, str(tmr.REPO / "bench"))
    from harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        memory.close_persisters()


def test_a_holder_whose_store_lacks_the_step_says_so_at_once(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """``_persist_before_efs`` asked of a rank whose store lacks the step (it holds step 5 only)
    while a persister serves that store: the persister would ignore the request (it persists only
    a step its store holds), so waiting for it would keep every rank in the barrier for the whole
    PETCTL_CHECKPOINT_TIMEOUT. It returns at once, EFS untouched."""
    monkeypatch.setenv("PETCTL_CHECKPOINT_TIMEOUT", "30")
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    sdir = tmp_path / "n0"
    tmr._snap(sdir, 5)
    lock = filelocks.hold(sdir / persist.LOCK)  # a persister that serves the store (and ignores it)
    try:
        assert persist.served(sdir)
        t0 = time.monotonic()
        memory_keep.persist_before_efs(memory_store.store_of(sdir), (0, 6), efs, 0)  # (epoch, step): _snap's
        assert time.monotonic() - t0 < 5
    finally:
        os.close(lock)
    assert ckpt.latest_step(efs) == 4
    assert "no longer holds it complete" in capfd.readouterr().err


def test_a_holders_wait_for_a_stuck_persister_is_capped_below_the_others_timeout(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder holds step 6; its store's persister never answers. It waits at most T/2 for
    it (T: PETCTL_CHECKPOINT_TIMEOUT, here 8 s), then writes the step itself: well inside the
    others' barrier (2T + 60 s), which it must never outlast (before: it waited the whole T first,
    then wrote, while the barrier allowed only T + 60 s). T is 8 s, not less, so that the write
    after the wait has T/2 = 4 s on a loaded box (an fsync can take a second there) and still
    ends before the whole T."""
    monkeypatch.setenv("PETCTL_CHECKPOINT_TIMEOUT", "8")
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    sdir = tmp_path / "n0"
    tmr._snap(sdir, 6)
    lock = filelocks.hold(sdir / persist.LOCK)
    try:
        t0 = time.monotonic()
        memory_keep.persist_before_efs(memory_store.store_of(sdir), (0, 6), efs, 0)  # (epoch, step): _snap's
        took = time.monotonic() - t0
    finally:
        os.close(lock)
    assert ckpt.latest_step(efs) == 6
    assert 4 <= took < 8, took  # T/2, then the write: not the whole T
    assert memory_keep.efs_wait_timeout() == 2 * 8 + 60
