"""The snapshot store's write path (checkpointing/writing.py, slots.py, budget.py): memory safety (review).

- the background spare thread and a write check the node's memory and allocate as one step, so
  together they never take more than ``MemAvailable`` less the reserve;
- spares no write took are freed when the store closes, when the state changes size, and with the
  agent's store;
- a forked child (a DataLoader worker: ``os.fork``, no exec) does not keep a restored file lent.

Real files, real ``posix_fallocate``, real forks; the node's ``MemAvailable`` is what a test wants
it to be (a meminfo callable that subtracts what the store's directory really holds).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from petctl_agent.checkpointing import budget, mapping
from petctl_agent.checkpointing.budget import RESERVE_MIN
from petctl_agent.checkpointing.snapshot import SnapshotStore

N = 1 << 20  # 4 MiB of fp32


def _held(d: Path) -> int:
    """Bytes the files under ``d`` hold (allocated blocks: on a tmpfs, RAM)."""
    return sum(p.lstat().st_blocks * 512 for p in d.rglob("*") if p.is_file())


def _node(d: Path, room: int):
    """A node with ``room`` bytes over the reserve besides what ``d`` holds now: its MemAvailable
    falls by every byte allocated under ``d`` from then on, as a tmpfs's does."""
    base = RESERVE_MIN + room + _held(d)
    return lambda: {"MemTotal": 4 << 30, "MemAvailable": base - _held(d)}


