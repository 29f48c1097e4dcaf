"""Memory snapshots (checkpointing/snapshot.py) and their background persistence (persist.py).

Real files in a tmp dir stand in for the agent's ``/dev/shm/petctl/<job>``; writers that are
killed are real processes killed with SIGKILL; the persisted checkpoint is read by today's loader.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing.budget import fits, read_meminfo
from petctl_agent.checkpointing.files import load_file, read_pointer
from petctl_agent.checkpointing.persisting import Persister, _persist, persist_newest
from petctl_agent.checkpointing.snapshot import SnapshotStore
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(5, 4)).sum().backward()
    o.step()
    return m, o


def _mixed_state() -> dict:
    m, o = _model_and_opt()
    return {
        "model": m.state_dict(),
        "optim": o.state_dict(),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "fp16": torch.tensor([1.5, -2.25], dtype=torch.float16),
        "i64": torch.tensor([[2**40, -7]]),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "nums": [1, 2.5, float("inf"), None, "s", (1, "t")],
        "dtype": torch.float16,
        3: "int key",
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def test_round_trip_several_dtypes_and_optimizer_state(tmp_path: Path) -> None:
    state = _mixed_state()
    store = SnapshotStore(tmp_path, "rank-0")
    assert store.write(state, 7, world_size=2, rank=0) == "ok"
    store.flush()
    got = store.load(7, world_size=2, rank=0)
    assert got is not None and _same(state, got)
    assert type(got["model"]) is OrderedDict and got["model"]._metadata == state["model"]._metadata
    # loads into fresh objects as a torch.load'ed state would
    m, o = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)), None
    m.load_state_dict(got["model"])
    o = torch.optim.AdamW(m.parameters())
    o.load_state_dict(got["optim"])
    # a copy, not a view of the slot: changing it leaves the snapshot as it was
    got["bf16"].fill_(0)
    assert _same(state["bf16"], store.load(7)["bf16"])
    # wrong world size / rank: not this rank's snapshot
    assert store.load(7, world_size=3) is None and store.load(7, rank=1) is None


def test_two_slots_newest_and_previous_step(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "r")
    for s in (1, 2, 3):
        assert store.write({"w": torch.full((8,), float(s))}, s, wait=True) == "ok"
    assert [c.step for c in store.complete()] == [3, 2]
    assert store.load(1) is None  # overwritten by 3
    assert torch.equal(store.load(2)["w"], torch.full((8,), 2.0))
    assert store.newest().step == 3


def test_stale_snapshot_is_never_loaded(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.ones(4)}, 10, wait=True)
    assert store.load(11) is None and store.load(9) is None
    assert store.load(10) is not None


@pytest.mark.parametrize("damage", ["truncate", "no-header", "flip-data", "flip-header", "header-step"])
def test_torn_snapshot_is_never_loaded(tmp_path: Path, damage: str) -> None:
    store = SnapshotStore(tmp_path, "r")
    store.write({"a": torch.arange(1000.0), "b": torch.arange(10)}, 5, wait=True)
    assert store.load(5) is not None
    data, header = store.data_path("a"), store.header_path("a")
    if damage == "truncate":
        os.truncate(data, data.stat().st_size - 64)
    elif damage == "no-header":
        header.unlink()
    elif damage == "flip-data":
        b = bytearray(data.read_bytes())
        b[2000] ^= 0x10
        data.write_bytes(bytes(b))
    elif damage == "flip-header":
        b = bytearray(header.read_bytes())
        i = b.index(b'"rank": 0') + len(b'"rank": ')
        b[i] = ord("1")
        header.write_bytes(bytes(b))
    else:  # a header edited to claim another step (its crc no longer matches)
        h = json.loads(header.read_text())
        h["step"] = 6
        header.write_text(json.dumps(h))
    assert store.load(5) is None and store.load(6) is None
    # and the persister never writes it to EFS either
    assert persist_newest(store, tmp_path / "efs") is None
    assert read_pointer(tmp_path / "efs") is None


def test_no_fit_falls_back_and_touches_nothing(tmp_path: Path) -> None:
    tiny = {"MemTotal": 8 << 30, "MemAvailable": 600 << 20}  # < reserve (512 MiB) + 100 MiB
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.ones(4)}, 1, wait=True)
    if store._spares is not None:  # the second slot's file, made in the background after a first write
        store._spares.join(10)

    def files() -> list[tuple[str, int]]:  # the snapshots' own files (a spare of the old size may go)
        return sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir() if not p.name.endswith(".spare"))

    before = files()
    small = SnapshotStore(tmp_path, "r", meminfo=lambda: tiny)
    r = small.write({"w": torch.zeros(100 << 18)}, 2)  # 100 MiB of fp32
    assert r.startswith("no-fit: ") and "available" in r
    assert files() == before
    assert small.load(1) is not None and small.newest().step == 1


def test_a_copy_with_known_crc32s_is_complete_at_once_and_checked_on_load(tmp_path: Path) -> None:
    """What a rank restored from a peer keeps: the peer header's CRCs are taken when the layout
    matches (the header is in place when write returns, no background pass); a layout that does
    not match is ignored (CRCs computed); a wrong CRC makes the snapshot fail its load."""
    state = _mixed_state()
    src = SnapshotStore(tmp_path / "src", "r")
    assert src.write(state, 5, wait=True) == "ok"
    known = src.newest().header["tensors"]
    dst = SnapshotStore(tmp_path / "dst", "r")
    assert dst.write(state, 5, known=known) == "ok"
    assert dst._pending is None  # no checksum thread: complete on return
    assert dst.newest().step == 5 and [m["crc32c"] for m in dst.newest().header["tensors"]] == [
        m["crc32c"] for m in known
    ]
    assert _same(dst.load(5), state)
    other = SnapshotStore(tmp_path / "other", "r")
    assert other.write({"w": torch.ones(3)}, 5, known=known) == "ok"  # not this layout: computed
    other.flush()
    assert torch.equal(other.load(5)["w"], torch.ones(3))
    bad = [{**m, "crc32c": m["crc32c"] ^ 1} for m in src.newest().header["tensors"]]
    liar = SnapshotStore(tmp_path / "liar", "r")
    assert liar.write(state, 5, known=bad) == "ok"
    assert liar.newest().step == 5 and liar.load(5) is None  # never loaded


def test_meminfo_can_be_pointed_elsewhere_for_tests(tmp_path: Path, monkeypatch) -> None:
    """PETCTL_SNAPSHOT_MEMINFO (test-only) is what a store's fit check reads: 600 MiB available
    refuses 100 MiB (reserve 512 MiB) and touches nothing; 700 MiB takes it."""
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       8388608 kB\nMemAvailable:     614400 kB\n")
    monkeypatch.setenv("PETCTL_SNAPSHOT_MEMINFO", str(mi))
    assert read_meminfo()["MemAvailable"] == 600 << 20
    store = SnapshotStore(tmp_path / "s", "r")
    assert store.write({"w": torch.zeros(100 << 18)}, 1).startswith("no-fit: ")
    assert not list((tmp_path / "s").glob("*.bin"))
    mi.write_text("MemTotal:       8388608 kB\nMemAvailable:     716800 kB\n")
    assert store.write({"w": torch.zeros(100 << 18)}, 1, wait=True) == "ok"


def test_fits_reads_the_real_filesystem_and_meminfo(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    ok, why = fits(free + (1 << 30), tmp_path)
    assert not ok and "free in" in why
    avail = read_meminfo()["MemAvailable"]
    assert 0 < avail <= read_meminfo()["MemTotal"]
    if avail < free:  # the memory check is the one that must refuse
        ok, why = fits(avail, tmp_path)
        assert not ok and "available" in why
    assert fits(1 << 20, tmp_path)[0]


def test_unsupported_state_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "r")
    assert store.write({"x": object()}, 1).startswith("unsupported: ")
    assert store.write({"x": torch.ones(2).to_sparse()}, 1).startswith("unsupported: ")
    assert store.newest() is None


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from petctl_agent.checkpointing.snapshot import SnapshotStore
    store = SnapshotStore(sys.argv[1], "r")
    n = int(sys.argv[2])
    for s in (1, 2):
        store.write({"w": torch.full((n,), float(s)), "s": s}, s, wait=True)
    Path(sys.argv[3]).write_text("ready")
    s = 3
    while True:
        store.write({"w": torch.full((n,), float(s)), "s": s}, s, wait=True)
        s += 1
    """
)


