"""Restore from the nearest copy (checkpointing/memory.py) and the agent's store (node/snapshots.py).

Real torch processes over gloo on 127.0.0.1 stand in for the ranks of several nodes: each "node"
is its own store directory. The agent's side is the real ``SnapshotArea`` with its real persister
process; snapshots are written by ``SnapshotStore`` or by the workers through ``ckpt.step``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import memory, memory_store, persist
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.node import snapshots
from petctl_agent.node.snapshots import SnapshotArea
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]

RESTORE = textwrap.dedent(
    """
    import json, os, signal, sys, time, torch
    import torch.distributed as dist
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.checkpointing import memory
    from petctl_agent.distributed import init_process_group
    init_process_group()
    rank = dist.get_rank()
    kill_after = int(os.environ.get("KILL_SOURCE_AFTER", "0"))
    if kill_after:  # the source dies (SIGKILL) after sending that many broadcasts of the transfer
        real, sent = dist.broadcast, [0]
        def broadcast(t, src, group=None, **kw):
            if dist.get_rank() == src and sent[0] >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            sent[0] += 1
            return real(t, src, group=group, **kw)
        dist.broadcast = broadcast
    if os.environ.get("TRACE_CRC"):  # when each CRC of a piece of data ran (SLOW_CRC: and slowly)
        from petctl_agent.checkpointing import crcs
        real_crc, slow = crcs.crc, float(os.environ.get("SLOW_CRC") or 0)
        def crc(data, value=0):
            if memoryview(data).nbytes >= 65536:  # not a header's
                time.sleep(slow)
                print("TRACE crc %.6f" % time.time(), flush=True)
            return real_crc(data, value)
        crcs.crc = crc
    if os.environ.get("FAIL_FALLOCATE_AFTER"):  # the node's tmpfs fills up mid-receive (ENOSPC)
        import errno
        real_fa, calls = os.posix_fallocate, [0]
        def posix_fallocate(fd, off, n):
            calls[0] += 1
            if calls[0] > int(os.environ["FAIL_FALLOCATE_AFTER"]):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fa(fd, off, n)
        os.posix_fallocate = posix_fallocate
    if os.environ.get("FAIL_OPEN_DATA"):  # this node's snapshot data file cannot be opened (EIO)
        import errno
        real_open = os.open
        def failing_open(path, *a, **kw):
            if str(path).endswith(".bin"):
                raise OSError(errno.EIO, "Input/output error", str(path))
            return real_open(path, *a, **kw)
        os.open = failing_open
    if os.environ.get("CORRUPT_RECV"):  # a receiver's first data piece arrives with a byte changed
        real_b, hit = dist.broadcast, [False]
        class Done:
            def wait(self):
                return True
        def broadcast(t, src, group=None, async_op=False, **kw):
            w = real_b(t, src, group=group, **kw)
            if dist.get_rank() != src and t.numel() >= 65536 and not hit[0]:
                hit[0] = True
                t[0] += 1
            return Done() if async_op else w
        dist.broadcast = broadcast
    if os.environ.get("VANISH_BEFORE_SEND"):  # this node's snapshot file is cut short just before it sends
        from petctl_agent.checkpointing import peer
        real_send = peer.send
        def send(store, *a, **kw):
            for c in store.complete():
                os.truncate(store.data_path(c.slot), 0)
            return real_send(store, *a, **kw)
        peer.send = send
    sent, flows, real_sb = [0], set(), dist.broadcast  # data this rank sent as a source, over how many groups
    got = [0]  # and data it received
    def counting(t, src, group=None, **kw):
        if dist.get_rank() == src and t.numel() * t.element_size() >= 65536:
            sent[0] += t.numel() * t.element_size()
            flows.add(id(group))
        elif t.numel() * t.element_size() >= 65536:
            got[0] += t.numel() * t.element_size()
        return real_sb(t, src, group=group, **kw)
    dist.broadcast = counting
    t0 = time.monotonic()
    try:
        restored = ckpt.resume()
    except memory.PeerRestoreError as e:
        print("PEER_FAILED %.2f %s" % (time.monotonic() - t0, e), flush=True)
        sys.exit(3)
    def where(t):  # the file whose mapping holds t's bytes (/proc/self/maps), or "anon"
        ptr = t.untyped_storage().data_ptr()
        for line in open("/proc/self/maps").read().splitlines():
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 and parts[5].startswith("/") else "anon"
        return "anon"
    at = where(restored[0]["w"]) if restored else None
    w = restored[0]["w"].clone() if restored else torch.zeros(4)
    start = 1 if restored is None else restored[1] + 1
    total = int(os.environ["TOTAL"])
    for s in range(start, total + 1):
        w += 1
        ckpt.step(s, lambda: {"w": w.clone()}, every=0, last=s == total)
    rep = os.path.join(os.environ.get("PETCTL_SNAPSHOT_DIR") or "/nonexistent", "restore.json")
    report = json.load(open(rep)) if os.path.exists(rep) else None
    sums = {k: float(v.double().sum()) for k, v in restored[0].items()} if restored else None
    print("RESULT " + json.dumps({"start": start, "w": w[:4].tolist(), "report": report, "at": at,
                                  "sent": sent[0], "flows": len(flows), "sums": sums, "got": got[0]}), flush=True)
    """
)


def _ranks(tmp_path: Path, envs: list[dict], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    base = {"PYTHONPATH": str(REPO / "agent"), "LOCAL_RANK": "0", "PETCTL_SNAPSHOT_PEER_TIMEOUT": "10"}
    return run_ranks(
        [sys.executable, str(script)],
        [{**base, **e} for e in envs],
        timeout=timeout,
        drop=("PETCTL_DRAIN_FILE",),
    )


def _res(cp: subprocess.CompletedProcess) -> dict:
    for line in cp.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result (rc {cp.returncode}):\n{cp.stdout[-2000:]}\n{cp.stderr[-3000:]}")


def _snap(d: Path, step: int, n: int = 4) -> SnapshotStore:
    s = SnapshotStore(d, memory.NAME)
    assert s.write({"w": torch.full((n,), float(step))}, step, wait=True) == "ok"
    s.close()
    return s


def _efs_with_a_broken_step_4(efs: Path) -> None:
    """``latest`` names step 4, but its file fails its sha256: reading EFS would give nothing."""
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    f = efs / "ckpt-0000000004.pt"
    f.write_bytes(b"\0" * f.stat().st_size)


def test_newcomer_restores_from_a_survivor_without_reading_efs(tmp_path: Path) -> None:
    """Restore order, self then peer: node 0 holds step 6, node 1 (a newcomer) nothing, and EFS
    holds an older step whose file is unreadable: both ranks resume at 7 with node 0's state."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    _snap(tmp_path / "n0", 6)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "8"}
    res = [
        _res(cp)
        for cp in _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    ]
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [8.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert res[1]["report"]["step"] == 6 and res[1]["report"]["bytes"] >= 16
    assert ckpt.latest_step(efs) == 8  # the last step is durable


def test_a_node_without_a_store_takes_every_rank_to_efs_together(tmp_path: Path) -> None:
    """Node 0 holds step 6 in memory, node 1 has no store (its agent's ``snapshot_off``): the ranks
    agree before any memory collective, and every rank restores EFS's step 4 and saves there (not
    one rank gathering for a memory restore while the other gathers for EFS: gloo aborts)."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    _snap(tmp_path / "n0", 6)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6"}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")}, base])
    res = [_res(cp) for cp in cps]
    assert [r["start"] for r in res] == [5, 5]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert res[0]["report"] is None  # no memory restore ran on the node that has a store
    assert "has no memory snapshot store" in cps[0].stderr
    assert ckpt.latest_step(efs) == 6  # the last step went to EFS the old way
    assert torch.equal(ckpt.load_latest(efs)[0]["w"], torch.full((4,), 6.0))


def test_a_snapshot_write_that_fails_on_one_node_takes_every_rank_to_efs(tmp_path: Path) -> None:
    """Node 1's snapshot write raises (EIO opening its slot's file): the failure goes through the
    ranks' vote like a no-fit, and every rank writes the step to EFS (raised out of ``ckpt.step``
    on that rank alone, the other waited in the vote for the checkpoint timeout)."""
    efs = tmp_path / "efs"
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "2"}
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "FAIL_OPEN_DATA": "1"},
        ],
        timeout=60,
    )
    res = [_res(cp) for cp in cps]
    assert all(r["w"] == [2.0] * 4 for r in res)
    assert ckpt.latest_step(efs) == 2 and torch.equal(ckpt.load_latest(efs)[0]["w"], torch.full((4,), 2.0))
    fallback = json.loads((tmp_path / "n1" / memory.FALLBACK_REPORT).read_text())
    assert fallback["step"] == 2 and "Input/output error" in fallback["reason"], fallback
    assert "memory snapshot of step 2 skipped (failed: OSError" in cps[1].stderr


def test_torn_snapshot_is_never_loaded_and_efs_answers(tmp_path: Path) -> None:
    """Restore order, EFS last: node 0's step-6 snapshot has a flipped byte (its CRC fails),
    node 1 holds only step 5 (stale: not the agreed step): nobody loads memory, all load EFS."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    s0 = _snap(tmp_path / "n0", 6)
    data = s0.data_path(s0.newest().slot)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    _snap(tmp_path / "n1", 5)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6"}
    res = [
        _res(cp)
        for cp in _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    ]
    assert [r["start"] for r in res] == [5, 5]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["efs", "efs"]


