"""The snapshot store and ``os.fork`` (checkpointing/mapping.py, slots.py; found in review).

A DataLoader worker is a child forked (no exec) from the training process at any moment, while
the store's threads (the persister's pin, the spare thread) hold locks and mappings. What the
child inherits must not outlive the parent's own hold:

- a pin (the persister's shared flock) or the spare thread's brief exclusive flock: the slot is
  usable again as soon as the parent lets go, while the child lives;
- the store's own mappings: a file the parent unlinks keeps no pages in the child;
- the parent's spares: a child's exit never frees them.

And two races of the spare thread with the writer: a spare the writer took while it was being
mapped is not kept as a spare; a spare gone before the writer's rename is reserved as a whole file.

Real files, real flocks, real forks (the children sleep, then ``os._exit``).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from petctl_agent import filelocks
from petctl_agent.checkpointing import mapping
from petctl_agent.checkpointing.budget import RESERVE_MIN
from petctl_agent.checkpointing.snapshot import SnapshotStore

N = 1 << 20  # 4 MiB of fp32

pytestmark = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")


def _fork_sleeper() -> int:
    """Fork a child that only sleeps (a DataLoader worker between batches); its pid, once the
    child runs (its at-fork handlers are done: they run before ``os.fork`` returns in it)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.write(w, b"x")
            os.close(w)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready and os.read(r, 1) == b"x", "the forked child never ran"
    finally:
        os.close(r)
    return pid


def _reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _two_slots(d: Path) -> SnapshotStore:
    store = SnapshotStore(d, "r")
    store.write({"w": torch.full((N,), 1.0)}, 1, wait=True)  # slot a
    store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)  # slot b
    return store


def test_a_pin_held_at_a_fork_goes_when_the_persister_lets_go(tmp_path: Path) -> None:
    """Finding 2a: the persister pinned the older slot; a DataLoader worker forked meanwhile kept
    the pin for its life. Once the persister then pinned the other slot, a write blocked on the
    slot the child pinned: training waited for a child that ends only when training moves on."""
    store = _two_slots(tmp_path)
    old, new = sorted(store.complete(), key=lambda c: c.step)
    pin = store.pin(old)  # the persister writes step 1 to EFS
    assert pin is not None
    pid = _fork_sleeper()
    done: list[str] = []
    writer = threading.Thread(
        target=lambda: done.append(store.write({"w": torch.full((N,), 3.0)}, 3, wait=True))
    )
    try:
        os.close(pin)  # that persist ended
        pin2 = store.pin(new)  # the next persist: the newest slot
        assert pin2 is not None
        try:
            writer.start()
            writer.join(20)
            assert done == ["ok"], "the write blocked on the slot the forked child kept pinned"
            assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # the child lives on
            assert {c.step for c in store.complete()} == {2, 3}  # step 3 went into the older slot
        finally:
            os.close(pin2)
    finally:
        _reap(pid)
        writer.join(30)
    assert torch.equal(store.load(3)["w"], torch.full((N,), 3.0))
    store.close()


def test_a_fork_during_the_spare_threads_lock_leaves_the_slot_unlent(tmp_path: Path, monkeypatch) -> None:
    """Finding 2b: the spare thread checks a slot is not lent with a brief exclusive flock; a
    fork in that window (another thread's: a DataLoader starting its workers) left the child
    holding it, so the slot read as lent for the child's life and every write to it made a new
    file. The window is widened here (the real lock, held 0.3 s) and a thread forks inside it."""
    store = _two_slots(tmp_path)
    store.close()
    store = SnapshotStore(tmp_path, "r")  # a restarted worker: slot a is mapped in the background
    data = store.data_path("a")
    ino = data.stat().st_ino
    real = filelocks.try_hold
    pids: list[int] = []
    forked = threading.Event()

    def fork_now() -> None:
        pids.append(_fork_sleeper())
        forked.set()

    def try_hold(path, create=True):
        fd = real(path, create)
        if fd is not None and Path(path) == data and not pids and not forked.is_set():
            threading.Thread(target=fork_now).start()
            time.sleep(0.3)  # the thread forks while this lock is held (or waits until it is recorded)
        return fd

    monkeypatch.setattr(filelocks, "try_hold", try_hold)
    store.prepare_spares(N * 4)
    store._spares.join(30)
    assert forked.wait(30) and pids
    monkeypatch.setattr(filelocks, "try_hold", real)
    try:
        assert os.waitpid(pids[0], os.WNOHANG) == (0, 0)  # the child lives on
        # nothing holds the lock once this process's own background threads let it go (a busy
        # machine can leave one of them between its brief check and its release for a while); the
        # child may hold a plain fd of the file (forked while the spare thread had it open to map
        # it), which takes no lock: only its copy of the lock's fd would
        deadline = time.monotonic() + 10
        while (probe := real(data, create=False)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe is not None, "slot a's lock is still held"
        os.close(probe)
        assert store.write({"w": torch.full((N,), 3.0)}, 3, wait=True) == "ok"  # slot a, in place
        assert data.stat().st_ino == ino
    finally:
        _reap(pids[0])
    assert torch.equal(store.load(3)["w"], torch.full((N,), 3.0))
    store.close()


def _child_holds(pid: int, path: Path) -> list[str]:
    """What of ``path`` the process ``pid`` has: mappings (smaps) and open fds."""
    out = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if str(path) in line:
                out.append(line.strip())
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if str(path) in target:
            out.append(f"fd {fd} -> {target}")
    return out


def test_a_forked_child_keeps_no_pages_of_the_stores_files(tmp_path: Path) -> None:
    """Finding 3: a child inherited the store's mappings of its slots and spares (and the fds
    Python's mmap keeps): a spare the parent freed kept a whole state's pages in /dev/shm for the
    child's life. The store's own mappings are not in the child (MADV_DONTFORK), nor their fds."""
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N,), 1.0)}, 1, wait=True) == "ok"  # slot a; spare b
    store._spares.join(30)
    spare = store.spare_path("b")
    assert "b" in store._spare_maps and spare.exists()
    pid = _fork_sleeper()  # returns once the child ran its at-fork handler
    try:
        assert _child_holds(pid, spare) == []
        assert _child_holds(pid, store.data_path("a")) == []
        store.close()  # frees the spare: its pages go back to the node at once
        assert not spare.exists()
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
        assert _child_holds(pid, spare) == []
    finally:
        _reap(pid)