def test_writer_killed_mid_write_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    ready = tmp_path / "ready"
    n = 32 << 20  # 128 MiB of fp32: a copy takes long enough to land in
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(shm), str(n), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        store = SnapshotStore(shm, "r")
        # kill while a slot has no header: the writer is inside a write
        while len(store.complete()) == 2:
            assert time.monotonic() < deadline
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    done = store.complete()
    assert len(done) in (1, 2)  # 2: the kill landed after the header (rare); still both valid
    newest = done[0]
    got = store.load(newest.step)
    assert got is not None and got["s"] == newest.step
    assert bool((got["w"] == float(newest.step)).all())
    torn = {"a", "b"} - {c.slot for c in done}
    for slot in torn:
        assert not store.header_path(slot).exists()


def test_persist_writes_todays_format_with_atomic_latest(tmp_path: Path) -> None:
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    state = _mixed_state()
    store = SnapshotStore(shm, "replicated")
    store.write(state, 40, wait=True)
    assert persist_newest(store, efs) == 40
    p = read_pointer(efs)
    assert p["file"] == "ckpt-0000000040.pt" and p["step"] == 40 and p["format"] == "torch"
    assert p["size"] == (efs / p["file"]).stat().st_size
    got, step = load_file(efs / p["file"], p["sha256"], "cpu")  # today's loader, sha256 checked
    assert step == 40 and _same(state, got)
    got2, step2 = ckpt.load_latest(efs, map_location="cpu")
    assert step2 == 40 and _same(state, got2)
    assert persist_newest(store, efs) is None  # already there
    assert not [n for n in os.listdir(efs) if n.endswith(".tmp")]


def test_persist_of_a_replaced_slot_is_dropped_and_newest_goes_next(tmp_path: Path) -> None:
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    store = SnapshotStore(shm, "r")
    store.write({"w": torch.full((1000,), 1.0)}, 1, wait=True)
    old = store.newest()
    # the writer reuses that slot (two snapshots later) while a persist of it is under way
    store.write({"w": torch.full((1000,), 2.0)}, 2, wait=True)
    store.write({"w": torch.full((1000,), 3.0)}, 3, wait=True)
    assert not _persist(store, old, efs, 3)
    assert not efs.exists() or not os.listdir(efs)  # no checkpoint, no temp file, no latest
    assert persist_newest(store, efs) == 3
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 3 and torch.equal(state["w"], torch.full((1000,), 3.0))


def test_a_late_persist_never_moves_latest_back_or_rewrites_its_file(tmp_path: Path) -> None:
    # the agent's persister and a rank 0 whose wait for it timed out can both persist: the one that
    # comes second must leave `latest` and the file it names alone (review of this stop's merge)
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    store = SnapshotStore(shm, "r")
    store.write({"w": torch.full((1000,), 5.0)}, 5, wait=True)
    c5 = store.newest()
    store.write({"w": torch.full((1000,), 7.0)}, 7, wait=True)
    c7 = store.newest()
    assert persist_newest(store, efs) == 7
    before = read_pointer(efs)
    file_bytes = (efs / before["file"]).read_bytes()
    assert _persist(store, c5, efs, 3)  # older than latest: nothing to do
    assert _persist(store, c7, efs, 3)  # the same step again: nothing to do
    assert read_pointer(efs) == before
    assert (efs / before["file"]).read_bytes() == file_bytes
    assert not list(efs.glob("ckpt-0000000005*"))
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 7 and torch.equal(state["w"], torch.full((1000,), 7.0))


def test_background_persister_keeps_up_and_prunes(tmp_path: Path) -> None:
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    store = SnapshotStore(shm, "r")
    per = Persister(store, efs, keep=2, poll=0.05)
    try:
        for s in range(1, 8):
            assert store.write({"w": torch.full((1 << 16,), float(s))}, s) == "ok"
            per.kick()
        assert per.wait(timeout=60)
    finally:
        per.close()
    assert per.errors == []
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 7 and torch.equal(state["w"], torch.full((1 << 16,), 7.0))
    assert len(list(efs.glob("ckpt-*.pt"))) <= 2


def test_persist_process_once(tmp_path: Path) -> None:
    shm, efs = tmp_path / "shm", tmp_path / "efs"
    store = SnapshotStore(shm, "replicated")
    store.write({"w": torch.arange(10.0)}, 12, wait=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "petctl_agent.checkpointing.persist",
            str(shm),
            "replicated",
            str(efs),
            "--once",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "step 12" in r.stderr
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 12 and torch.equal(state["w"], torch.arange(10.0))


def test_slot_reused_in_place_only_at_the_same_size(tmp_path: Path) -> None:
    """Same size: the held pages are reused (fast). Another size: a new inode, so a reader that
    has the old one mapped (the persister) is never cut short by a shrink (SIGBUS)."""
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.ones(4096)}, 1, wait=True)
    ino = store.data_path("a").stat().st_ino
    fd = os.open(store.data_path("a"), os.O_RDONLY)
    try:
        import mmap

        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # a reader of slot a
        store.write({"w": torch.ones(4096)}, 2, wait=True)  # slot b
        store.write({"w": torch.full((4096,), 3.0)}, 3, wait=True)  # slot a, same size
        assert store.data_path("a").stat().st_ino == ino
        store.write({"w": torch.ones(4096)}, 4, wait=True)  # slot b
        store.write({"w": torch.full((16,), 5.0)}, 5, wait=True)  # slot a, smaller
        assert store.data_path("a").stat().st_ino != ino
        assert len(mm[:]) == 4096 * 4  # the old mapping is whole: reading it does not SIGBUS
        mm.close()
    finally:
        os.close(fd)
    assert torch.equal(store.load(5)["w"], torch.full((16,), 5.0))


