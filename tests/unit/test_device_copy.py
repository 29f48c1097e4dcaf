"""The snapshot's copy from a device (checkpointing/device_copy.py), on CPU: the order of its CUDA
calls, its registrations of the slots' mappings, and the bytes.

There is no GPU here, so the runtime the copy asks for streams, events and registrations is a
recorder (``Recorder``): it treats the tensors it is told to as a device's, records every call in
one log (with the stream each copy was issued on, seen through a torch function mode), refuses a
registration where one is already in place (as CUDA does), and checks at each unregistration that
the range is still mapped. The copies themselves are torch's, on CPU tensors, into the store's
real slot files; the bytes are read back through the store's own ``load`` (CRC-checked).
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from petctl_agent.checkpointing import device_copy
from petctl_agent.checkpointing.snapshot import SnapshotStore

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


def _mapped_at(addr: int) -> str | None:
    """The file mapped at ``addr`` in this process, from /proc/self/maps (None: nothing there)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 else ""
    return None


class Stream:
    def __init__(self, rec: Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_stream(self, other: Stream) -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.rec.log.append(("wait_event", self.name, event.name))


class Event:
    def __init__(self, rec: Recorder, name: str) -> None:
        self.rec, self.name, self.done = rec, name, False

    def record(self, stream: Stream) -> None:
        self.rec.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.rec.waiting.set()
        assert self.rec.gate.wait(30)
        if self.rec.probe is not None:
            self.rec.probed.append(self.rec.probe())
        self.done = True
        self.rec.log.append(("synchronize", self.name))


class Recorder:
    """A CUDA runtime that records what is asked of it (device_copy.CudaRuntime's methods)."""

    def __init__(self, on_device: list[torch.Tensor], refuse: int = 0) -> None:
        self.on_device = {id(t) for t in on_device}
        self.refuse = refuse  # a registration's error code (0: registered)
        self.log: list[tuple] = []
        self.main = Stream(self, "main")
        self.issuing: Stream | None = None  # the stream a copy made now goes on
        self.registered: dict[int, int] = {}
        self.gate = threading.Event()  # events complete once set
        self.gate.set()
        self.waiting = threading.Event()  # someone waits for an event
        self.probe: Any = None  # called as an event completes: what it returns goes to probed
        self.probed: list[Any] = []
        self.streams = self.events = 0

    def device_of(self, t: Any) -> Any | None:
        return "dev0" if id(t) in self.on_device else None

    def current_stream(self, device: Any) -> Stream:
        return self.main

    def new_stream(self, device: Any) -> Stream:
        self.streams += 1
        return Stream(self, f"side{self.streams}")

    @contextlib.contextmanager
    def on_stream(self, stream: Stream) -> Iterator[None]:
        self.issuing = stream
        try:
            yield
        finally:
            self.issuing = None

    def new_event(self) -> Event:
        self.events += 1
        return Event(self, f"event{self.events}")

    def register(self, addr: int, size: int, device: Any) -> int:
        self.log.append(("register", addr, size, device))
        if self.refuse:
            return self.refuse
        if addr in self.registered:
            return ALREADY_REGISTERED
        self.registered[addr] = size
        return 0

    def unregister(self, addr: int) -> int:
        self.log.append(("unregister", addr, _mapped_at(addr)))
        return 0 if self.registered.pop(addr, None) is not None else NOT_REGISTERED

    def clear_error(self) -> None:
        self.log.append(("clear_error",))


class Copies(TorchFunctionMode):
    """Records every ``Tensor.copy_``: where it writes, how many bytes, non_blocking, on which stream."""

    def __init__(self, rec: Recorder, fail_at: int = 0) -> None:
        super().__init__()
        self.rec, self.fail_at, self.n = rec, fail_at, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            self.n += 1
            if self.n == self.fail_at:
                raise RuntimeError("the copy failed")
            dst = args[0]
            stream = self.rec.issuing.name if self.rec.issuing is not None else None
            nb = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            self.rec.log.append(("copy", dst.data_ptr(), dst.numel(), nb, stream))
        return func(*args, **kwargs)


def _state() -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A state whose tensors of several dtypes and shapes are a device's, beside a CPU one."""
    g = torch.Generator().manual_seed(3)
    dev = [
        torch.randn(1000, generator=g),
        torch.randn(64, 33, generator=g).to(torch.bfloat16),
        torch.randint(0, 1 << 40, (77,), generator=g),
        torch.randn(40, 30, generator=g).t(),  # not contiguous
        torch.tensor(2.5),  # 0-dim
        torch.rand(100, generator=g) > 0.5,
    ]
    cpu = torch.arange(50, dtype=torch.int32)
    state = {"w": dev[0], "b": dev[1], "i": dev[2], "t": dev[3], "s": dev[4], "m": dev[5], "cpu": cpu}
    state["empty"] = torch.empty(0)
    return state, dev


def _same(got: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    assert got is not None
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k])
        for k in want
    )