def _crc_times(cp: subprocess.CompletedProcess) -> list[float]:
    return [float(x.split()[2]) for x in cp.stdout.splitlines() if x.startswith("TRACE crc ")]


def test_the_source_sends_while_it_checks_its_own_copy_and_the_newcomer_checks_as_it_receives(
    tmp_path: Path,
) -> None:
    """A newcomer never waits for the source's own load: the source sends its snapshot out of the
    mapping its restored tensors view, checking the CRCs piece by piece as the pieces go, and
    the newcomer checks each piece as it arrives (no pass of its own afterwards). With the
    source's CRC made slow (0.3 s a piece), the newcomer has checked its first piece before the
    source has checked its last. (At 1 GiB: the source's load, 0.5-1.3 s, came first;
    the newcomer waited, then checked the whole state again after the transfer.)"""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 20  # 4 MiB of float32 in 1 MiB pieces
    _snap(tmp_path / "n0", 6, n)
    base = {
        "PETCTL_CHECKPOINT_DIR": str(efs),
        "TOTAL": "6",
        "PETCTL_SNAPSHOT_CHUNK": str(1 << 20),
        "TRACE_CRC": "1",
    }
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0"), "SLOW_CRC": "0.3"},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1")},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert all(r["w"] == [6.0] * 4 for r in res)
    src, new = _crc_times(cps[0]), _crc_times(cps[1])
    # 4 pieces on each side, checked once: the newcomer's load from its store (the step is kept
    # there) makes no second pass, nor does the source's (resumed at the last step: no step runs)
    assert len(src) == 4 and len(new) == 4, (src, new)
    assert new[0] < src[3], (src, new)  # the newcomer's first piece checked before the source's last


def test_a_holder_whose_own_copy_fails_its_check_gets_the_step_from_a_peer(tmp_path: Path) -> None:
    """Holders are known by their headers, their bytes checked as they load: node 1 holds step 6
    with a flipped byte, node 0 a good copy, node 2 (a newcomer) nothing. Node 2 gets the step
    from node 0 while node 1 finds its copy bad; node 1 then gets it from node 0 too (self, then
    peer, then EFS: EFS is never needed here, and its step-4 file is unreadable anyway)."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 18
    _snap(tmp_path / "n0", 6, n)
    s1 = _snap(tmp_path / "n1", 6, n)
    data = s1.data_path(s1.newest().slot)
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0xFF
    data.write_bytes(bytes(raw))
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "7", "PETCTL_SNAPSHOT_CHUNK": str(1 << 18)}
    res = [
        _res(cp)
        for cp in _ranks(
            tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in range(3)]
        )
    ]
    assert [r["start"] for r in res] == [7, 7, 7]
    assert all(r["w"] == [7.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["self", "peer", "peer"]


def test_a_receive_that_runs_out_of_room_mid_way_frees_it_and_efs_answers(tmp_path: Path) -> None:
    """Pages allocated per piece: the newcomer's tmpfs answering ENOSPC at its third piece (the
    whole size fitted when checked) does not hang the group nor SIGBUS: it takes the rest of the
    bytes into a scratch piece, keeps nothing (its torn file removed: the memory goes back before
    the EFS load), and every rank loads EFS -- the step the holder put there first."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    n = 1 << 20  # 4 MiB in 1 MiB pieces
    _snap(tmp_path / "n0", 6, n)
    # TOTAL 4: no step runs after the restore (nor writes a snapshot)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "4", "PETCTL_SNAPSHOT_CHUNK": str(1 << 20)}
    t0 = time.monotonic()
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "FAIL_FALLOCATE_AFTER": "2"},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert time.monotonic() - t0 < 60  # never waited out a timeout
    # the holder's copy passed its checks: it put step 6 on EFS before the ranks loaded EFS
    assert ckpt.latest_step(efs) == 6
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["efs", "efs"]
    assert "step 6 from a peer not loaded (no room)" in cps[1].stderr
    n1 = tmp_path / "n1"
    assert not SnapshotStore(n1, memory.NAME).complete()
    assert sum(p.stat().st_blocks for p in n1.glob("*.bin")) == 0  # the 2 pieces it held: freed


def test_a_piece_that_arrives_changed_is_never_loaded_nor_kept_and_efs_answers(tmp_path: Path) -> None:
    """Checked as it arrives: a newcomer whose first data piece arrives with one byte changed
    finds its CRC wrong, writes no header for it (the slot stays torn: never loaded, not
    kept), and every rank loads EFS (the group agrees on it: no hang, the same step everywhere),
    where the holder, whose own copy passed its checks, put the agreed step first."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    n = 1 << 20
    _snap(tmp_path / "n0", 6, n)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 20)}
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "CORRUPT_RECV": "1"},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert ckpt.latest_step(efs) == 6  # persisted from the holder's good copy before the EFS load
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["efs", "efs"]
    assert "step 6 from a peer not loaded (CRC mismatch)" in cps[1].stderr


def _killed_mid_transfer(first: list[subprocess.CompletedProcess], killed: int, took: float) -> None:
    """Rank ``killed`` died of its SIGKILL mid-transfer; every other rank stopped with
    PeerRestoreError (exit 3), all within the peer timeout's bound (no hang)."""
    assert first[killed].returncode == -signal.SIGKILL, first[killed].stderr[-2000:]
    for r, cp in enumerate(first):
        if r != killed:
            assert cp.returncode == 3, cp.stdout[-2000:] + cp.stderr[-3000:]
            assert "PEER_FAILED" in cp.stdout and "restore from a peer's memory failed" in cp.stdout
    assert took < 60, took