def _mapping_of(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s bytes in this process (/proc/self/maps), or "anon"."""
    ptr = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) > 5 and parts[5].startswith("/") else "anon"
    return "anon"


def test_a_restore_on_the_cpu_is_views_of_the_slot_lent_until_dropped(tmp_path: Path) -> None:
    """A load onto the CPU copies nothing: the tensors are views of a private mapping of the
    slot's file (a 1 GiB self-restore spent ~1-3 s allocating and filling fresh pages).
    The file stays lent while they live: the writer never rewrites it in place (a new file), so
    the restored tensors never change under training, and a change to them never reaches the
    snapshot. Once they are gone, writes reuse the slot's pages in place again."""
    import gc

    store = SnapshotStore(tmp_path, "r")
    n = 1 << 18  # 1 MiB
    store.write({"w": torch.full((n,), 1.0), "k": torch.arange(4)}, 1, wait=True)  # slot a
    store.write({"w": torch.full((n,), 2.0), "k": torch.arange(4)}, 2, wait=True)  # slot b
    got = store.load(2)
    assert _mapping_of(got["w"]) == str(store.data_path("b"))  # a view of the slot, not a copy
    ino = store.data_path("b").stat().st_ino
    got["w"][0] = -1.0  # copy-on-write: the snapshot does not see it
    assert store.load(2)["w"][0] == 2.0
    store.write({"w": torch.full((n,), 3.0), "k": torch.arange(4)}, 3, wait=True)  # slot a
    store.write({"w": torch.full((n,), 4.0), "k": torch.arange(4)}, 4, wait=True)  # slot b: lent
    assert store.data_path("b").stat().st_ino != ino  # a new file: the lent one is left alone
    assert (
        got["w"][0] == -1.0 and bool((got["w"][1:] == 2.0).all()) and torch.equal(got["k"], torch.arange(4))
    )
    assert torch.equal(store.load(4)["w"], torch.full((n,), 4.0))
    del got
    gc.collect()  # every view gone (the load of step 4 above was dropped at once, too): unlent
    ino = store.data_path("b").stat().st_ino
    store.write({"w": torch.full((n,), 5.0), "k": torch.arange(4)}, 5, wait=True)  # slot a
    store.write({"w": torch.full((n,), 6.0), "k": torch.arange(4)}, 6, wait=True)  # slot b
    assert store.data_path("b").stat().st_ino == ino  # in place again
    assert torch.equal(store.load(6)["w"], torch.full((n,), 6.0))


def test_a_restore_is_lent_only_when_a_new_file_for_its_slot_fits(tmp_path: Path) -> None:
    """A lent slot is never rewritten in place: its next write needs a whole new file. On a node
    with room for the two slots but not a third file, a lent restore would make every later write
    to that slot a no-fit (EFS the slow way, for the worker's whole life; found in review). So
    with no room for a new file the restore copies, and the slot is rewritten in place."""
    tiny = {"MemTotal": 8 << 30, "MemAvailable": 600 << 20}  # < reserve (512 MiB) + 100 MiB
    n = 100 << 18  # 100 MiB of fp32
    SnapshotStore(tmp_path, "r").write({"w": torch.full((n,), 1.0)}, 1, wait=True)  # slot a
    SnapshotStore(tmp_path, "r").write({"w": torch.full((n,), 2.0)}, 2, wait=True)  # slot b
    store = SnapshotStore(tmp_path, "r", meminfo=lambda: tiny)
    got = store.load(2)
    assert got is not None and _mapping_of(got["w"]) == "anon"  # a copy, not a view of slot b
    ino = store.data_path("b").stat().st_ino
    assert store.write({"w": torch.full((n,), 3.0)}, 3, wait=True) == "ok"  # slot a, in place
    assert store.write({"w": torch.full((n,), 4.0)}, 4, wait=True) == "ok"  # slot b, not lent: fits
    assert store.data_path("b").stat().st_ino == ino
    assert bool((got["w"] == 2.0).all())
    del got


def test_the_new_file_a_lent_slot_needs_is_made_in_the_background_after_a_restore(tmp_path: Path) -> None:
    """After a restore whose tensors are views of slot b, prepare_spares makes b's replacement file
    (allocated) in a background thread: the write that comes to b renames it into place instead of
    allocating 1 GiB of fresh tmpfs pages while training waits (1.7-3.0 s at 1 GiB, the
    second checkpoint after every restart; 0.5-0.7 s with the spare). A spare that the write does
    not need (the restored tensors are gone: in place again) is removed, never left in memory."""
    import gc

    n = 1 << 16
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((n,), 1.0)}, 1, wait=True)  # slot a
    store.write({"w": torch.full((n,), 2.0)}, 2, wait=True)  # slot b
    store.close()
    store = SnapshotStore(tmp_path, "r")  # a restarted worker
    got = store.load(2)  # lends slot b
    store.prepare_spares(store.newest().header["size"])
    store._spares.join()
    spare = store.spare_path("b")
    assert spare.exists() and not store.spare_path("a").exists()  # a: not lent, same size: in place
    assert spare.stat().st_blocks * 512 >= n * 4  # allocated, not a sparse file
    ino = spare.stat().st_ino
    store.write({"w": torch.full((n,), 3.0)}, 3, wait=True)  # slot a, in place
    store.write({"w": torch.full((n,), 4.0)}, 4, wait=True)  # slot b: lent, takes the spare
    assert store.data_path("b").stat().st_ino == ino and not spare.exists()
    assert torch.equal(store.load(4)["w"], torch.full((n,), 4.0)) and bool((got["w"] == 2.0).all())
    # a spare made while b was lent, then the restored tensors are dropped before the write
    store.close()
    store = SnapshotStore(tmp_path, "r")
    got = store.load(4)
    store.prepare_spares(store.newest().header["size"])
    store._spares.join()
    assert spare.exists()
    del got
    gc.collect()
    store.write({"w": torch.full((n,), 5.0)}, 5, wait=True)  # slot a
    store.write({"w": torch.full((n,), 6.0)}, 6, wait=True)  # slot b, unlent: in place
    assert not spare.exists() and store.data_path("b").stat().st_ino == ino
    assert torch.equal(store.load(6)["w"], torch.full((n,), 6.0))


def test_a_spare_left_by_an_exited_worker_is_mapped_by_the_next_one(tmp_path: Path) -> None:
    """A worker that made a spare in the background and then exited (a drain's ``os._exit``: no
    atexit frees it) leaves the file; the next worker of the store finds it allocated and must map
    it off the write's path, as it would a spare of its own: the write then only copies (at 1 GiB,
    0.2 s against 2.7-6.9 s for a map and populate on the path under a join's load)."""
    n = 1 << 16
    first = SnapshotStore(tmp_path, "r")
    first.write({"w": torch.full((n,), 1.0)}, 1, wait=True)  # slot a; the spare of b in the background
    first._spares.join(10)
    size = first.newest().header["size"]
    spare = first.spare_path("b")
    assert spare.exists() and first._ready("b", size)
    ino = spare.stat().st_ino

    nxt = SnapshotStore(tmp_path, "r")  # the restarted worker: its own mappings, none yet
    assert not nxt._ready("b", size)
    got = nxt.load(1)  # lends slot a
    nxt.prepare_spares(size)
    nxt._spares.join(10)
    assert nxt._ready("b", size), "the spare found on disk was left unmapped"
    assert spare.stat().st_ino == ino  # the same file, not a second allocation
    assert nxt.write({"w": torch.full((n,), 2.0)}, 2, wait=True) == "ok"  # slot b: takes the spare
    assert nxt.data_path("b").stat().st_ino == ino and not spare.exists()
    assert torch.equal(nxt.load(2)["w"], torch.full((n,), 2.0)) and bool((got["w"] == 1.0).all())


def test_a_write_never_waits_for_a_spare_still_being_made(tmp_path: Path, monkeypatch) -> None:
    """On a busy node the background allocation can take longer than a checkpoint interval (stop
    25's bench: the writes that joined the spare thread blocked 4-6 s at 1 GiB): a write that comes
    before its spare is ready allocates its own file and does not wait; the late spare thread then
    finds nothing due and leaves no file behind."""
    import threading

    n = 1 << 16
    store = SnapshotStore(tmp_path, "r")
    store.write({"w": torch.full((n,), 1.0)}, 1, wait=True)
    store.write({"w": torch.full((n,), 2.0)}, 2, wait=True)
    store.close()
    store = SnapshotStore(tmp_path, "r")
    got = store.load(2)  # lends slot b
    gate = threading.Event()
    real = SnapshotStore._make_spare

    def slow(self, slot, size):
        assert gate.wait(60)
        real(self, slot, size)

    monkeypatch.setattr(SnapshotStore, "_make_spare", slow)
    store.prepare_spares(store.newest().header["size"])
    spares = store._spares
    t = time.monotonic()
    store.write({"w": torch.full((n,), 3.0)}, 3, wait=True)  # slot a
    store.write({"w": torch.full((n,), 4.0)}, 4, wait=True)  # slot b: lent, no spare yet: a new file
    assert time.monotonic() - t < 30 and spares.is_alive()
    gate.set()
    spares.join(60)
    assert not list(tmp_path.glob("*spare*"))  # nothing was due any more
    assert torch.equal(store.load(4)["w"], torch.full((n,), 4.0)) and bool((got["w"] == 2.0).all())