def test_a_spare_and_a_write_never_overshoot_the_reserve_together(tmp_path: Path, monkeypatch) -> None:
    """Review (2): the spare thread checked fits, then a write checked fits before the spare's
    pages were taken: both passed and the node went a whole state under its reserve (an OOM kill
    on a real node). Now the write counts the spare's allocation in flight: no room for both, so
    the write is a no-fit (EFS, today's path) and the node stays above its reserve; the next
    write to that slot takes the spare."""
    size = N * 4
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)  # slot a
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)  # slot b
    store.close()
    meminfo = _node(tmp_path, room=size * 3 // 2)  # one more state fits, not two
    store = SnapshotStore(tmp_path, "r", meminfo=meminfo)
    got = store.load(2)  # slot b lent: its next write needs a new file
    assert got is not None

    started, go = threading.Event(), threading.Event()
    real = mapping.fallocate

    def slow(fd: int, n: int) -> None:  # the spare thread's allocation, held before its pages go
        if threading.current_thread().name == "petctl-snapshot-spare":
            started.set()
            go.wait(30)
        real(fd, n)

    monkeypatch.setattr(mapping, "fallocate", slow)
    store.prepare_spares(size)
    assert started.wait(30)
    assert store.write({"w": torch.full((N,), 3.0)}, 3, wait=True) == "ok"  # slot a, in place
    why = store.write({"w": torch.full((N,), 4.0)}, 4, wait=True)  # slot b: lent, spare not ready
    assert why.startswith("no-fit"), why
    go.set()
    store._spares.join(30)
    avail = meminfo()["MemAvailable"]
    assert avail >= RESERVE_MIN, f"{(RESERVE_MIN - avail) >> 20} MiB under the reserve"
    ino = store.spare_path("b").stat().st_ino
    assert store.write({"w": torch.full((N,), 4.0)}, 4, wait=True) == "ok"  # takes the spare
    assert store.data_path("b").stat().st_ino == ino
    assert torch.equal(store.load(4)["w"], torch.full((N,), 4.0)) and bool((got["w"] == 2.0).all())
    assert meminfo()["MemAvailable"] >= RESERVE_MIN
    store.close()


def test_a_write_counts_what_the_spare_thread_has_yet_to_take_not_more(tmp_path: Path, monkeypatch) -> None:
    """The reservation shrinks as the spare's pages are taken (what its file holds is already out
    of MemAvailable): a write that fits beside a finished spare is never refused for it."""
    size = N * 4
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    store.close()
    store = SnapshotStore(tmp_path, "r", meminfo=_node(tmp_path, room=size * 5 // 2))  # room for two
    got = store.load(2)
    store.prepare_spares(size)
    store._spares.join(30)
    assert store.spare_path("b").exists()
    b = budget.of(tmp_path)
    with b.lock:
        assert b.pending() == 0 and not b.inflight  # nothing left in flight once it is made
    assert store.write({"w": torch.full((N,), 3.0)}, 3, wait=True) == "ok"
    del got


def test_unused_spares_are_freed_when_the_store_closes_or_the_state_changes_size(tmp_path: Path) -> None:
    """Review (2): a spare no write took stayed in /dev/shm until the next write to its slot (or
    for ever, when none came). Now close() frees the spares the store made (a worker's last
    checkpoint, close_persisters), and a write of another size frees both slots' stale ones
    (a restarted worker's store did not make them: the previous worker's)."""
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    store.close()
    store = SnapshotStore(tmp_path, "r")
    got = store.load(2)
    store.prepare_spares(N * 4)
    store._spares.join(30)
    assert store.spare_path("b").exists()
    store.close()
    assert not list(tmp_path.glob("*spare*")), "close() left an unused spare"
    assert torch.equal(got["w"], torch.full((N,), 2.0))  # the restored tensors are untouched

    # a spare left by a worker that died (not this store's), then the state changes size
    store = SnapshotStore(tmp_path, "r")
    store.prepare_spares(N * 4)  # slot a's file is due? no: b is not lent any more, nothing due
    store._spares.join(30)
    orphan = store.spare_path("a")
    fd = os.open(orphan, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, N * 4)
    os.close(fd)
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N // 2,), 3.0)}, 3, wait=True) == "ok"
    assert not orphan.exists(), "a spare of the old size outlived the write that changed the size"
    del got


def test_a_spare_half_made_when_the_store_closes_is_removed(tmp_path: Path, monkeypatch) -> None:
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    store.close()
    store = SnapshotStore(tmp_path, "r")
    got = store.load(2)
    started, go = threading.Event(), threading.Event()
    real = mapping.fallocate

    def slow(fd: int, n: int) -> None:
        started.set()
        go.wait(30)
        real(fd, n)

    monkeypatch.setattr(mapping, "fallocate", slow)
    store.prepare_spares(N * 4)
    assert started.wait(30)
    threading.Timer(0.2, go.set).start()
    store.close()  # waits for the allocation in flight, then frees it
    assert not [p.name for p in tmp_path.iterdir() if "spare" in p.name]
    del got


def test_the_agents_store_cleanup_frees_spares(tmp_path: Path) -> None:
    """The agent's end of the store (SnapshotArea.close: the node leaves, the job ends) removes
    the spares with the rest: nothing of the store stays in memory."""
    from petctl_agent.node.snapshots import SnapshotArea

    area = SnapshotArea(tmp_path / "job" / "i-1")
    area._make()  # the directory and its owner lock, no persister (not needed here)
    store = SnapshotStore(area.dir, "replicated")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    got = store.load(1)
    store.prepare_spares(N * 4)
    store._spares.join(30)
    assert list(area.dir.glob("*.spare"))
    area.close()
    assert not (tmp_path / "job").exists()
    del got


def _fork_child_holding(state: dict) -> tuple[int, int]:
    """Fork a child (no exec, as a DataLoader worker) that reads the restored tensors, reports
    their sum on a pipe and sleeps; (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.write(w, f"{float(state['w'].numpy().sum())}\n".encode())  # numpy: no OpenMP in a fork
            os.close(w)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
def test_a_forked_child_does_not_keep_a_restored_file_lent(tmp_path: Path) -> None:
    """Review (6): a child forked after a restore (DataLoader workers) inherited the fd that holds
    the restored file lent (a shared flock belongs to the open file description, which fork
    shares), so the slot stayed lent while the child lived and every later write to it made a new
    file (3x the state in /dev/shm). The child now closes its copies at fork; its mapping stays
    valid (it reads the restored values), and the parent's own lend is unaffected."""
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)  # slot a
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)  # slot b
    store.close()
    store = SnapshotStore(tmp_path, "r")
    got = store.load(2)  # slot b lent
    ino = store.data_path("b").stat().st_ino
    pid, r = _fork_child_holding(got)
    try:
        with os.fdopen(r) as f:
            assert float(f.readline()) == 2.0 * N  # the child reads the restored tensors
        # the parent still holds them: the slot is lent, a write to it makes a new file
        store.write({"w": torch.full((N,), 3.0)}, 3, wait=True)  # slot a
        store.write({"w": torch.full((N,), 4.0)}, 4, wait=True)  # slot b: lent by the parent
        assert store.data_path("b").stat().st_ino != ino
        assert bool((got["w"] == 2.0).all())

        got = store.load(4)  # lends the new b; fork again, then the parent drops its tensors
        ino = store.data_path("b").stat().st_ino
        pid2, r2 = _fork_child_holding(got)
        try:
            with os.fdopen(r2) as f:
                assert float(f.readline()) == 4.0 * N
            del got
            gc.collect()
            assert os.waitpid(pid2, os.WNOHANG) == (0, 0)  # the child lives on
            store.write({"w": torch.full((N,), 5.0)}, 5, wait=True)  # slot a
            store.write({"w": torch.full((N,), 6.0)}, 6, wait=True)  # slot b
            assert store.data_path("b").stat().st_ino == ino, "the forked child kept slot b lent"
            assert torch.equal(store.load(6)["w"], torch.full((N,), 6.0))
        finally:
            os.kill(pid2, signal.SIGKILL)
            os.waitpid(pid2, 0)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    store.close()


def test_a_worker_that_exits_for_good_frees_its_spares(tmp_path: Path) -> None:
    """Review (2): a worker that restored (spares made for its next writes) and then ends (the
    job's last step) left its spares in /dev/shm until the agent removed the store. A real process
    exits normally: its spares are gone, the snapshots stay."""
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    store.close()
    code = f"""
import torch
from petctl_agent.checkpointing.snapshot import SnapshotStore
store = SnapshotStore({str(tmp_path)!r}, "r")
got = store.load(2)
store.prepare_spares(store.newest().header["size"])
store._spares.join(30)
assert store.spare_path("b").exists()
print("spare made", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "spare made" in out.stdout, out.stderr
    assert not list(tmp_path.glob("*spare*")), "the exited worker left its spare"
    assert torch.equal(SnapshotStore(tmp_path, "r").load(2)["w"], torch.full((N,), 2.0))


def _rss_of(path: Path) -> int:
    """Bytes of ``path``'s mappings in this process that have page-table entries (smaps' Rss)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(str(path)) or line.rstrip().endswith(f"{path} (deleted)")
            elif inside and line.startswith("Rss:"):
                rss += int(head[1]) * 1024
    return rss