def test_source_killed_mid_transfer_every_rank_exits_then_next_source_serves(tmp_path: Path) -> None:
    """The source (rank 0) is SIGKILLed in the middle of a multi-chunk broadcast: the others stop
    within the peer timeout (no hang) with PeerRestoreError; the next round, without the dead
    node, restores the newcomer from the surviving holder, still without EFS."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 3 << 20  # 12 MiB of float32 in 1 MiB broadcasts
    for r in (0, 1):
        _snap(tmp_path / f"n{r}", 6, n)
    base = {
        "PETCTL_CHECKPOINT_DIR": str(efs),
        "TOTAL": "7",
        "PETCTL_SNAPSHOT_PEER_TIMEOUT": "5",
        "PETCTL_SNAPSHOT_CHUNK": str(1 << 20),
    }
    t0 = time.monotonic()
    first = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}"), "KILL_SOURCE_AFTER": "6"}
            for r in (0, 1, 2)
        ],
    )
    _killed_mid_transfer(first, 0, time.monotonic() - t0)
    # the next round: node 1 (now rank 0) and the newcomer node 2 (rank 1)
    second = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (1, 2)])
    res = [_res(cp) for cp in second]
    assert [r["start"] for r in res] == [7, 7] and all(r["w"] == [7.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert res[1]["report"]["bytes"] >= n * 4


def test_a_rank_restored_from_a_peer_keeps_the_step_so_its_next_restart_restores_from_itself(
    tmp_path: Path,
) -> None:
    """Node 1 (a newcomer) gets step 6 from node 0 and writes it into its own store, complete (no
    checkpoint follows). Node 0 is then lost: node 1's next restart, with a second newcomer,
    restores from itself and serves the newcomer -- never EFS, whose file is unreadable."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 20  # 4 MiB
    _snap(tmp_path / "n0", 6, n)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6"}  # restore only: no step, no checkpoint
    first = [
        _res(cp)
        for cp in _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    ]
    assert [r["report"]["source"] for r in first] == ["self", "peer"]
    assert first[1]["report"]["kept_seconds"] >= 0
    kept = SnapshotStore(tmp_path / "n1", memory.NAME)
    assert kept.newest() is not None and kept.newest().step == 6  # complete: the header is in place
    assert torch.equal(kept.load(6)["w"], torch.full((n,), 6.0))  # every CRC checks
    # node 0 is gone; node 1 (now rank 0) and a newcomer, node 2
    second = _ranks(
        tmp_path, [{**base, "TOTAL": "7", "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (1, 2)]
    )
    res = [_res(cp) for cp in second]
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert [r["start"] for r in res] == [7, 7] and all(r["w"] == [7.0] * 4 for r in res)


def test_restored_tensors_are_views_of_the_nodes_own_snapshot_not_copies(tmp_path: Path) -> None:
    """No copy on the CPU: the survivor's restored tensors are views of its own snapshot's file,
    and the newcomer's of *its own* store's file -- the peer's bytes arrived straight in a slot of
    it (kept with no copy of their own, complete: its next restart restores from itself).
    Copies cost, at 1 GiB per rank, a join 3.0 s in the survivors' copy out of tmpfs into fresh memory and
    4.5 s in the newcomer's (a receive buffer, then a 1.4 s copy into its store)."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 20  # 4 MiB in 1 MiB broadcasts
    _snap(tmp_path / "n0", 6, n)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 20)}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    # where each rank's restore spent its time, on stderr (the benchmark's breakdown reads it)
    assert "rank 0 restored step 6 from self in" in cps[0].stderr and "send " in cps[0].stderr
    assert "rank 1 restored step 6 from peer in" in cps[1].stderr and "receive " in cps[1].stderr
    for r, got in enumerate(res):
        store = SnapshotStore(tmp_path / f"n{r}", memory.NAME)
        assert got["at"] == str(store.data_path(store.newest().slot)), got
        assert store.newest().step == 6 and torch.equal(store.load(6)["w"], torch.full((n,), 6.0))
    assert res[1]["report"]["kept_seconds"] == 0.0  # no copy of its own: the transfer was the keep


def test_a_newcomer_that_becomes_rank_0_has_the_restored_step_persisted(
    shm_base: Path, tmp_path: Path
) -> None:
    """EFS holds step 4; node 0 holds step 6 in memory. A newcomer (its agent's persister serving
    its store) becomes rank 0 and restores step 6 from node 0: its persister writes step 6 to EFS
    although no checkpoint follows -- EFS never lags the job by more than one persist."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    _snap(tmp_path / "n0", 6)
    area = SnapshotArea.open(shm_base, "j", "i-new", Pub())
    assert area is not None
    try:
        deadline = time.monotonic() + 10
        while not persist.served(area.dir):
            assert time.monotonic() < deadline, "the persister never took its lock"
            time.sleep(0.05)
        base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6"}  # restore only: no checkpoint
        res = [
            _res(cp)
            for cp in _ranks(
                tmp_path,
                [
                    {**base, "PETCTL_SNAPSHOT_DIR": str(area.dir)},
                    {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
                ],
            )
        ]
        assert [r["report"]["source"] for r in res] == ["peer", "self"]
        # the persister moves EFS's pointer first and reports (persist.json) just after: wait for both
        deadline = time.monotonic() + 30
        while ckpt.latest_step(efs) != 6 or persist.state(area.dir).get("step") != 6:
            assert time.monotonic() < deadline, (
                f"step 6 never reached EFS (latest {ckpt.latest_step(efs)}, reported {persist.state(area.dir)})"
            )
            time.sleep(0.1)
        state, step = ckpt.load_latest(efs, map_location="cpu")
        assert step == 6 and torch.equal(state["w"], torch.full((4,), 6.0))
        assert persist.state(area.dir)["pid"] == area.persister.pid  # the newcomer's persister wrote it
    finally:
        area.close()


def test_a_newcomer_rank_0_whose_memory_cannot_keep_the_step_writes_it_to_efs(tmp_path: Path) -> None:
    """As above, but the newcomer's node has no memory to spare (MemAvailable, through the test-only
    PETCTL_SNAPSHOT_MEMINFO): it does not keep the step, so rank 0 writes step 6 to EFS itself
    before training goes on, and says so."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    _snap(tmp_path / "n0", 6)
    full = tmp_path / "meminfo-full"
    full.write_text("MemTotal:       8388608 kB\nMemAvailable:          0 kB\n")
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6"}
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "PETCTL_SNAPSHOT_MEMINFO": str(full)},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["peer", "self"]
    assert ckpt.latest_step(efs) == 6  # on EFS when the worker exits: written synchronously
    assert "not held in this node's memory; writing it to EFS directly" in cps[0].stderr
    assert SnapshotStore(tmp_path / "n1", memory.NAME).newest() is None
    assert json.loads((tmp_path / "n1" / memory.FALLBACK_REPORT).read_text())["step"] == 6


# ------------------------------------------------------------------ the agent's store


class Pub:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **data) -> None:
        self.events.append((kind, data))


@pytest.fixture
def shm_base() -> Path:
    base = Path("/dev/shm") / f"petctl-test-{os.getpid()}-{time.monotonic_ns()}"
    if snapshots.fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    yield base
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def test_file_names_match_the_workers_side() -> None:
    assert snapshots.NAME == memory.NAME
    assert snapshots.RESTORE_REPORT == memory.RESTORE_REPORT
    assert snapshots.FALLBACK_REPORT == memory.FALLBACK_REPORT
    assert snapshots.PERSIST_STATE == persist.STATE


def test_store_off_with_a_warning_when_not_on_tmpfs(tmp_path: Path) -> None:
    if snapshots.fs_type(tmp_path) == "tmpfs":
        pytest.skip("tmp_path is a tmpfs here")
    pub = Pub()
    assert SnapshotArea.open(tmp_path / "shm", "j", "i-1", pub) is None
    assert pub.events[0][0] == "snapshot_off" and "not a tmpfs" in pub.events[0][1]["reason"]
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    assert snapshots.fs_type(Path("/dev/shm/petctl/x"), str(mounts)) == "tmpfs"
    assert snapshots.fs_type(Path("/dev/shmx"), str(mounts)) == "ext4"


def test_persistence_by_the_agent_survives_a_worker_killed_after_its_snapshot(
    shm_base: Path, tmp_path: Path
) -> None:
    """The worker asks for step 2 and is SIGKILLed right after its copy; the agent's persister
    writes it to EFS anyway. Then the node leaves: persister stopped, store gone, a stale
    sibling (an agent that was SIGKILLed) swept by the next agent."""
    pub = Pub()
    stale = shm_base / "j" / "i-dead"
    stale.mkdir(parents=True)
    (stale / snapshots.OWNER_LOCK).write_text("")
    area = SnapshotArea.open(shm_base, "j", "i-1", pub)
    assert area is not None and area.dir == shm_base / "j" / "i-1" and not stale.exists()
    efs = tmp_path / "efs"
    worker = textwrap.dedent(
        """
        import os, signal, torch
        from petctl_agent import checkpoint as ckpt
        from petctl_agent.checkpointing import memory, memory_store
        ckpt.step(2, lambda: {"w": torch.full((1 << 20,), 2.0)}, every=2)  # returns after the copy
        memory_store.store_of(memory.snapshot_dir()).flush()  # the snapshot is complete (header in place)
        os.kill(os.getpid(), signal.SIGKILL)  # a worker restart: the persist is not the worker's
        """
    )
    deadline = time.monotonic() + 10
    while not persist.served(area.dir):
        assert time.monotonic() < deadline, "the persister never took its lock"
        time.sleep(0.05)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "agent"),
        "PETCTL_SNAPSHOT_DIR": str(area.dir),
        "PETCTL_CHECKPOINT_DIR": str(efs),
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PETCTL_DRAIN_FILE", "PETCTL_PROGRESS_FILE"):
        env.pop(k, None)
    cp = subprocess.run([sys.executable, "-c", worker], env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == -signal.SIGKILL, cp.stderr[-2000:]
    deadline = time.monotonic() + 30
    while ckpt.latest_step(efs) != 2 or persist.state(area.dir).get("step") != 2:  # pointer, then report
        assert time.monotonic() < deadline, "the agent's persister did not persist step 2"
        time.sleep(0.1)
    state, step = ckpt.load_latest(efs, map_location="cpu")
    assert step == 2 and torch.equal(state["w"], torch.full((1 << 20,), 2.0))
    assert persist.state(area.dir)["pid"] == area.persister.pid  # written by the agent's persister
    p = area.persister
    area.close()
    assert p.poll() is not None and not area.dir.exists() and not (shm_base / "j").exists()


def test_a_store_is_made_when_another_node_of_the_job_removes_the_job_directory_meanwhile(
    shm_base: Path, monkeypatch
) -> None:
    """Two nodes of one job on one machine (the local cloud): the other node's ``close()`` removes
    the job's directory, empty, just before this one makes its store in it. The store is made
    (it was off, ENOENT, and that node's workers then took other collectives than the rest)."""
    pub, real, cut = Pub(), snapshots.shutil.rmtree, []

    def rmtree(path, *a, **kw):
        real(path, *a, **kw)
        if Path(path) == shm_base / "j" / "i-1" and not cut:
            cut.append(path)
            (shm_base / "j").rmdir()  # the other node's close(): the job's directory, empty

    monkeypatch.setattr(snapshots.shutil, "rmtree", rmtree)
    area = SnapshotArea.open(shm_base, "j", "i-1", pub)
    assert cut, "the interleaving did not happen"
    assert area is not None, pub.events
    try:
        assert (area.dir / snapshots.OWNER_LOCK).exists() and not pub.events
    finally:
        area.close()


def test_no_fit_falls_back_to_efs_and_warns_in_status(shm_base: Path, tmp_path: Path, monkeypatch) -> None:
    pub = Pub()
    area = SnapshotArea.open(shm_base, "j", "i-2", pub)
    assert area is not None
    efs = tmp_path / "efs"
    monkeypatch.setenv("PETCTL_SNAPSHOT_DIR", str(area.dir))
    monkeypatch.setenv("PETCTL_CHECKPOINT_DIR", str(efs))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PETCTL_DRAIN_FILE", "PETCTL_PROGRESS_FILE"):
        monkeypatch.delenv(k, raising=False)
    # this node's memory is full: MemAvailable 0
    memory_store.stores[str(area.dir)] = SnapshotStore(
        area.dir, memory.NAME, meminfo=lambda: {"MemAvailable": 0, "MemTotal": 1 << 30}
    )
    try:
        ckpt.step(2, lambda: {"w": torch.ones(8)}, every=2)
        assert ckpt.latest_step(efs) == 2  # written synchronously, as today
        assert SnapshotStore(area.dir, memory.NAME).newest() is None
        area.publish_reports()
        kinds = [k for k, _ in pub.events]
        assert "snapshot_fallback" in kinds
        data = dict(pub.events)["snapshot_fallback"]
        assert data["step"] == 2 and "no-fit" in data["reason"]
        area.publish_reports()  # once per report
        assert [k for k, _ in pub.events].count("snapshot_fallback") == 1
    finally:
        memory.close_persisters()
        area.close()


NO_FIT_WORKER = textwrap.dedent(
    """
    import torch
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.checkpointing import memory, memory_store
    ckpt.step(2, lambda: {"w": torch.full((16 << 20,), 2.0)}, every=2)  # 64 MiB
    memory_store.store_of(memory.snapshot_dir()).flush()  # a snapshot taken is complete before we exit
    """
)


def test_a_snapshot_that_memavailable_cannot_hold_is_never_attempted(shm_base: Path, tmp_path: Path) -> None:
    """The fit check reads MemAvailable (here a fake /proc/meminfo, PETCTL_SNAPSHOT_MEMINFO): 560 MiB
    available cannot hold 64 MiB on top of the 512 MiB reserve, so the worker never makes the
    snapshot's file (nothing reserved, nothing copied: the node is not pushed toward OOM), writes
    step 2 to EFS synchronously, and the agent publishes snapshot_fallback, which status shows.
    With 1 GiB available the same worker snapshots to memory."""
    from petctl import render

    def run(avail_kib: int, node: str) -> tuple[SnapshotArea, Pub, Path]:
        pub = Pub()
        area = SnapshotArea.open(shm_base, "j", node, pub)
        assert area is not None
        mi = tmp_path / f"meminfo-{node}"
        mi.write_text(f"MemTotal:       8388608 kB\nMemAvailable:   {avail_kib} kB\n")
        efs = tmp_path / f"efs-{node}"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "agent"),
            "PETCTL_SNAPSHOT_DIR": str(area.dir),
            "PETCTL_CHECKPOINT_DIR": str(efs),
            "PETCTL_SNAPSHOT_MEMINFO": str(mi),
        }
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PETCTL_DRAIN_FILE", "PETCTL_PROGRESS_FILE"):
            env.pop(k, None)
        cp = subprocess.run(
            [sys.executable, "-c", NO_FIT_WORKER], env=env, capture_output=True, text=True, timeout=120
        )
        assert cp.returncode == 0, cp.stderr[-2000:]
        return area, pub, efs

    area, pub, efs = run(560 << 10, "i-full")
    try:
        assert not list(area.dir.glob("replicated.*.bin"))  # never made, never reserved
        assert not list(area.dir.glob("replicated.*.json"))
        assert ckpt.latest_step(efs) == 2  # written to EFS before ckpt.step returned
        area.publish_reports()
        ev = [d for k, d in pub.events if k == "snapshot_fallback"]
        assert len(ev) == 1 and ev[0]["step"] == 2 and "no-fit" in ev[0]["reason"], pub.events
        assert "available (reserve 0.50 GiB)" in ev[0]["reason"]
        shown = render._event_extra({"kind": "snapshot_fallback", **ev[0]})
        assert "step=2" in shown and "memory snapshot skipped (no-fit" in shown
    finally:
        area.close()
    area, pub, efs = run(1 << 20, "i-room")
    try:  # the same state with room for it: a snapshot in memory, no fallback
        assert SnapshotStore(area.dir, memory.NAME).newest().step == 2
        area.publish_reports()
        assert not [k for k, _ in pub.events if k == "snapshot_fallback"]
    finally:
        area.close()


def test_the_agent_passes_a_restores_sources_on_in_its_event(tmp_path: Path) -> None:
    """restore.json as a sharded restore writes it: the event carries the shards' sources and the
    step gone back to (the agent's side only; no persister is started)."""
    pub = Pub()
    area = SnapshotArea(tmp_path, pub)
    body = {
        "source": "peer",
        "step": 6,
        "bytes": 100,
        "seconds": 0.5,
        "shards": {"self": [1], "peer": [0]},
        "newest": 8,
        "back_to": 6,
        "kept_seconds": 0.1,
        "received": 2048,  # the byte ranges a sharded restore took from its peers
        "t": 1.0,
        "junk": 1,
    }
    (tmp_path / memory.RESTORE_REPORT).write_text(json.dumps(body))
    area.publish_reports()
    ((kind, data),) = pub.events
    assert kind == "snapshot_restored"
    assert data == {k: v for k, v in body.items() if k not in ("t", "junk")}


@pytest.mark.e2e
@pytest.mark.parametrize("fetch", [True, False], ids=["agent-fetch", "gloo"])
def test_agents_own_the_store_newcomer_restores_from_a_peer_store_freed_on_leave(
    make_cluster, shm_base: Path, fetch: bool
) -> None:
    """Real agents (petctl-etcd), real workers: a join is restored from the survivors' memory
    (events self/peer in status), a drained node's store is gone once it left, and so are the others'.

    The newcomer's copy comes from its agent's fetch as the round closed (``prefetch``: the
    survivors' persisters served it, checkpointing/fetch.py), or, with that switched off
    (``PETCTL_AGENT_NO_SNAPSHOT_FETCH=1``), from its workers' restore over gloo (``peer``)."""
    from harness import wait_for

    env = {"PETCTL_COLLECTIVE_TIMEOUT": "30", "PETCTL_AGENT_SNAPSHOT_DIR": str(shm_base)}
    if not fetch:
        env["PETCTL_AGENT_NO_SNAPSHOT_FETCH"] = "1"
    c = make_cluster(
        job="memrestore",
        min_nodes=2,
        max_nodes=3,
        script_args=["--total-steps", "100000", "--step-time", "0.05", "--checkpoint-every", "20"],
        extra_env=env,
    )
    a, b = c.add_node(), c.add_node()
    c.wait(lambda: c.all_at_world([a, b], 2, 0, min_steps=3), 120, "2 nodes stepping", alive=[a, b])
    store = {n.instance_id: shm_base / "memrestore" / n.instance_id for n in (a, b)}
    assert all(d.is_dir() for d in store.values())
    t = c.now()
    n3 = c.add_node()
    c.wait(
        lambda: c.all_at_world([a, b, n3], 3, t, min_steps=3), 120, "world 3 after a join", alive=[a, b, n3]
    )

    def restored(n):
        ev = [
            e for e in (c.status(n.instance_id) or {}).get("events", []) if e["kind"] == "snapshot_restored"
        ]
        return ev[-1] if ev and ev[-1]["t"] >= t else None

    got = {
        n.instance_id: c.wait(lambda n=n: restored(n), 30, "restore events", alive=[a, b, n3])
        for n in (a, b, n3)
    }
    assert got[n3.instance_id]["source"] == ("prefetch" if fetch else "peer"), got
    assert got[n3.instance_id]["bytes"] > 0, got
    fetched = shm_base / "memrestore" / n3.instance_id / "fetched.json"
    if fetch:  # the agent's fetch: one process, the bytes from both survivors' servers
        f = json.loads(fetched.read_text())
        assert f["status"] == "ok" and f["step"] == got[n3.instance_id]["step"] and f["holders"] == 2, f
    else:
        assert not fetched.exists()
    assert got[a.instance_id]["source"] == "self" and got[b.instance_id]["source"] == "self", got
    assert len({e["step"] for e in got.values()}) == 1
    # the survivors' snapshots are vouched for once their old workers were gone (the
    # agent's check; now the writer's seal, which that check takes); the newcomer's agent started
    # its first workers: nothing to check -- the record there is its receiving worker's own seal
    # (the bytes checked as they arrived), which counts once that worker is gone
    assert all((store[n.instance_id] / "replicated.verified.json").exists() for n in (a, b))
    rec = shm_base / "memrestore" / n3.instance_id / "replicated.verified.json"
    assert "writer" in json.loads(rec.read_text()), rec.read_text()
    for n in (a, b):  # the stop's worker sealed its snapshot and exited: the agent made no pass
        err = (n.agent_dir / "agent.err").read_text(errors="replace")
        said = [ln for ln in err.splitlines() if ln.startswith("petctl verify: ")]
        # sealed by its writer, or (a verifier that started after the new workers' next snapshot)
        # superseded: either way no pass over the bytes
        assert any("no pass" in s for s in said), said
        assert not [s for s in said if " checked in " in s], err[-3000:]
    c.terminate(b)
    assert wait_for(lambda: b.proc.poll() is not None, 60, "drained agent to exit") is not None
    assert b.proc.returncode == 0 and not store[b.instance_id].exists()
    assert store[a.instance_id].is_dir()  # the survivors keep theirs
    for n in (a, n3):
        c.terminate(n)
    for n in (a, n3):
        assert wait_for(lambda n=n: n.proc.poll() is not None, 60, "agents to exit") is not None
    assert not (shm_base / "memrestore").exists()


DRAINING_WORKER = textwrap.dedent(
    """
    import torch
    from petctl_agent import checkpoint as ckpt
    ckpt.step(5, lambda: {"w": torch.full((1 << 18,), 5.0)}, every=0)  # the drain file is there
    raise SystemExit("not reached: an agreed drain exits with 75")
    """
)


def test_a_joins_stop_waits_for_memory_only_a_leave_waits_for_efs(shm_base: Path, tmp_path: Path) -> None:
    import fcntl

    from petctl_agent import DRAIN_EXIT_CODE

    def run(sdir: Path, efs: Path, drain_body: str) -> subprocess.CompletedProcess:
        drain = tmp_path / f"drain-{drain_body.strip() or 'stop'}"
        drain.write_text(drain_body)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "agent"),
            "PETCTL_SNAPSHOT_DIR": str(sdir),
            "PETCTL_CHECKPOINT_DIR": str(efs),
            "PETCTL_DRAIN_FILE": str(drain),
        }
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PETCTL_PROGRESS_FILE"):
            env.pop(k, None)
        return subprocess.run(
            [sys.executable, "-c", DRAINING_WORKER], env=env, capture_output=True, text=True, timeout=120
        )

    # a join's stop: a persister "serves" the store (we hold its lock) but never writes: the
    # worker exits at once, its snapshot complete, nothing on EFS yet
    sdir = shm_base / "stop"
    sdir.mkdir(parents=True)
    fd = os.open(sdir / persist.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        cp = run(sdir, tmp_path / "efs-stop", "")
    finally:
        os.close(fd)
    assert cp.returncode == DRAIN_EXIT_CODE, cp.stderr[-2000:]
    assert SnapshotStore(sdir, memory.NAME).newest().step == 5
    assert json.loads((sdir / persist.REQUEST).read_text())["step"] == 5
    assert ckpt.latest_step(tmp_path / "efs-stop") is None
    # a node leaves: the worker exits only once the agent's persister put step 5 on EFS
    area = SnapshotArea.open(shm_base, "j", "i-3", Pub())
    try:
        cp = run(area.dir, tmp_path / "efs-leave", "leave\n")
        assert cp.returncode == DRAIN_EXIT_CODE, cp.stderr[-2000:]
        assert ckpt.latest_step(tmp_path / "efs-leave") == 5
    finally:
        area.close()


@pytest.mark.e2e
def test_store_freed_at_job_end(make_cluster, shm_base: Path) -> None:
    """A one-node job that runs to its end: the store existed while it trained and is gone once
    the agent says SUCCEEDED; the last step is on EFS (the last step waits for the persister)."""
    from harness import wait_for

    c = make_cluster(
        job="memend",
        min_nodes=1,
        max_nodes=1,
        script_args=["--total-steps", "60", "--step-time", "0.05", "--checkpoint-every", "10"],
        extra_env={"PETCTL_AGENT_SNAPSHOT_DIR": str(shm_base)},
    )
    a = c.add_node()
    store = shm_base / "memend" / a.instance_id
    # steps 10..60 take >= 2.5 s: the store holds a snapshot meanwhile
    assert wait_for(lambda: (store / "replicated.a.json").exists(), 120, "a snapshot in the store")
    assert wait_for(lambda: a.proc.poll() is not None, 120, "the job to end") is not None
    assert a.proc.returncode == 0 and (c.status(a.instance_id) or {}).get("state") == "SUCCEEDED"
    assert not store.exists() and not (shm_base / "memend").exists()
    assert ckpt.latest_step(c.ckpt_dir) == 60


# ------------------------------------------------------------------ retries and sources (review of s26)


def _corrupt(d: Path, step: int, n: int) -> None:
    """A complete snapshot of ``step`` in ``d`` whose data has one byte flipped (its CRC fails)."""
    s = _snap(d, step, n)
    data = s.data_path(s.newest().slot)
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_the_retry_comes_from_a_store_that_holds_the_step_not_a_receivers_buffer(tmp_path: Path) -> None:
    """Rank 0 is a newcomer whose node has no room (it receives into a plain buffer, keeps
    nothing), rank 1 holds a good step 6, rank 2 a corrupt one. Attempt 1: rank 1 sends to rank
    0, rank 2 finds its copy bad. The retry for rank 2 must come from rank 1, whose store holds
    the step -- not rank 0, the lowest rank with a state, whose store lacks it (before: rank 0
    announced nothing, every rank fell back to EFS's step 4, and rank 0 was "persisting" a step
    it never held)."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 4.0)}, 4, efs)
    n = 1 << 18
    _snap(tmp_path / "n1", 6, n)
    _corrupt(tmp_path / "n2", 6, n)
    full = tmp_path / "meminfo-full"
    full.write_text("MemTotal:       8388608 kB\nMemAvailable:          0 kB\n")
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "7", "PETCTL_SNAPSHOT_CHUNK": str(1 << 18)}
    t0 = time.monotonic()
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0"), "PETCTL_SNAPSHOT_MEMINFO": str(full)},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n2")},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert time.monotonic() - t0 < 60
    assert [r["report"]["source"] for r in res] == ["peer", "self", "peer"], res
    assert [r["start"] for r in res] == [7, 7, 7], res
    assert all(r["w"] == [7.0] * 4 for r in res)
    assert SnapshotStore(tmp_path / "n0", memory.NAME).newest() is None  # rank 0's node kept nothing


def test_a_source_whose_own_copy_is_corrupt_is_replaced_by_another_holder(tmp_path: Path) -> None:
    """Rank 0, the lowest holder and so the source, holds step 6 with a flipped byte; rank 1 a
    good copy; rank 2 nothing. Every receiver of rank 0's bytes fails, and so does rank 0: one
    more transfer, from rank 1, restores both (before: every rank fell back to EFS)."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 18
    _corrupt(tmp_path / "n0", 6, n)
    _snap(tmp_path / "n1", 6, n)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "7", "PETCTL_SNAPSHOT_CHUNK": str(1 << 18)}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in range(3)])
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["peer", "self", "peer"], res
    assert [r["start"] for r in res] == [7, 7, 7], res
    assert all(r["w"] == [7.0] * 4 for r in res)