def test_a_peers_snapshot_received_into_a_slot_is_complete_at_once_and_checked_on_load(
    tmp_path: Path,
) -> None:
    """SnapshotStore.receive: what a newcomer's local rank 0 does with a peer's transfer -- the
    bytes go straight into a slot (no buffer, no copy), the peer's header gives the CRCs, a load
    checks them. Wrong bytes: never loaded. A fill that fails mid-way (the peer died): the slot is
    torn, the snapshot the store held stays whole. The new file's pages are allocated piece by
    piece as the fill reserves them, not all before the first byte arrives (the peer would wait
    for that: 0.5-1.3 s/GiB of tmpfs allocation here)."""
    import mmap as mmap_

    state = {**_mixed_state(), "big": torch.arange(32768.0)}  # 128 KiB: many pieces
    src = SnapshotStore(tmp_path / "src", "r")
    assert src.write(state, 5, wait=True) == "ok"
    c = src.newest()
    raw = src.data_path(c.slot).read_bytes()
    blocks: list[int] = []  # the slot's allocated bytes before each piece's reserve

    def fill_with(data: bytes, store: SnapshotStore | None = None, piece: int = 16384):
        def fill(mm: mmap_.mmap | None, reserve) -> None:
            for off in range(0, len(data), piece):
                if store is not None:
                    slot = next(s for s in ("a", "b") if store.data_path(s).exists())
                    blocks.append(store.data_path(slot).stat().st_blocks * 512)
                n = min(piece, len(data) - off)
                reserve(off, n)
                mm[off : off + n] = data[off : off + n]

        return fill

    dst = SnapshotStore(tmp_path / "dst", "r")
    assert len(raw) > 4 * 16384
    assert dst.receive(c.header, fill_with(raw, dst)) == "ok"
    assert dst._pending is None and dst.newest().step == 5  # complete on return
    assert blocks[0] == 0 and blocks[1] > 0 and blocks[1] < len(raw)  # allocated as it arrived
    assert dst.data_path(dst.newest().slot).stat().st_blocks * 512 >= len(raw)
    assert _same(dst.load(5), state)
    # what the receive wrote (its fill checked the bytes) loads without a second CRC pass
    assert _same(dst.load(5, check=dst.verified()), state)
    bad = SnapshotStore(tmp_path / "bad", "r")
    flipped = bytearray(raw)
    flipped[0] ^= 0xFF
    assert bad.receive(c.header, fill_with(bytes(flipped))) == "ok"
    assert bad.load(5) is None  # the CRC check on load
    held = SnapshotStore(tmp_path / "held", "r")
    assert held.write({"w": torch.ones(3)}, 4, wait=True) == "ok"

    def dies(mm: mmap_.mmap | None, reserve) -> None:
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError):
        held.receive(c.header, dies)
    assert [x.step for x in held.complete()] == [4] and torch.equal(held.load(4)["w"], torch.ones(3))
    # the torn slot's file is gone (its pages back to the node), the complete one's stays
    assert [p.name for p in sorted((tmp_path / "held").glob("*.bin"))] == [f"r.{held.newest().slot}.bin"]
    out = {**c.header, "tensors": [{**c.header["tensors"][0], "offset": c.header["size"]}]}
    assert held.receive(out, dies).startswith("unsupported")  # a layout outside its bytes


# ---------------------------------------------------------------- wired into ckpt.step / ckpt.resume


