"""Never OOM across the processes of one machine (checkpointing/budget.py, ``Budget``).

The local cloud's nodes share one machine's ``MemAvailable``: each node's writer checked it on its
own, and two 4 GiB writes both passed against the same 5.27 GiB (docs/benchmarks.md, 4 GiB at 2 nodes).
Now an allocation in flight is in the tmpfs's ledger, and every process's check counts it.

Real processes (one per "node", each its own store directory), real files and
``posix_fallocate``; the machine's memory is a meminfo file the test writes
(``$PETCTL_SNAPSHOT_MEMINFO``) and its ledger a file under the test's directory
(``$PETCTL_SNAPSHOT_LEDGER``), so nothing depends on this machine's real ``MemAvailable`` or on
what other processes of it have in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from petctl_agent.checkpointing import budget
from petctl_agent.checkpointing.budget import RESERVE_MIN

N = 1 << 20  # 4 MiB of fp32
SIZE = N * 4

#: one node's writer: a snapshot of N floats into its own store directory. With ``hold``, its
#: allocation stops twice: reserved (``<tag>.reserved``, waits for ``go``) and allocated, the
#: reservation still open (``<tag>.allocated``, waits for ``go2``): the in-flight states.
CHILD = r"""
import sys, time
from pathlib import Path
import torch
from petctl_agent.checkpointing import mapping
from petctl_agent.checkpointing.snapshot import SnapshotStore
d, tag, hold, N = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "hold", int(sys.argv[4])
real = mapping.fallocate

def wait_for(p):
    deadline = time.monotonic() + 120
    while not p.exists():
        if time.monotonic() > deadline:
            sys.exit("timed out waiting for " + str(p))
        time.sleep(0.01)

def held(fd, n):
    Path(str(tag) + ".reserved").touch()
    wait_for(tag.parent / "go")
    real(fd, n)
    Path(str(tag) + ".allocated").touch()
    wait_for(tag.parent / "go2")

if hold:
    mapping.fallocate = held
d.mkdir(exist_ok=True)
store = SnapshotStore(d, "replicated")
print(store.write({"w": torch.full((N,), 1.0)}, 1, wait=True), flush=True)
"""


def _machine(tmp: Path, room: float) -> dict[str, str]:
    """The test's machine: ``room`` states' bytes available over the reserve (the meminfo file
    is rewritten in place by later calls), one ledger. The env for its processes."""
    path = tmp / "meminfo"
    avail = RESERVE_MIN + int(room * SIZE)
    tmp_file = tmp / "meminfo.tmp"
    tmp_file.write_text(f"MemTotal: {1 << 20} kB\nMemAvailable: {avail >> 10} kB\n")  # 1 GiB: reserve 512 MiB
    os.replace(tmp_file, path)
    env = dict(os.environ)
    env[budget.MEMINFO_ENV] = str(path)
    env[budget.LEDGER_ENV] = str(tmp / "ledger")
    return env


def _start(tmp: Path, node: str, env: dict[str, str], hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp / node), str(tmp / node), "hold" if hold else "free", str(N)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _decided(tmp: Path, node: str, p: subprocess.Popen[str]) -> bool:
    """Has the node's writer reserved (its allocation now in flight) or ended?"""
    return (tmp / f"{node}.reserved").exists() or p.poll() is not None


def _result(p: subprocess.Popen[str]) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    return out.strip()