def test_a_transfer_longer_than_the_peer_timeout_does_not_fail_the_holders_outside_it(
    tmp_path: Path,
) -> None:
    """Rank 0 sends step 6 to rank 2 (a newcomer) in 4 pieces, its CRC made slow (1 s a piece),
    with PETCTL_SNAPSHOT_PEER_TIMEOUT 2 s: every piece arrives within the timeout, the whole
    transfer does not. Rank 1, a holder outside the transfer, waits for it at the end; that wait
    is bounded per piece too (before: one peer timeout, so it raised PeerRestoreError after 2 s
    and every rank exited)."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    n = 1 << 20  # 4 MiB of float32 in 1 MiB pieces
    for r in (0, 1):
        _snap(tmp_path / f"n{r}", 6, n)
    base = {
        "PETCTL_CHECKPOINT_DIR": str(efs),
        "TOTAL": "6",
        "PETCTL_SNAPSHOT_CHUNK": str(1 << 20),
        "PETCTL_SNAPSHOT_PEER_TIMEOUT": "2",
        "TRACE_CRC": "1",
    }
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0"), "SLOW_CRC": "1.0"},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n2")},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["self", "self", "peer"], res
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert res[0]["report"]["seconds"] > 2  # the transfer outlasted one peer timeout


# ------------------------------------------------------------------ the agent's verification


def _agent_verifies(d: Path) -> None:
    """What the agent runs once its old workers are gone (node/snapshots.py ``verify``)."""
    subprocess.run(
        [sys.executable, "-m", "petctl_agent.checkpointing.persist", "--verify", str(d), memory.NAME],
        env={**os.environ, "PYTHONPATH": str(REPO / "agent")},
        check=True,
        timeout=60,
    )
    assert (d / f"{memory.NAME}.verified.json").exists()


def test_a_verifier_that_starts_after_a_newer_snapshot_leaves_it_alone(tmp_path: Path) -> None:
    """The agent asked for step 5 (what its old workers left), but the verifier started late, after
    a new worker wrote step 6: no pass over step 6's bytes (its writer seals it), no record."""
    d = tmp_path / "n0"
    _snap(d, 5)
    _snap(d, 6)
    cmd = [
        sys.executable,
        "-m",
        "petctl_agent.checkpointing.persist",
        "--verify",
        "--step",
        "5",
        str(d),
        memory.NAME,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=60)
    assert "step 5 superseded by step 6: no pass" in cp.stderr, cp.stderr
    rec = d / f"{memory.NAME}.verified.json"
    assert "writer" in json.loads(rec.read_text())  # the writer's seal stands, no verification's record
    rec.unlink()
    cp = subprocess.run(
        cmd[:5] + ["6", *cmd[6:]], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    assert "step 6 (slot" in cp.stderr and " checked in " in cp.stderr, cp.stderr  # still the newest: checked
    assert "writer" not in json.loads(rec.read_text())


def test_a_restore_from_self_skips_the_crc32_pass_the_agent_already_made(tmp_path: Path) -> None:
    """Both nodes hold step 6 (4 data tensors' worth of bytes traced by TRACE_CRC) and their agents
    verified it while the workers started: the restore from self loads it without a CRC pass of
    its own (the code before made one on every rank: fails here). Nothing trains after it (TOTAL 6),
    and EFS has step 6 too (no persist of it, whose own check would be traced)."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 6.0)}, 6, efs)
    n = 1 << 16  # 256 KiB: over TRACE_CRC's threshold (a header's CRC is not traced)
    for r in (0, 1):
        _snap(tmp_path / f"n{r}", 6, n)
        _agent_verifies(tmp_path / f"n{r}")
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "TRACE_CRC": "1"}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    res = [_res(cp) for cp in cps]
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["self", "self"]
    assert [_crc_times(cp) for cp in cps] == [[], []]


def test_a_snapshot_changed_after_the_agents_verification_is_still_caught(tmp_path: Path) -> None:
    """Node 0's step-6 snapshot passed the agent's check, then a byte of it changed in place (a
    write into the file): its restore must not trust the record -- it checks the bytes, finds the
    CRC wrong and gets the step from node 1, whose verified copy loads with no pass. Node 1's
    record is for a snapshot rewritten afterwards through the store (a new generation, the same
    step): checked in full, and it passes. EFS has step 6 too (no persist traced)."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 6.0)}, 6, efs)
    n = 1 << 16
    for r in (0, 1):
        _snap(tmp_path / f"n{r}", 6, n)
        _agent_verifies(tmp_path / f"n{r}")
    s0 = SnapshotStore(tmp_path / "n0", memory.NAME)
    data = s0.data_path(s0.newest().slot)
    before = data.stat().st_mtime_ns
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # tmpfs stamps to the clock's tick: let one pass
        time.sleep(0.01)
        probe = tmp_path / "tick"
        probe.write_bytes(b"")
        if probe.stat().st_mtime_ns > before:
            break
    with open(data, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0xFF]))
    assert data.stat().st_mtime_ns > before
    # node 1: rewritten through the store after its record (slot b, then a again: a new generation)
    s1 = SnapshotStore(tmp_path / "n1", memory.NAME)
    rec = json.loads((tmp_path / "n1" / f"{memory.NAME}.verified.json").read_bytes())
    for _ in range(2):
        assert s1.write({"w": torch.full((n,), 6.0)}, 6, wait=True) == "ok"
    s1.close()
    assert s1.newest().slot == rec["slot"] and s1.newest().gen != rec["gen"]
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "TRACE_CRC": "1"}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    res = [_res(cp) for cp in cps]
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["peer", "self"]
    assert _crc_times(cps[0])  # node 0 checked its own copy (and found it changed)