@pytest.fixture
def snap_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from petctl_agent.checkpointing import memory

    shm, efs = tmp_path / "shm", tmp_path / "efs"
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(shm))
    monkeypatch.setenv("PETCTL_CHECKPOINT_DIR", str(efs))
    monkeypatch.delenv("PETCTL_DRAIN_FILE", raising=False)
    monkeypatch.delenv("PETCTL_PROGRESS_FILE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    yield shm, efs
    memory.close_persisters()


def test_settings_knob_and_the_exported_snapshot_dir(tmp_path: Path) -> None:
    from petctl_agent.settings import Settings
    from petctl_agent.spec import JobSpec
    from petctl_agent.worker.env import Paths, export_worker_env

    on = Settings.from_env({})
    assert on.snapshots and on.snapshot_dir == "/dev/shm/petctl"  # on by default
    assert not Settings.from_env({"PETCTL_AGENT_NO_SNAPSHOTS": "1"}).snapshots
    assert not Settings.from_env({"PETCTL_AGENT_SNAPSHOT_DIR": ""}).snapshots
    spec = JobSpec.from_dict(
        {"job_name": "j1", "min_nodes": 1, "max_nodes": 2, "code_url": "file:///x", "script": "train.py"}
    )
    for sd in (None, tmp_path / "shm" / "j1" / "i-1"):
        env: dict[str, str] = {"PETCTL_SNAPSHOT_DIR": "left over"}
        export_worker_env(
            env, spec, Paths(tmp_path), tmp_path / "ck", tmp_path / "w", "127.0.0.1", 1, "gloo", on, sd
        )
        assert env.get("PETCTL_SNAPSHOT_DIR") == (str(sd) if sd else None)


def test_periodic_step_snapshots_and_persists_in_the_background(snap_env) -> None:
    from petctl_agent.checkpointing import memory, memory_store

    shm, efs = snap_env
    w = torch.zeros(1000)
    for s in range(1, 7):
        w += 1
        ckpt.step(s, lambda w=w: {"w": w.clone()}, every=2)
    memory_store.store_of(shm).flush()  # step() returned after the copy; the header follows
    store = SnapshotStore(shm, memory.NAME)
    assert store.newest().step == 6
    per = next(iter(memory_store.persisters.values()))
    assert per.wait(timeout=60)
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 6 and torch.equal(state["w"], torch.full((1000,), 6.0))
    # the job's last step: durable when step() returns
    w += 1
    ckpt.step(7, lambda: {"w": w.clone()}, every=2, last=True)
    assert ckpt.latest_step(efs) == 7


def test_resume_prefers_own_snapshot_else_efs(snap_env) -> None:
    from petctl_agent.checkpointing import memory

    shm, efs = snap_env
    ckpt.step(4, lambda: {"w": torch.full((4,), 4.0)}, every=2, last=True)  # memory + EFS at 4
    # the EFS file is gone (say, lost): only memory can give step 4
    (efs / "ckpt-0000000004.pt").unlink()
    state, step = ckpt.resume()
    assert step == 4 and torch.equal(state["w"], torch.full((4,), 4.0))
    # a torn snapshot is never loaded: EFS (here: nothing left) answers
    SnapshotStore(shm, memory.NAME).header_path(SnapshotStore(shm, memory.NAME).newest().slot).unlink()
    assert ckpt.resume() is None
    # stale: EFS newer than the snapshot -> EFS
    memory.close_persisters()
    ckpt.step(6, lambda: {"w": torch.full((4,), 6.0)}, every=2, last=True)
    ckpt.save({"w": torch.full((4,), 8.0)}, 8, efs)  # durable save, also snapshots 8
    SnapshotStore(shm, memory.NAME).write({"w": torch.full((4,), 6.5)}, 6, wait=True)  # snapshot behind
    st = SnapshotStore(shm, memory.NAME)
    st.header_path([c for c in st.complete() if c.step == 8][0].slot).unlink()
    state, step = ckpt.resume()
    assert step == 8 and torch.equal(state["w"], torch.full((4,), 8.0))


def test_a_resume_from_memory_prepares_the_file_its_lent_slot_will_need(snap_env) -> None:
    """ckpt.resume from the node's own memory lends the slot (the tensors are views of it) and has
    the store make that slot's next file in the background, once the first step after it is done
    (not beside it); the checkpoint that comes to the slot takes it. The restored tensors
    never change."""
    from petctl_agent.checkpointing import memory, memory_store

    shm, efs = snap_env
    ckpt.step(2, lambda: {"w": torch.full((1024,), 2.0)}, every=2)
    ckpt.step(4, lambda: {"w": torch.full((1024,), 4.0)}, every=2, last=True)
    memory.close_persisters()  # a new worker
    state, step = ckpt.resume()
    assert step == 4
    store = memory_store.stores[str(shm)]
    lent = store.newest().slot
    assert store._spares is None  # not beside the first step
    ckpt.step(5, lambda: {}, every=2)  # the first step after the restore: no checkpoint
    store._spares.join()
    spare = store.spare_path(lent)
    assert spare.exists()
    ino = spare.stat().st_ino
    for s in (6, 8):
        ckpt.step(s, lambda s=s: {"w": torch.full((1024,), float(s))}, every=2)
    memory_store.stores[str(shm)].flush()
    assert store.data_path(lent).stat().st_ino == ino and not spare.exists()
    assert torch.equal(state["w"], torch.full((1024,), 4.0))


def test_state_a_snapshot_cannot_hold_takes_todays_path(snap_env, capsys) -> None:
    from petctl_agent.checkpointing import memory

    shm, efs = snap_env
    ckpt.step(2, lambda: {"w": torch.ones(3), "tags": {"a", "b"}}, every=2)  # a set: no snapshot
    assert "memory snapshot of step 2 skipped (unsupported" in capsys.readouterr().err
    assert ckpt.latest_step(efs) == 2  # written synchronously, as today
    assert not shm.exists() or not list(shm.glob(f"{memory.NAME}.*.json"))  # no snapshot header
    assert "unsupported" in json.loads((shm / memory.FALLBACK_REPORT).read_text())["reason"]  # for the agent


RANKS_SNAP = textwrap.dedent(
    """
    import json, os, sys, torch
    import torch.distributed as dist
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.distributed import init_process_group
    init_process_group()
    rank = dist.get_rank()
    w = torch.zeros(3)
    restored = ckpt.resume()
    start = 1 if restored is None else restored[1] + 1
    if restored is not None:
        w.copy_(restored[0]["w"])
    total = int(os.environ["TOTAL"])
    for s in range(start, total + 1):
        w += 1
        if rank == 1 and s == int(os.environ.get("DRAIN_AT", "0")):
            open(os.environ["PETCTL_DRAIN_FILE"], "w").write("leave")  # as a leaving agent writes it
        ckpt.step(s, lambda: {"w": w.clone()}, every=2, last=s == total)
    print("RESULT " + json.dumps({"start": start, "w": w.tolist()}), flush=True)
    """
)


def _ranks(tmp_path: Path, envs: list[dict], source: str = RANKS_SNAP) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "ranks_snap.py"
    script.write_text(source)
    base = [
        {"PYTHONPATH": str(REPO / "agent"), "PETCTL_DRAIN_FILE": str(tmp_path / f"drain-{r}"), **e}
        for r, e in enumerate(envs)
    ]
    return run_ranks([sys.executable, str(script)], base, timeout=180)


def _res(cp: subprocess.CompletedProcess) -> dict:
    for line in cp.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result (rc {cp.returncode}):\n{cp.stderr[-3000:]}")


def test_two_ranks_one_node_drain_then_resume_from_memory(tmp_path: Path) -> None:
    from petctl_agent import DRAIN_EXIT_CODE

    shm, efs = tmp_path / "shm", tmp_path / "efs"
    base = {"PETCTL_SNAPSHOT_DIR": str(shm), "PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "10"}
    first = _ranks(
        tmp_path, [{**base, "LOCAL_RANK": "0", "DRAIN_AT": "5"}, {**base, "LOCAL_RANK": "1", "DRAIN_AT": "5"}]
    )
    for cp in first:
        assert cp.returncode == DRAIN_EXIT_CODE, cp.stderr[-3000:]
    assert ckpt.latest_step(efs) == 6  # the drain waited for EFS
    assert SnapshotStore(shm, "replicated").newest().step == 6
    (tmp_path / "drain-1").unlink()
    (efs / "ckpt-0000000006.pt").unlink()  # only memory holds step 6 now (EFS would give step 4)
    second = [_res(cp) for cp in _ranks(tmp_path, [{**base, "LOCAL_RANK": "0"}, {**base, "LOCAL_RANK": "1"}])]
    assert [r["start"] for r in second] == [7, 7]
    assert all(r["w"] == [10.0] * 3 for r in second)
    assert ckpt.latest_step(efs) == 10


def test_two_nodes_one_without_snapshot_both_take_the_peers_step(tmp_path: Path) -> None:
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((3,), 4.0)}, 4, efs)
    SnapshotStore(tmp_path / "shm0", "replicated").write({"w": torch.full((3,), 6.0)}, 6, wait=True)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "8", "LOCAL_RANK": "0"}
    # node 0 has step 6 in memory, node 1 (just joined) nothing: node 1 gets step 6 from node 0
    res = [
        _res(cp)
        for cp in _ranks(
            tmp_path,
            [
                {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "shm0")},
                {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "shm1")},
            ],
        )
    ]
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [8.0] * 3 for r in res)


def test_durable_save_raises_when_the_checkpoint_dir_cannot_be_written(snap_env) -> None:
    """A direct save() with snapshots on is durable like today's: an EFS error surfaces, no hang."""
    shm, efs = snap_env
    efs.parent.mkdir(parents=True, exist_ok=True)
    efs.write_text("not a directory")
    with pytest.raises(OSError):
        ckpt.save({"w": torch.ones(3)}, 1)


def test_a_durable_save_whose_snapshot_never_reaches_efs_writes_it_directly(
    snap_env, monkeypatch, capsys
) -> None:
    """The wait for the background persist is bounded: after PETCTL_CHECKPOINT_TIMEOUT the state
    the caller holds is written the old way (a persist that can never succeed used to spin forever)."""
    from petctl_agent.checkpointing import persisting

    shm, efs = snap_env
    monkeypatch.setenv("PETCTL_CHECKPOINT_TIMEOUT", "1")
    # an EFS write of the snapshot that never lands (torn, replaced, or EFS trouble each time)
    monkeypatch.setattr(persisting, "persist_newest", lambda *a, **k: None)
    t0 = time.monotonic()
    out = ckpt.save({"w": torch.full((10,), 4.0)}, 12)
    assert time.monotonic() - t0 < 15
    assert out is not None and read_pointer(efs)["step"] == 12
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 12 and torch.equal(state["w"], torch.full((10,), 4.0))
    # half the checkpoint timeout: the rank's own write then ends within the others' barrier's
    assert "not persisted from memory within 0.5 s" in capsys.readouterr().err


def test_a_pinned_slot_is_never_written_and_the_newest_is_overwritten(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "shm", "r")
    for s in (1, 2):
        store.write({"w": torch.full((1000,), float(s))}, s, wait=True)
    old = [c for c in store.complete() if c.step == 1][0]
    pin = store.pin(old)  # the persister's hold while it writes step 1 to EFS
    assert pin is not None
    try:
        for s in (3, 4, 5):  # the older slot is pinned: each write replaces the newest
            assert store.write({"w": torch.full((1000,), float(s))}, s, wait=True) == "ok"
            assert {c.step for c in store.complete()} == {1, s}
        assert store.newest().step == 5
        got = store.load(1)
        assert got is not None and torch.equal(got["w"], torch.full((1000,), 1.0))
    finally:
        os.close(pin)
    # unpinned: the next write goes into the older slot again (step 1's)
    store.write({"w": torch.full((1000,), 6.0)}, 6, wait=True)
    assert sorted(c.step for c in store.complete()) == [5, 6]
    # a pin on a snapshot the writer has since replaced is refused: the persister takes the newest
    assert store.pin(old) is None
    gens = [c.gen for c in store.complete()]
    assert len(set(gens)) == 2 and max(gens) > 5  # generations only grow, also across overwrites