def test_the_second_checkpoint_finds_its_file_made_and_mapped_in_the_background(tmp_path: Path) -> None:
    """Periodic checkpoint cost: a job's second checkpoint wrote into a new slot b, allocating
    and mapping 1 GiB of fresh tmpfs pages while training waited (~0.9 s/GiB here). The first
    write now has b's file made and its page tables filled in the background, and the second
    write renames it into place and only copies (the mapping made in the background is the one
    it writes through)."""
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N,), 1.0)}, 1, wait=True) == "ok"  # slot a
    assert store._spares is not None
    store._spares.join(30)
    spare = store.spare_path("b")
    assert spare.exists() and spare.stat().st_blocks * 512 >= N * 4
    assert _rss_of(spare) >= N * 4  # populated: the copy takes no page fault
    ino = spare.stat().st_ino
    mm = store._spare_maps["b"][1]
    assert store.write({"w": torch.full((N,), 2.0)}, 2, wait=True) == "ok"  # slot b
    assert store.data_path("b").stat().st_ino == ino and not spare.exists()
    assert store._maps["b"][1] is mm
    assert store._spares is None or not store._spares.is_alive() or store._spares.join(30) is None
    assert not list(tmp_path.glob("*spare*"))  # both slots ready: nothing more made
    assert torch.equal(store.load(2)["w"], torch.full((N,), 2.0))
    assert torch.equal(store.load(1)["w"], torch.full((N,), 1.0))
    store.close()