def test_a_source_the_agent_verified_sends_without_a_pass_and_the_newcomer_still_checks(
    tmp_path: Path,
) -> None:
    """A join: node 0's step 6 passed its agent's check; rank 1 (a newcomer) holds nothing. The
    source sends its bytes with no CRC pass of its own (before: one per piece as they went; fails
    here), the newcomer checks every piece as it arrives and keeps the step."""
    efs = tmp_path / "efs"
    ckpt.save({"w": torch.full((4,), 6.0)}, 6, efs)
    n = 1 << 16
    _snap(tmp_path / "n0", 6, n)
    _agent_verifies(tmp_path / "n0")
    (tmp_path / "n1").mkdir()
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "TRACE_CRC": "1"}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1)])
    res = [_res(cp) for cp in cps]
    assert [r["start"] for r in res] == [7, 7]
    assert all(r["w"] == [6.0] * 4 for r in res)
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert _crc_times(cps[0]) == [] and _crc_times(cps[1])


# ------------------------------------------------------------------ striped transfers


def _many(d: Path, step: int, salt: float = 0.0, k: int = 8, n: int = 1 << 16) -> int:
    """Step ``step`` in ``d``: ``w`` (4 floats, as ``_snap``) and ``k`` tensors of ``n`` floats
    (256 KiB each), values set by ``salt``. Returns the snapshot's size."""
    s = SnapshotStore(d, memory.NAME)
    state = {"w": torch.full((4,), float(step))}
    state.update({f"x{i}": torch.full((n,), step * 100.0 + i + salt) for i in range(k)})
    assert s.write(state, step, wait=True) == "ok"
    size = s.newest().header["size"]
    s.close()
    return size