def test_a_dead_persisters_pin_does_not_block_the_writer(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    store = SnapshotStore(shm, "r")
    for s in (1, 2):
        store.write({"w": torch.full((10,), float(s))}, s, wait=True)
    slot = [c for c in store.complete() if c.step == 1][0].slot
    holder = textwrap.dedent(
        """
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        open(sys.argv[2], "w").close()
        time.sleep(600)
        """
    )
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", holder, str(store.pin_path(slot)), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        store.write({"w": torch.full((10,), 3.0)}, 3, wait=True)
        assert sorted(c.step for c in store.complete()) == [1, 3]  # pinned: step 1 kept
    finally:
        p.kill()
        p.wait()
    store.write({"w": torch.full((10,), 4.0)}, 4, wait=True)  # the pin died with its holder
    assert sorted(c.step for c in store.complete()) == [3, 4]


LEAVE_SNAP = textwrap.dedent(
    """
    import json, os, sys, torch
    import torch.distributed as dist
    from petctl_agent import checkpoint as ckpt
    from pathlib import Path
    from petctl_agent.checkpointing.files import read_pointer
    from petctl_agent.distributed import init_process_group
    init_process_group()
    rank = dist.get_rank()
    w = torch.zeros(int(os.environ["N"]))

    def leave():  # what EFS held when this rank's drain save returned
        p = read_pointer(Path(os.environ["PETCTL_CHECKPOINT_DIR"]))
        print("RESULT " + json.dumps({"latest": p and p["step"]}), flush=True)
        os._exit(0)

    ckpt.exit_for_drain = leave
    for s in range(1, 100):
        w += 1
        if str(rank) in os.environ["LEAVERS"].split(",") and s == 2:  # agreed, and saved, at 3
            open(os.environ["PETCTL_DRAIN_FILE"], "w").write("leave")  # as a leaving agent writes it
        ckpt.step(s, lambda: {"w": w.clone()}, every=0)
    """
)


@pytest.mark.parametrize(
    "leavers, served, waits",
    [("1", "0", False), ("0", "0", True), ("0", "0,1", False), ("0,1", "0,1", True)],
    ids=["a-survivor-holds-it", "no-survivor-has-a-persister", "rank-0s-node-leaves", "every-node-leaves"],
)
def test_a_drain_waits_for_efs_only_when_no_survivor_with_a_persister_stays(
    tmp_path: Path, leavers, served, waits
) -> None:
    # two nodes (a store each), the agents' persisters (`served`) over an EFS paced at 0.5 MiB/s:
    # persisting the 2 MiB snapshot takes >= 4 s, so a drain that does not wait returns before it
    # (4 s, not 2: on a loaded CI box the leaving rank's own path to its check can take seconds).
    # rank-0s-node-leaves: the node of rank 0 (whose persister is asked) leaves, the other node stays
    # with a persister of its own: before, rank 0 waited for EFS here (5.2 s of the 8.0 s
    # drain at 1 GiB/rank in bench_state.py); the survivor's copy covers it as for any other leaver
    from petctl.local import efs_rate
    from petctl_agent.checkpointing import iohook, persist

    rates = efs_rate.rates_from_env({"PETCTL_LOCAL_EFS_CLIENT_MIBPS": "0.5"})
    pace = efs_rate.instance_env(tmp_path / "state", "i-1", rates)
    efs = tmp_path / "state" / "efs" / "fs-0123456789abcdef0" / "ckpt"
    shms = [tmp_path / "shm0", tmp_path / "shm1"]
    env = {**os.environ, **pace, "PYTHONPATH": str(REPO / "agent")}
    servers = []
    for i in map(int, served.split(",")):
        shms[i].mkdir()
        cmd = [
            sys.executable,
            "-m",
            "petctl_agent.checkpointing.persist",
            "--serve",
            str(shms[i]),
            "replicated",
        ]
        # its stderr kept, and faulthandler on: a persister that does not end at SIGTERM fails the
        # test with its stack (below)
        err = open(tmp_path / f"persister-{i}.err", "w+")  # noqa: SIM115 - read in the finally
        servers.append(subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stderr=err))
    try:
        deadline = time.monotonic() + 60
        for i, server in zip(map(int, served.split(",")), servers):
            while not persist.served(shms[i]):
                assert server.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
        base = {**pace, "PETCTL_CHECKPOINT_DIR": str(efs), "N": str(1 << 19), "LEAVERS": leavers}
        base["LOCAL_RANK"] = "0"
        script_env = [{**base, "PETCTL_SNAPSHOT_DIR": str(shm)} for shm in shms]
        res = [_res(cp) for cp in _ranks(tmp_path, script_env, LEAVE_SNAP)]
        if waits:
            assert res[0]["latest"] == 3  # rank 0 returned only once EFS had the step
        else:
            assert res[0]["latest"] is None  # returned at once: a staying node holds step 3...
            while ckpt.latest_step(efs) != 3:  # ...and rank 0's persister puts it on EFS in the background
                assert all(s.poll() is None for s in servers) and time.monotonic() < deadline + 60
                time.sleep(0.05)
        state, step = ckpt.load_latest(efs, map_location="cpu")
        assert step == 3 and torch.equal(state["w"], torch.full((1 << 19,), 3.0))
        for r in range(2):
            if str(r) not in leavers.split(","):
                assert SnapshotStore(shms[r], "replicated").newest().step == 3  # the survivor's copy
    finally:
        for server in servers:
            server.terminate()
        stuck = []
        for i, server in zip(map(int, served.split(",")), servers):
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.send_signal(signal.SIGABRT)  # faulthandler prints where it is stuck
                server.wait(timeout=30)
                stuck.append(f"persister {i}:\n" + (tmp_path / f"persister-{i}.err").read_text()[-6000:])
        assert not stuck, "a persister did not end 60 s after its SIGTERM\n" + "\n".join(stuck)
    assert efs_rate.ENV in pace and pace[iohook.ENV] == efs_rate.HOOK


@pytest.mark.parametrize(
    ("raw", "step", "warned"), [(None, 10, False), ("0", 0, False), ("3", 3, False), ("x", 10, True)]
)
def test_the_persister_runs_behind_training_on_the_cpu(
    tmp_path: Path, raw: str | None, step: int, warned: bool
) -> None:
    """The agent's persister (``persist --serve``) raises its niceness by ``PETCTL_PERSIST_NICE``
    (default 10) before it serves, so its EFS copies yield the cores to a drain's new workers and
    to training; a bad value says so in one line and keeps the default."""
    from petctl_agent.checkpointing import persist

    env = {k: v for k, v in os.environ.items() if k != "PETCTL_PERSIST_NICE"}
    env["PYTHONPATH"] = str(REPO / "agent")
    if raw is not None:
        env["PETCTL_PERSIST_NICE"] = raw
    cmd = [sys.executable, "-m", "petctl_agent.checkpointing.persist", "--serve", str(tmp_path), "replicated"]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not persist.served(tmp_path):  # it holds the store's lock once it serves
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert os.getpriority(os.PRIO_PROCESS, server.pid) == min(19, os.nice(0) + step)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    assert ("PETCTL_PERSIST_NICE='x' is not a whole number from 0 to 19; using 10" in err) == warned, err