def test_a_spare_the_writer_took_while_it_was_mapped_is_not_kept(tmp_path: Path, monkeypatch) -> None:
    """Finding 4: the spare thread stored its mapping of a spare after filling its page tables
    without checking the spare was still there: the writer had taken it meanwhile, the mapping
    stayed (reported "ready"). The spare thread here is held inside the page-table fill while a
    write takes the spare."""
    go = threading.Event()
    filling = threading.Event()
    real = mapping.populate

    def populate(mm):
        if threading.current_thread().name == "petctl-snapshot-spare":
            filling.set()
            go.wait(30)
        real(mm)

    monkeypatch.setattr(mapping, "populate", populate)
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N,), 1.0)}, 1, wait=True) == "ok"  # slot a; spare b started
    assert filling.wait(30)
    ino = store.spare_path("b").stat().st_ino
    assert store.write({"w": torch.full((N,), 2.0)}, 2, wait=True) == "ok"  # slot b: takes the spare
    assert store.data_path("b").stat().st_ino == ino
    go.set()
    store._spares.join(30)
    assert "b" not in store._spare_maps, "the spare thread kept a mapping of a spare the writer took"
    assert torch.equal(store.load(2)["w"], torch.full((N,), 2.0))
    store.close()


def test_a_spare_gone_before_its_rename_is_reserved_as_a_whole_file(tmp_path: Path, monkeypatch) -> None:
    """Finding 5: the writer reserved only what the spare did not hold (nothing), then the spare
    was gone at the rename (removed meanwhile) and it allocated a whole state's file outside the
    budget. Now it reserves the whole size again: on a node without that room, no-fit."""
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N,), 1.0)}, 1, wait=True) == "ok"  # slot a; spare b
    store._spares.join(30)
    assert store._spare_of("b", N * 4) == N * 4
    real = store._spare_of

    def spare_of(slot, size):
        got = real(slot, size)
        store.spare_path(slot).unlink()  # removed right after the writer saw it (the store's cleanup)
        return got

    monkeypatch.setattr(store, "_spare_of", spare_of)
    # the node has room for the copy only: not for a new state-sized file
    store.meminfo = lambda: {"MemTotal": 4 << 30, "MemAvailable": RESERVE_MIN + N}
    why = store.write({"w": torch.full((N,), 2.0)}, 2, wait=True)
    assert why.startswith("no-fit"), why
    b = store.data_path("b")
    assert not b.exists() or b.stat().st_blocks * 512 < N * 4, "a whole file allocated outside the budget"
    assert torch.equal(store.load(1)["w"], torch.full((N,), 1.0))  # the newest complete stays
    store.close()


def test_a_forked_child_that_exits_leaves_the_parents_spares(tmp_path: Path) -> None:
    """Finding 9: a forked child that exits normally (sys.exit: atexit runs) freed the parent's
    spares (the store was in the child's copy of the at-exit list)."""
    code = f"""
import os, sys
import torch
from petctl_agent.checkpointing.snapshot import SnapshotStore
store = SnapshotStore({str(tmp_path)!r}, "r")
store.write({{"w": torch.full(({N},), 1.0)}}, 1, wait=True)
store._spares.join(30)
assert store.spare_path("b").exists()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit of the child: its atexit handlers run
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
print("spare after the child's exit:", store.spare_path("b").exists(), flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "spare after the child's exit: True" in out.stdout, out.stdout + out.stderr


def test_a_child_forked_below_python_maps_none_of_the_stores_files(tmp_path: Path) -> None:
    """Finding 3, the kernel's part: a fork that runs no Python at-fork handler (a C library's
    own fork, e.g. libc's called from an extension) leaves the store's mappings out of the child
    too (MADV_DONTFORK), so a spare the parent frees keeps no pages there."""
    import ctypes

    store = SnapshotStore(tmp_path, "r")
    assert store.write({"w": torch.full((N,), 1.0)}, 1, wait=True) == "ok"  # slot a; spare b
    store._spares.join(30)
    spare = store.spare_path("b")
    assert "b" in store._spare_maps
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.fork()
    if pid == 0:  # the child: libc only, then _exit (never returns into Python's state)
        libc.sleep(60)
        libc._exit(0)
    assert pid > 0
    try:
        time.sleep(0.2)
        assert not [line for line in _child_holds(pid, spare) if not line.startswith("fd ")]
        assert not [line for line in _child_holds(pid, store.data_path("a")) if not line.startswith("fd ")]
    finally:
        _reap(pid)
    store.close()