def test_stripes_tile_the_snapshot_on_tensor_boundaries() -> None:
    from petctl_agent.checkpointing.stripes import cut

    metas = [{"offset": o, "nbytes": 100} for o in (0, 128, 256, 384)]
    assert cut(metas, 512, 2) == [(0, 256), (256, 256)]
    assert cut(metas, 512, 4) == [(0, 128), (128, 128), (256, 128), (384, 128)]
    assert cut(metas, 512, 8) == [(0, 128), (128, 128), (256, 128), (384, 128)] + [(512, 0)] * 4
    assert cut(metas, 512, 1) == [(0, 512)]
    assert cut([{"offset": 0, "nbytes": 1 << 30}], 1 << 30, 4) == [(0, 1 << 30)] + [(1 << 30, 0)] * 3
    assert cut([], 0, 3) == [(0, 0)] * 3
    uneven = [{"offset": o, "nbytes": 64} for o in (0, 64, 128, 192, 256, 320, 384, 448, 512, 960)]
    got = cut(uneven, 1024, 3)
    assert len(got) == 3 and got[0][0] == 0 and sum(n for _, n in got) == 1024
    assert all(lo in {m["offset"] for m in uneven} for lo, n in got if n)


def test_a_newcomer_takes_stripes_from_every_holder_of_the_same_snapshot_at_once(tmp_path: Path) -> None:
    """Nodes 0 and 1 hold the same step 6 (9 tensors); node 2 holds nothing. Its restore comes in 4
    stripes over 4 groups (4 flows), 2 from each holder, at once: each holder sends about half the
    bytes (before: node 0 sent all of it over one group). The newcomer's state is the holders'."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    size = [_many(tmp_path / f"n{r}", 6) for r in (0, 1)][0]
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1, 2)])
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["self", "self", "peer"], res
    assert res[2]["sums"] == res[0]["sums"] == res[1]["sums"] and len(res[2]["sums"]) == 9
    assert res[2]["sent"] == 0
    assert [r["flows"] for r in res[:2]] == [2, 2], res
    assert all(size // 4 <= r["sent"] <= size * 3 // 4 for r in res[:2]), (size, [r["sent"] for r in res])


def test_only_holders_of_the_very_same_snapshot_serve_stripes(tmp_path: Path) -> None:
    """Node 1 holds step 6 too, but other bytes (its CRCs differ): stitching its stripes to node
    0's would make a state nobody had. Node 0 alone sends, over 4 flows (several flows from one
    survivor lift AWS's per-flow cap as well), and node 1 is no holder: it receives node 0's copy
    too, never loads its own (issue 29: the replicas diverged), so every rank has node 0's state."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    _many(tmp_path / "n0", 6)
    _many(tmp_path / "n1", 6, salt=0.5)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    cps = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 1, 2)])
    res = [_res(cp) for cp in cps]
    assert [r["report"]["source"] for r in res] == ["self", "peer", "peer"], res
    assert res[2]["sums"] == res[0]["sums"] == res[1]["sums"]
    assert res[1]["sent"] == 0 and res[0]["flows"] == 4, res