def test_two_nodes_on_one_machine_never_both_take_the_room_for_one(tmp_path: Path) -> None:
    """Room for one state: two nodes' writers reserve at once, exactly one is admitted and the
    other falls back (``no-fit``, with the reason) while the first's allocation is in flight. Once
    that allocation is made (its pages out of the machine's MemAvailable, the reservation still
    open) it is not counted twice: a node that fits beside it is admitted; and once it is done,
    the ledger holds nothing. On the code before the ledger both were admitted."""
    env = _machine(tmp_path, room=1.5)
    a, b = _start(tmp_path, "n0", env, hold=True), _start(tmp_path, "n1", env, hold=True)
    try:
        _until(lambda: _decided(tmp_path, "n0", a) and _decided(tmp_path, "n1", b), "both nodes decided")
        reserved = [n for n in ("n0", "n1") if (tmp_path / f"{n}.reserved").exists()]
        assert len(reserved) == 1, f"admitted: {reserved} (room for one state only)"
        first, other = (a, b) if reserved == ["n0"] else (b, a)
        why = _result(other)
        assert why.startswith("no-fit:") and "available" in why, why

        (tmp_path / "go").touch()  # the admitted node allocates its pages...
        _until(lambda: (tmp_path / f"{reserved[0]}.allocated").exists(), "the first allocation is made")
        # ...which the machine's MemAvailable now shows; and room for one more state came free
        env = _machine(tmp_path, room=1.2)
        other_node = "n1" if reserved == ["n0"] else "n0"
        again = _start(tmp_path, other_node, env, hold=False)
        assert _result(again) == "ok", "the first allocation, made, was counted twice"

        (tmp_path / "go2").touch()
        assert _result(first) == "ok"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    # every reservation ended or its process did (a write's background spare may outlive the
    # write, its entry then dropped at the next read): nothing in flight
    assert budget.Budget(tmp_path / "ledger")._ledger() == []


def test_a_writer_killed_mid_allocation_leaves_no_promise_behind(tmp_path: Path) -> None:
    """A writer SIGKILLed while its reservation is open (a node's hard loss, an OOM kill elsewhere)
    never closes it: its entry goes with its process, so the machine's room is not lost for ever."""
    env = _machine(tmp_path, room=1.5)
    a = _start(tmp_path, "n0", env, hold=True)
    try:
        _until(lambda: _decided(tmp_path, "n0", a), "the first node reserved")
        assert (tmp_path / "n0.reserved").exists(), a.communicate()[1][-2000:]
        b = _start(tmp_path, "n1", env, hold=False)  # while n0's promise is live: no room
        why = _result(b)
        assert why.startswith("no-fit:"), why
        a.send_signal(signal.SIGKILL)
        a.wait(60)
        b = _start(tmp_path, "n1", env, hold=False)
        assert _result(b) == "ok"
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()


def test_the_ledger_is_one_per_tmpfs_at_its_root(tmp_path: Path) -> None:
    """Every store on one tmpfs (the agent's ``<base>/<job>/<instance>``; the benches' per-node
    bases) shares the ledger at the mount's root; a store elsewhere keeps its own."""
    shm = Path(os.path.realpath(tmp_path)) / "shm"
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {shm} tmpfs rw,nosuid,nodev 0 0\n")
    for d in (shm / "petctl" / "job" / "i-1", shm / "bench" / "node1" / "job" / "i-2", shm):
        assert budget.ledger_path(d, mounts=str(mounts)) == shm / budget.LEDGER
    other = shm.parent / "disk" / "store"
    assert budget.ledger_path(other, mounts=str(mounts)) == other / budget.LEDGER


def test_a_ledger_held_too_long_is_a_no_fit_not_a_hang(tmp_path: Path, monkeypatch) -> None:
    """A process stopped while it holds the ledger's flock (SIGSTOP, a debugger) must not hang
    another node's checkpoint: past ``LEDGER_WAIT`` the reservation is refused (the step goes to
    EFS), with the reason; once the lock is free again it is admitted."""
    monkeypatch.setattr(budget, "LEDGER_WAIT", 0.2)
    env = _machine(tmp_path, room=1.5)
    meminfo = lambda: budget.read_meminfo(env[budget.MEMINFO_ENV])  # noqa: E731
    machine = budget.Budget(tmp_path / "ledger")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "ledger"), str(tmp_path / "held")]
    )
    try:
        _until(lambda: (tmp_path / "held").exists() or holder.poll() is not None, "the holder has the lock")
        assert holder.poll() is None
        r, why = machine.reserve(SIZE, tmp_path, meminfo)
        assert r is None and "flock held" in why, why
    finally:
        holder.kill()
        holder.wait()
    r, why = machine.reserve(SIZE, tmp_path, meminfo)
    assert r is not None, why
    r.done()


#: holds the ledger's flock until killed
HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
time.sleep(600)
"""