@pytest.fixture
def rec_for() -> Iterator:
    """``rec_for(device_tensors, refuse=0)``: a Recorder the copies go through, until the test ends."""
    made: list[Recorder] = []

    def make(on_device: list[torch.Tensor], refuse: int = 0) -> Recorder:
        made.append(Recorder(on_device, refuse))
        device_copy.use_runtime(made[-1])
        return made[-1]

    yield make
    device_copy.use_runtime(None)
    for rec in made:
        assert not rec.registered, "a registration outlived its mapping"


def _kinds(log: list[tuple], *kinds: str) -> list[tuple]:
    return [e for e in log if e[0] in kinds]


def test_the_device_copy_waits_for_the_step_and_training_waits_for_it(tmp_path: Path, rec_for) -> None:
    """The side stream waits for the current stream before any copy; every device tensor's copy
    is non_blocking, on the side stream, into its place in the slot's mapping; one event after
    them, which the current stream waits for; the CPU tensor is copied as before. The host returns
    before the event completes, and the header (the CRCs) comes only after it has."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    rec.gate.clear()  # the copy "runs" until the gate opens
    with Copies(rec):
        assert store.write(state, 1) == "ok"
    assert rec.waiting.wait(30)  # the CRC thread waits for the copy
    [(_, addr, size, _)] = _kinds(rec.log, "register")
    assert not store.read_header("a"), "the header before the copy ended"
    rec.gate.set()
    store.flush()
    h = store.read_header("a")
    assert size == -(-h["size"] // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping's whole pages

    log = _kinds(rec.log, "wait_stream", "copy", "record", "wait_event", "synchronize")
    assert log[0] == ("wait_stream", "side1", "main")
    dev_copies = [e for e in log if e[0] == "copy" and e[4] == "side1"]
    cpu_copies = [e for e in log if e[0] == "copy" and e[4] is None]
    assert len(dev_copies) == len(dev) and all(e[3] for e in dev_copies), dev_copies
    assert len(cpu_copies) == 1 and cpu_copies[0][3] is False
    metas = {m["offset"]: m["nbytes"] for m in h["tensors"]}
    for _, ptr, n, _, _ in dev_copies + cpu_copies:
        assert metas[ptr - addr] == n  # the bytes go to their own place in the mapping
    last = max(i for i, e in enumerate(log) if e in dev_copies)
    assert log[last + 1 :] == [
        ("record", "event1", "side1"),
        ("wait_event", "main", "event1"),
        *[e for e in log[last + 1 :] if e[0] == "copy"],  # the CPU copy, after the enqueue
        ("synchronize", "event1"),
    ]
    assert _same(store.load(1), state)
    store.close()
    assert rec.log[-1] == ("unregister", addr, str(store.data_path("a")))  # still mapped


def test_a_waited_write_waits_for_the_copy_before_its_crcs(tmp_path: Path, rec_for) -> None:
    """``wait=True`` (a stop, the last step): the copy's end, then the header, before write returns."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    rec.probe = lambda: store.read_header("a")
    assert store.write(state, 1, wait=True) == "ok"
    assert rec.probed == [None]  # no header yet as the copy ended
    assert store.read_header("a") is not None
    assert store._pending is None  # nothing left in the background
    assert _same(store.load(1), state)
    store.close()