def test_a_restarted_workers_slots_are_mapped_in_the_background(tmp_path: Path) -> None:
    """After a worker restart the slots' files are held but not mapped in the new process: the
    first write to each mapped it on training's time (MAP_POPULATE: 0.45-0.5 s/GiB here, holding
    the GIL). prepare_spares (ckpt.resume calls it) now maps the slot a write will reuse in place
    and fills its page tables in the background; the lent slot gets its spare, mapped too."""
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    store.close()
    store = SnapshotStore(tmp_path, "r")  # a restarted worker
    got = store.load(2)  # slot b lent
    store.prepare_spares(N * 4)
    store._spares.join(30)
    a = store.data_path("a")
    assert store._maps["a"][0] == a.stat().st_ino and _rss_of(a) >= N * 4
    assert "b" in store._spare_maps and _rss_of(store.spare_path("b")) >= N * 4
    mm_a = store._maps["a"][1]
    assert store.write({"w": torch.full((N,), 3.0)}, 3, wait=True) == "ok"  # slot a, in place
    assert store._maps["a"][1] is mm_a
    assert store.write({"w": torch.full((N,), 4.0)}, 4, wait=True) == "ok"  # slot b: the spare
    assert torch.equal(store.load(4)["w"], torch.full((N,), 4.0))
    assert torch.equal(store.load(3)["w"], torch.full((N,), 3.0))
    assert bool((got["w"] == 2.0).all())
    store.close()
    del got


def test_a_restore_makes_its_spares_after_the_first_step_not_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a membership change every node restores at once and each allocates a
    new file of the state's size (a lent slot's replacement; a newcomer's second slot). Made beside
    the first step, that kernel work stalled it, and with it every rank's first collective. Now
    ``ckpt.resume`` leaves the spares due and the first ``ckpt.step`` after it starts them: the
    next checkpoint still finds its file made."""
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.checkpointing import memory, memory_store

    sdir, cdir = tmp_path / "snap", tmp_path / "ckpt"
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(sdir))
    monkeypatch.setenv("PETCTL_PROGRESS_FILE", str(tmp_path / "progress.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        for s in (1, 2):  # slots a and b, each persisted to the checkpoint directory
            ckpt.step(s, lambda s=s: {"w": torch.full((N,), float(s))}, every=1, directory=cdir, last=True)
        memory.close_persisters()  # a restarted worker: a new store in a new process
        got = ckpt.resume(directory=cdir)
        assert got is not None and got[1] == 2 and bool((got[0]["w"] == 2.0).all())
        store = memory_store.store_of(sdir)
        time.sleep(0.2)
        assert store._spares is None and not list(sdir.glob("*.spare")), "spares made beside the first step"
        assert not ckpt.step(3, lambda: {}, every=0, directory=cdir)  # the first step: no checkpoint
        assert store._spares is not None
        store._spares.join(30)
        assert store.spare_path("b").exists()  # slot b is lent to the restored tensors: its new file
        ino = store.spare_path("b").stat().st_ino
        ckpt.step(4, lambda: {"w": torch.full((N,), 4.0)}, every=1, directory=cdir, last=True)  # slot a
        ckpt.step(5, lambda: {"w": torch.full((N,), 5.0)}, every=1, directory=cdir, last=True)  # b: the spare
        assert store.data_path("b").stat().st_ino == ino
        assert bool((got[0]["w"] == 2.0).all())
    finally:
        memory.close_persisters()