def test_a_stripe_source_killed_mid_transfer_every_rank_exits_then_the_other_serves(tmp_path: Path) -> None:
    """Node 1, the second holder, is SIGKILLed while it sends its stripes: every other rank stops
    within the peer timeout with PeerRestoreError (no hang); the next round restores the newcomer
    from node 0, still without EFS."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    for r in (0, 1):
        _many(tmp_path / f"n{r}", 6, n=1 << 18)  # 1 MiB tensors, sent in 64 KiB pieces
    base = {
        "PETCTL_CHECKPOINT_DIR": str(efs),
        "TOTAL": "6",
        "PETCTL_SNAPSHOT_PEER_TIMEOUT": "5",
        "PETCTL_SNAPSHOT_CHUNK": str(1 << 16),
    }
    t0 = time.monotonic()
    first = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "KILL_SOURCE_AFTER": "12"},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n2")},
        ],
    )
    _killed_mid_transfer(first, 1, time.monotonic() - t0)
    assert not (tmp_path / "n2" / f"{memory.NAME}.a.json").exists()  # nothing torn was kept
    second = _ranks(tmp_path, [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / f"n{r}")} for r in (0, 2)])
    res = [_res(cp) for cp in second]
    assert [r["report"]["source"] for r in res] == ["self", "peer"]
    assert res[1]["sums"] == res[0]["sums"] and res[0]["flows"] == 4


def test_the_streams_setting_is_bounded_and_says_what_it_used(monkeypatch, capsys) -> None:
    from petctl_agent.checkpointing.stripes import streams

    for raw, want in (("", 4), ("1", 1), ("16", 16), ("64", 16), ("0", 4), ("four", 4)):
        monkeypatch.setenv("PETCTL_SNAPSHOT_STREAMS", raw)
        assert streams() == want, raw
    err = capsys.readouterr().err
    assert "PETCTL_SNAPSHOT_STREAMS='64' is not a whole number from 1 to 16; using 16" in err
    assert "'four'" in err and "'1'" not in err


def test_a_stripe_source_whose_copy_went_says_so_and_the_step_comes_from_the_other(tmp_path: Path) -> None:
    """Node 1 held step 6 when the ranks compared, but its file is gone by the time it sends its
    stripes: it announces that on each of its groups (no receiver waits out a timeout), the
    newcomer's receive fails its tiling, and one more transfer from node 0 serves both node 1 and
    the newcomer: every rank restores node 0's step 6, without EFS."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    for r in (0, 1):
        _many(tmp_path / f"n{r}", 6)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    t0 = time.monotonic()
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n0")},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n1"), "VANISH_BEFORE_SEND": "1"},
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / "n2")},
        ],
    )
    res = [_res(cp) for cp in cps]
    assert time.monotonic() - t0 < 30  # never waited out the 10 s peer timeout per piece
    assert [r["report"]["source"] for r in res] == ["self", "peer", "peer"], res
    assert res[0]["sums"] == res[1]["sums"] == res[2]["sums"] and len(res[0]["sums"]) == 9
    assert "not loaded (a stripe's source had nothing to send)" in cps[2].stderr, cps[2].stderr[-2000:]