def test_a_stopping_persister_still_serves_the_request_already_made(tmp_path: Path) -> None:
    import threading

    from petctl_agent.checkpointing import persist

    shm, efs = tmp_path / "shm", tmp_path / "efs"
    store = SnapshotStore(shm, "replicated")
    store.write({"w": torch.full((100,), 7.0)}, 7, wait=True)
    persist.request(shm, 7, efs, 3)
    stop = threading.Event()
    stop.set()  # SIGTERM (the node leaves) came before the persister picked the request up

    def serve() -> None:  # a thread: serve() installs signal handlers only in the main thread
        t = threading.Thread(target=persist.serve, args=(shm, "replicated"), kwargs={"stop": stop})
        t.start()
        t.join(60)
        assert not t.is_alive()

    serve()
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 7 and torch.equal(state["w"], torch.full((100,), 7.0))
    persist.request(shm, 9, efs, 3)  # a step whose snapshot never completed: nothing to wait for
    serve()
    assert ckpt.latest_step(efs) == 7


def test_the_shared_flock_helpers(tmp_path: Path) -> None:
    """filelocks.hold/held: what the store's owner.lock and the persister's persist.lock use."""
    from petctl_agent import filelocks
    from petctl_agent.checkpointing import persist

    lock = tmp_path / persist.LOCK
    assert not filelocks.held(lock) and not persist.served(tmp_path)  # missing
    fd = filelocks.hold(lock)
    try:
        assert oct(lock.stat().st_mode & 0o777) == "0o600"
        assert filelocks.held(lock) and persist.served(tmp_path)
    finally:
        os.close(fd)
    assert not filelocks.held(lock) and not persist.served(tmp_path)  # released with its fd
    # try_hold: the pin's and the lent file's non-blocking exclusive lock
    fd = filelocks.try_hold(lock)
    assert fd is not None and filelocks.held(lock)
    assert filelocks.try_hold(lock) is None  # another holder: not taken
    os.close(fd)
    assert filelocks.try_hold(tmp_path / "missing", create=False) is None
    assert not (tmp_path / "missing").exists()
    fd = filelocks.try_hold(lock, create=False)
    assert fd is not None
    os.close(fd)


def test_a_durable_save_the_agents_persister_lands_is_written_once(snap_env, capsys) -> None:
    """A durable save (the last step, a leave) whose snapshot the agent's persister gets to EFS
    returns once ``latest`` names it, and writes nothing more. The wait once returned None there,
    which the save read as "not persisted": rank 0 wrote the whole state to EFS a second time,
    synchronously, and published a false ``snapshot_fallback`` (the 1 GiB drain: ~9 s)."""
    import threading

    from petctl_agent.checkpointing import memory, persist

    shm, efs = snap_env
    shm.mkdir(parents=True)
    stop = threading.Event()
    server = threading.Thread(target=persist.serve, args=(shm, memory.NAME), kwargs={"stop": stop})
    server.start()
    try:
        deadline = time.monotonic() + 30
        while not persist.served(shm):
            assert server.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        assert ckpt.save({"w": torch.full((1000,), 5.0)}, 5) is not None
        assert ckpt.latest_step(efs) == 5
    finally:
        stop.set()
        server.join(60)
    err = capsys.readouterr().err
    assert "not persisted from memory" not in err and "writing it to EFS directly" not in err, err
    assert not (shm / memory.FALLBACK_REPORT).exists()
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 5 and torch.equal(state["w"], torch.full((1000,), 5.0))


def test_a_direct_write_forward_only_never_replaces_what_latest_names(tmp_path: Path) -> None:
    """A newcomer rank 0 that must write a restored step to EFS itself (its memory could not keep
    it) may race the old rank 0's persister publishing the same step: ``forward_only`` writes
    nothing when ``latest`` already names that step or a newer one, so ``latest`` always names
    the bytes of its file and never moves back."""
    from petctl_agent.checkpointing.files import write_file

    efs = tmp_path / "efs"
    write_file({"w": torch.full((10,), 7.0)}, 7, efs, 3)
    before = read_pointer(efs)
    data = (efs / before["file"]).read_bytes()
    for step in (7, 5):  # the same step (other bytes: another saved_at), an older one
        write_file({"w": torch.full((10,), -1.0)}, step, efs, 3, forward_only=True)
        assert read_pointer(efs) == before
        assert (efs / before["file"]).read_bytes() == data
    assert not (efs / "ckpt-0000000005.pt").exists()
    write_file({"w": torch.full((10,), 8.0)}, 8, efs, 3, forward_only=True)  # newer: written
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 8 and torch.equal(state["w"], torch.full((10,), 8.0))
    write_file({"w": torch.full((10,), 6.0)}, 6, efs, 3)  # the plain path keeps today's meaning
    assert ckpt.latest_step(efs) == 6


def test_a_restore_trusts_the_agents_verification_only_for_that_very_snapshot(tmp_path: Path) -> None:
    """``prechecked`` skips the CRC pass for the snapshot ``verify`` passed (same generation,
    nonce, header CRC, same unchanged file) and checks any other in full: a slot rewritten
    through the store afterwards (a new generation, the same step, the same file reused in place)
    is not covered by the record, so wrong bytes under its header fail."""
    s = SnapshotStore(tmp_path, "replicated")
    for v in (1.0, 2.0):
        assert s.write({"w": torch.full((1024,), v)}, 6, wait=True) == "ok"
    c = s.verify()
    assert c is not None and c.step == 6 and c == s.newest()
    wrong = bytearray(c.header["size"])  # zeros: no tensor's CRC matches
    mm = mmap.mmap(-1, len(wrong))
    mm.write(bytes(wrong))
    try:
        assert s.prechecked()(c.header, mm) is True  # the verified snapshot: no pass
        for v in (3.0, 4.0):  # the same slot again, in place: a new generation
            assert s.write({"w": torch.full((1024,), v)}, 6, wait=True) == "ok"
        n = s.newest()
        assert n.slot == c.slot and n.gen != c.gen
        assert s.prechecked()(n.header, mm) is False  # not the verified one: checked, fails
        assert s.load(6, check=s.prechecked())["w"][0].item() == 4.0  # its real bytes pass
        assert s.verify() == n and s.prechecked()(n.header, mm) is True
    finally:
        mm.close()
        s.close()