def test_a_slot_is_registered_once_and_unregistered_while_still_mapped(tmp_path: Path, rec_for) -> None:
    """Each slot's mapping is page-locked on its first copy only; the store's close unregisters
    both, after their copies ended, while their ranges are still the slot files' mappings."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    for step in range(1, 6):
        for t in dev:
            t.add_(1) if t.dtype != torch.bool else t.logical_not_()
        assert store.write(state, step) == "ok"
        store.flush()
        assert _same(store.load(step), state)
        gc.collect()  # the restored views gone: the slot is not lent, its next write is in place
    regs = _kinds(rec.log, "register")
    assert len(regs) == 2 and len({r[1] for r in regs}) == 2, regs
    assert rec.streams == 1  # one side stream per device
    store.close()
    unregs = _kinds(rec.log, "unregister")
    assert sorted(u[1] for u in unregs) == sorted(r[1] for r in regs)
    assert {u[2] for u in unregs} == {str(store.data_path("a")), str(store.data_path("b"))}
    # each after its slot's last copy was waited for (again: it completed before the close)
    assert all(rec.log[rec.log.index(u) - 1][0] == "synchronize" for u in unregs), rec.log[-6:]


def test_a_slot_remapped_is_unregistered_before_its_mapping_goes(tmp_path: Path, rec_for) -> None:
    """A restore lends slot b's file, so its next write takes a spare made in the background:
    the spare's mapping replaces b's. b's old mapping is unregistered while still mapped, before
    it closes (its range may be the next mapping's: CUDA would refuse that registration), and the
    new one is registered on its first copy. A spare that no write took, freed at close, was
    never registered."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    assert store.write(state, 1, wait=True) == "ok"  # a
    assert store.write(state, 2, wait=True) == "ok"  # b
    [_, (_, b_addr, _, _)] = _kinds(rec.log, "register")
    lent = store.load(2)  # b lent: never rewritten in place
    store.prepare_spares(store.read_header("b")["size"])
    store._spares.join(30)
    spare = store.spare_path("b").stat().st_ino
    assert store.write(state, 3, wait=True) == "ok"  # a, in place
    n = len(rec.log)
    assert store.write(state, 4, wait=True) == "ok"  # b: the spare renamed into place
    after = rec.log[n:]
    unreg = [e for e in after if e[0] == "unregister"]
    # b's old inode (renamed over: "(deleted)"), still mapped when unregistered
    assert [e[:2] for e in unreg] == [("unregister", b_addr)], after
    assert unreg[0][2].startswith(str(store.data_path("b"))), unreg
    reg = [e for e in after if e[0] == "register"]
    assert len(reg) == 1 and after.index(unreg[0]) < after.index(reg[0])
    assert store.data_path("b").stat().st_ino == spare  # the spare it took
    assert store.read_header("b")["step"] == 4 and _same(store.load(4), state)
    assert _same(lent, state)
    del lent
    store.close()
    assert not rec.registered
    assert all(e[2] is not None for e in _kinds(rec.log, "unregister"))


def test_a_failed_registration_falls_back_to_the_pageable_copy(tmp_path: Path, rec_for, capsys) -> None:
    """The registration refused (e.g. RLIMIT_MEMLOCK): its error consumed, said once on stderr, the
    device's tensors copied synchronously like the CPU ones, never registered again; the bytes right."""
    state, dev = _state()
    rec = rec_for(dev, refuse=2)
    store = SnapshotStore(tmp_path, "r")
    with Copies(rec):
        assert store.write(state, 1) == "ok"
        store.flush()
        assert store.write(state, 2) == "ok"
        store.flush()
    assert [e[0] for e in _kinds(rec.log, "register", "clear_error")] == ["register", "clear_error"]
    assert not _kinds(rec.log, "wait_stream", "record", "wait_event", "synchronize")
    copies = _kinds(rec.log, "copy")
    assert len(copies) == 2 * (len(dev) + 1) and not any(e[3] or e[4] for e in copies)
    assert capsys.readouterr().err.count("cudaHostRegister") == 1
    assert _same(store.load(1), state) and _same(store.load(2), state)
    store.close()
    assert not _kinds(rec.log, "unregister")


def test_a_copy_that_fails_midway_is_waited_for_before_the_slot_unmaps(tmp_path: Path, rec_for) -> None:
    """A tensor's copy raises after others were enqueued: the event is recorded anyway and the
    slot's mapping, closed by the failed write, is unregistered only after that event completed."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    with Copies(rec, fail_at=3), pytest.raises(RuntimeError, match="the copy failed"):
        store.write(state, 1)
    tail = _kinds(rec.log, "record", "wait_event", "synchronize", "unregister")
    assert [e[0] for e in tail] == ["record", "wait_event", "synchronize", "unregister"], tail
    assert tail[-1][2] == str(store.data_path("a"))  # still mapped when unregistered
    assert store.read_header("a") is None
    store.close()


def test_a_mapping_dropped_without_close_is_unregistered(tmp_path: Path, rec_for) -> None:
    """A store dropped without ``close`` (its mappings go with it): their registrations go too."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    assert store.write(state, 1, wait=True) == "ok"
    assert rec.registered
    store._spares.join(30)  # the spare thread (slot b's file) holds the store while it runs
    del store
    gc.collect()
    assert not rec.registered and len(_kinds(rec.log, "unregister")) == 1


def test_a_forked_child_never_unregisters_the_parents_mappings(tmp_path: Path, rec_for) -> None:
    """A forked child (a DataLoader worker) drops the store's mappings at the fork (they are not in
    it): the registrations are the parent's, and CUDA is not the child's to call."""
    state, dev = _state()
    rec = rec_for(dev)
    store = SnapshotStore(tmp_path, "r")
    assert store.write(state, 1, wait=True) == "ok"
    store._spares.join(30)
    n = len(rec.log)
    pid = os.fork()
    if pid == 0:  # the at-fork handlers ran: the store's mappings were closed in here
        gc.collect()
        os._exit(0 if len(rec.log) == n and not store._maps else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rec.registered and len(rec.log) == n
    assert store.write(state, 2, wait=True) == "ok" and _same(store.load(2), state)
    store.close()