def test_one_rank_per_node_takes_the_bytes_off_the_network_and_its_node_loads_that_copy(
    tmp_path: Path,
) -> None:
    """Two nodes of two ranks each (ranks sharing a store share a node): node A holds step 6, node
    B nothing. Only B's local rank 0 receives the snapshot over the network, into B's store; B's
    local rank 1 loads that copy (before: both received it, and the broadcast among them sent
    the source's bytes twice). Every rank has A's state."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    size = _many(tmp_path / "A", 6)
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    ranks = [("A", 0), ("A", 1), ("B", 0), ("B", 1)]
    cps = _ranks(
        tmp_path,
        [{**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / n), "LOCAL_RANK": str(lr)} for n, lr in ranks],
    )
    res = [_res(cp) for cp in cps]
    assert res[0]["sums"] == res[1]["sums"] == res[2]["sums"] == res[3]["sums"] and len(res[3]["sums"]) == 9
    assert res[2]["got"] >= size - (1 << 16) and res[3]["got"] == 0, [
        r["got"] for r in res
    ]  # (w: under the count)
    assert res[2]["report"]["source"] == "peer"  # B's report (its local rank 0's)
    assert "restored step 6 from peer" in cps[3].stderr, cps[3].stderr[-2000:]
    assert sum(r["sent"] for r in res[:2]) < 2 * size  # A sent the bytes once, not once per B rank


def test_when_a_nodes_receiver_cannot_keep_the_step_its_other_ranks_receive_it_themselves(
    tmp_path: Path,
) -> None:
    """As above, but node B has no memory to spare (PETCTL_SNAPSHOT_MEMINFO): its local rank 0
    receives into a plain buffer and keeps nothing, so there is no copy for its local rank 1 to
    load; that rank gets the step in one more transfer, over the network. Every rank has A's
    state, none reads EFS."""
    efs = tmp_path / "efs"
    _efs_with_a_broken_step_4(efs)
    size = _many(tmp_path / "A", 6)
    full = tmp_path / "meminfo-full"
    full.write_text("MemTotal:       8388608 kB\nMemAvailable:          0 kB\n")
    base = {"PETCTL_CHECKPOINT_DIR": str(efs), "TOTAL": "6", "PETCTL_SNAPSHOT_CHUNK": str(1 << 16)}
    b = {"PETCTL_SNAPSHOT_MEMINFO": str(full)}
    ranks = [("A", 0, {}), ("A", 1, {}), ("B", 0, b), ("B", 1, b)]
    cps = _ranks(
        tmp_path,
        [
            {**base, "PETCTL_SNAPSHOT_DIR": str(tmp_path / n), "LOCAL_RANK": str(lr), **x}
            for n, lr, x in ranks
        ],
    )
    res = [_res(cp) for cp in cps]
    assert res[0]["sums"] == res[1]["sums"] == res[2]["sums"] == res[3]["sums"] and len(res[3]["sums"]) == 9
    assert [r["got"] >= size - (1 << 16) for r in res] == [False, False, True, True], [r["got"] for r in res]
    assert "not kept in this node's memory" in cps[2].stderr, cps[2].stderr[-2000:]
    # B1 waited for its node's receiver, then received itself in the second transfer
    line = next(x for x in cps[3].stderr.splitlines() if "restored step 6" in x)
    assert line.count("group") == 2 and "wait" in line and "receive" in line, line