def test_a_restore_waits_for_a_verification_still_running(tmp_path: Path) -> None:
    """While the agent's check holds the lock, a restore's ``prechecked`` waits for its verdict (then
    trusts it) instead of making a second pass beside it; past ``wait`` it checks for itself."""
    import fcntl

    s = SnapshotStore(tmp_path, "replicated")
    assert s.write({"w": torch.full((1024,), 1.0)}, 6, wait=True) == "ok"
    assert s.verify() is not None
    c = s.newest()
    wrong = mmap.mmap(-1, c.header["size"])
    fd = os.open(s.verify_lock_path(), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a verification running
    try:
        t0 = time.monotonic()
        assert s.prechecked(wait=0.3)(c.header, wrong) is False  # gave up waiting: its own pass
        assert time.monotonic() - t0 >= 0.3
        t = threading.Timer(0.3, lambda: fcntl.flock(fd, fcntl.LOCK_UN))  # the verification ends
        t.start()
        assert s.prechecked(wait=30)(c.header, wrong) is True
        t.join()
    finally:
        os.close(fd)
        wrong.close()
        s.close()


# -- the writer's seal: its own check stands once it is gone (no second pass at a restart)

_SEALER = textwrap.dedent(
    """
    import os, sys, torch
    from petctl_agent.checkpointing.snapshot import SnapshotStore
    s = SnapshotStore(sys.argv[1], "replicated")
    known = None
    if sys.argv[2] == "lie":  # CRCs of another state of the same layout, given as known
        assert s.write({"w": torch.full((1 << 18,), 9.0)}, 4, wait=True) == "ok"
        known = s.newest().header["tensors"]
    for step in (5, 6):
        assert s.write({"w": torch.full((1 << 18,), float(step))}, step, wait=True, known=known) == "ok"
    open(sys.argv[3], "w").close()
    sys.stdin.read()  # alive until the test closes stdin
    os._exit(0)
    """
)


def _sealed_by_a_writer(d: Path, how: str = "checked") -> subprocess.Popen:
    """A writer process that wrote steps 5 and 6 (``wait=True``) into ``d`` and stays alive until
    its stdin is closed."""
    ready = d.parent / f"{d.name}.ready"
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    p = subprocess.Popen(
        [sys.executable, "-c", _SEALER, str(d), how, str(ready)], env=env, stdin=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return p


def _gone(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(30) == 0


def _big_crcs(monkeypatch) -> list[int]:
    """Record the size of every CRC call over more than a header's bytes (a pass over data)."""
    from petctl_agent.checkpointing import crcs

    real, calls = crcs.crc, []

    def crc(data, value=0):
        if len(data) > 65536:
            calls.append(len(data))
        return real(data, value)

    monkeypatch.setattr(crcs, "crc", crc)
    return calls


def test_a_snapshot_its_writer_checked_needs_no_second_pass_once_the_writer_is_gone(
    tmp_path: Path, monkeypatch
) -> None:
    """The writer computed the CRCs from the slot's own mapping and sealed the snapshot: while it
    lives (it could still write through that mapping) a restore checks in full; once it is gone, a
    restore, the agent's verification and the persister all take the seal: no pass over the bytes
    (before: the agent's verify and the persister each made one, 2 x 1 GiB at a 1 GiB drain)."""
    d = tmp_path / "shm"
    p = _sealed_by_a_writer(d)
    s = SnapshotStore(d, "replicated")
    c = s.newest()
    wrong = mmap.mmap(-1, c.header["size"])  # zeros: no CRC matches
    try:
        assert c.step == 6
        assert s.covered(c.header, wait=0) is False  # its writer is alive
        assert s.prechecked(wait=0)(c.header, wrong) is False  # so it is checked: and fails
        _gone(p)
        assert s.covered(c.header, wait=0) is True
        assert s.prechecked(wait=0)(c.header, wrong) is True  # the seal: no pass
        assert s.sealed(c)
        calls = _big_crcs(monkeypatch)
        assert s.verify() == c
        assert persist_newest(s, tmp_path / "efs") == 6
        assert calls == [], calls  # neither the verification nor the persister read the bytes
        state, step = ckpt.load_latest(tmp_path / "efs", map_location="cpu")
        assert step == 6 and bool((state["w"] == 6.0).all())
    finally:
        wrong.close()
        s.close()


def test_a_sealed_snapshot_changed_afterwards_is_checked_again_and_never_loaded(
    tmp_path: Path, monkeypatch
) -> None:
    """A write into the slot's file through the filesystem after the seal moves its mtime: the seal
    no longer covers it, the verification and the persister check in full, and the changed bytes
    fail their CRCs: never loaded, never persisted, no record."""
    d = tmp_path / "shm"
    _gone(_sealed_by_a_writer(d))
    s = SnapshotStore(d, "replicated")
    c = s.newest()
    time.sleep(0.01)  # past the clock's tick
    with open(s.data_path(c.slot), "r+b") as f:
        os.pwrite(f.fileno(), b"\x7f" * 8, 64)
    try:
        assert s.covered(c.header, wait=0) is False
        calls = _big_crcs(monkeypatch)
        assert s.verify() is None and not s.verified_path().exists()
        assert calls, "the verification made its pass"
        assert s.load(6, check=s.prechecked(wait=0)) is None
        assert persist_newest(s, tmp_path / "efs") is None  # torn: never persisted
    finally:
        s.close()


def test_a_header_of_the_zlib_era_is_never_loaded(tmp_path: Path) -> None:
    """Older snapshots (``petctl-snapshot-1``) held zlib crc32s under ``crc32``; the code
    of CRC-32C loads none of them (the restore goes to a peer or EFS), even one whole and
    consistent by its own rules -- a node's memory can hold one across an upgrade of the agent."""
    import zlib

    store = SnapshotStore(tmp_path, "r")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    assert store.write(state, 5, wait=True) == "ok"
    c = store.newest()
    assert c is not None and c.step == 5
    old = json.loads(store.header_path(c.slot).read_text())
    data = store.data_path(c.slot).read_bytes()
    old["format"] = "petctl-snapshot-1"
    for m in old["tensors"]:
        m["crc32"] = zlib.crc32(data[m["offset"] : m["offset"] + m["nbytes"]])
        del m["crc32c"]
    old["header_crc"] = zlib.crc32(
        json.dumps({k: v for k, v in old.items() if k != "header_crc"}, sort_keys=True).encode()
    )
    store.close()
    store.header_path(c.slot).write_text(json.dumps(old))
    fresh = SnapshotStore(tmp_path, "r")
    assert fresh.newest() is None and fresh.load(5) is None


def test_a_copy_under_given_crc32s_is_not_sealed(tmp_path: Path) -> None:
    """``write(known=)`` takes a peer's CRCs without checking the copy against them: nothing
    vouches for those bytes, so no seal. Given CRCs that do not match (another state's), the
    snapshot fails its check on load even after its writer is gone."""
    d = tmp_path / "shm"
    _gone(_sealed_by_a_writer(d, "lie"))
    s = SnapshotStore(d, "replicated")
    try:
        c = s.newest()
        assert c.step == 6 and s.covered(c.header, wait=0) is False
        assert s.load(6, check=s.prechecked(wait=0)) is None
    finally:
        s.close()


def test_an_exited_writer_not_yet_reaped_is_gone_and_only_a_sure_answer_counts() -> None:
    """A zombie holds no mapping: its seal counts (the agent reaps its workers after the check).
    Only a sure "gone" counts: an unknown start time or another pid namespace count as alive."""
    from petctl_agent.checkpointing.processes import alive, pid_namespace, start_time

    ns = pid_namespace()
    assert ns is not None
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        started = start_time(pid)
        deadline = time.monotonic() + 10
        while alive(pid, started, ns):
            assert time.monotonic() < deadline, "a zombie counted as alive"
            time.sleep(0.01)
        assert alive(pid, None, ns) is True  # its start time unknown: cannot tell
        assert alive(pid, started, ns + 1) is True  # another pid namespace's pid: cannot tell
        assert alive(pid, started, None) is True
        assert alive(os.getpid(), start_time(os.getpid()), ns) is True
        assert alive(os.getpid(), "0", ns) is False  # a reused pid: another start time
    finally:
        os.waitpid(pid, 0)
    assert alive(pid, started, ns) is False  # reaped


def test_a_waited_write_checksums_on_several_threads_to_the_same_header(tmp_path: Path, monkeypatch) -> None:
    """A write that is waited for (a coordinated stop) computes its CRCs on several threads, in
    pieces joined with crc32_combine: the header is the one a single thread would write, and the
    snapshot loads (its bytes checked against it)."""
    from petctl_agent.checkpointing import crcs

    monkeypatch.setattr(crcs, "PIECE", 1 << 16)  # many pieces per tensor
    monkeypatch.setenv("PETCTL_CRC_THREADS", "4")
    state = _mixed_state() | {"big": torch.randn(300_000), "odd": torch.randn(12_345)}
    one, many = SnapshotStore(tmp_path / "one", "r"), SnapshotStore(tmp_path / "many", "r")
    try:
        assert one.write(state, 3) == "ok"  # the background thread: one thread, whole tensors
        one.flush()
        assert many.write(state, 3, wait=True) == "ok"
        a, b = one.newest().header["tensors"], many.newest().header["tensors"]
        assert [m["crc32c"] for m in a] == [m["crc32c"] for m in b] and len(a) > 20
        assert _same(state, many.load(3))
    finally:
        one.close()
        many.close()
