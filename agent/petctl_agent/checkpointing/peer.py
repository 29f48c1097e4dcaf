"""A memory snapshot's trip over the network, from the ranks whose nodes hold it to the ranks that
need it (``memory.resume``, step 2 of its restore order).

**Striped over several flows.** The snapshot's bytes are cut, on tensor boundaries, into up to
``PETCTL_SNAPSHOT_STREAMS`` (default 4) stripes of about equal size (:mod:`.stripes`, which the
agent's TCP fetch for a joining node, ``fetch.py``, cuts and checks by too). Each stripe goes over a gloo
group of its own -- its own TCP connection, i.e. its own flow -- from one holder, the holders
taken in turn (local rank first, so that the stripes spread over nodes before ranks), all
stripes at once. Only holders whose copy is the very same snapshot (its size and every tensor's
offset, size and CRC: :func:`.stripes.digest`) serve stripes of one transfer. Why: AWS caps a single
flow (a 5-tuple) between two instances at 5 Gbps outside a cluster placement group, 10 Gbps
inside one (25 Gbps with ENA Express), while a GPU instance's network carries 100-3,200 Gbps over
many flows ("Amazon EC2 instance network bandwidth", EC2 User Guide). One stream moves at best
0.58 GiB/s there: 1.7 s for 1 GiB, 6.9 s for 4 GiB, whatever the instance. Several flows, from one
survivor or from several, lift that cap; the receiver's node takes them all at once.

**What goes over each group.** The first stripe's group carries, first, the sizes (header length,
snapshot size; -1: the source's snapshot went before it could send it) and the header, from the
first stripe's source. Then every stripe's group carries its range ``(offset, bytes)`` (``-1``:
that source has nothing to send) and its bytes in :data:`CHUNK` pieces, each bounded by the
group's timeout. A receiver checks the first header (its own CRC, step, size), then every
tensor's CRC as its stripe arrives (:class:`.stripes.Crcs`, per stripe), and that the stripes tile the
snapshot exactly; anything else is torn (never loaded, never kept). A receiver with nothing to
receive into still takes every piece (into a scratch buffer), to keep each group in step.
A source checks its own copy as it sends its stripes (and the rest of its copy after them),
unless the agent's verification or the writer's seal covers it (``SnapshotStore.covered``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from petctl_agent.checkpointing.header import decode_structure, dtype_from_name
from petctl_agent.checkpointing.snapshot import SnapshotStore
from petctl_agent.checkpointing.stripes import Crcs, Torn, cut, in_stripe, pieces, sound, tiles, together
from petctl_agent.checkpointing.stripes import digest as digest  # re-exported: the restore's agreement
from petctl_agent.checkpointing.stripes import streams as streams  # uses peer.digest, peer.streams
from petctl_agent.checkpointing.timeline import epoch_of
from petctl_agent.checkpointing.verification import crcs_match
from petctl_agent.checkpointing.writing import OK

#: bytes per broadcast of a peer transfer (each one bounded by the group's timeout)
CHUNK = 64 << 20


def chunk() -> int:
    return int(os.environ.get("PETCTL_SNAPSHOT_CHUNK") or CHUNK)


def _stream(buf: Any, lo: int, n: int, src: int, group: Any, sums: Crcs | None, reserve: Any = None) -> bool:
    """Broadcast (from ``src``) or receive bytes ``[lo, lo + n)`` of ``buf`` (a uint8 tensor, or a
    buffer ``torch.frombuffer`` takes; None: a scratch piece, the bytes dropped) in :func:`chunk`
    pieces, the next piece in flight while the last one's CRCs are computed (``sums``; gloo and
    awscrt both release the GIL). ``reserve(off, n)`` (a receiver's slot) allocates a piece's pages
    just before it arrives. False when ``reserve`` failed (the rest was received into a scratch
    buffer, to keep the group in step) or there was no ``buf``."""
    import torch
    import torch.distributed as dist

    size = chunk()
    whole = buf if isinstance(buf, torch.Tensor) else None
    view = None if buf is None else memoryview(whole.numpy()) if whole is not None else memoryview(buf)
    scratch = torch.empty(min(size, n), dtype=torch.uint8) if buf is None else None
    try:
        for off, k in pieces(lo, n, size):
            if reserve is not None and scratch is None:
                try:
                    reserve(off, k)
                except OSError:
                    scratch = torch.empty(min(size, n), dtype=torch.uint8)
            if scratch is not None:
                piece = scratch[:k]
            elif whole is not None:
                piece = whole[off : off + k]
            else:
                piece = torch.frombuffer(buf, dtype=torch.uint8, count=k, offset=off)
            work = dist.broadcast(piece, src=src, group=group, async_op=True)
            if sums is not None:
                sums.catch_up(view)
            work.wait()
            del piece, work  # a mapping cannot close while a tensor exports it
            if sums is not None and scratch is None:
                sums.landed(off, k)
        if sums is not None:
            sums.catch_up(view)
    finally:
        if view is not None:
            view.release()
    return scratch is None


class Plan:
    """Who sends which stripe, over which group: ``srcs[i]`` sends stripe ``i`` over ``groups[i]``
    (a gloo group of ``srcs[i]`` and every receiver). Made by every rank, the same way
    (``dist.new_group`` is collective)."""

    def __init__(self, srcs: list[int], needers: list[int], timeout: Any) -> None:
        import torch.distributed as dist

        self.srcs = srcs
        self.groups: list[Any] = []
        try:
            for s in srcs:
                self.groups.append(
                    dist.new_group(ranks=sorted({s, *needers}), backend="gloo", timeout=timeout)
                )
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        import torch.distributed as dist

        for g in self.groups:
            try:
                if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
                pass
        self.groups = []


def _flag(lo: int, n: int, src: int, group: Any) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([lo, n], dtype=torch.int64)
    dist.broadcast(t, src=src, group=group)
    return int(t[0]), int(t[1])


def send(
    store: SnapshotStore, step: int, plan: Plan, me: int, map_location: Any, epoch: int | None = None
) -> tuple[dict[str, Any] | None, int]:
    """Send this rank's stripes of snapshot ``step`` of ``epoch`` (given: only a copy of that
    history, :mod:`.timeline`; the header too, if it sends the first) and
    load it: the bytes go out of the very mapping the loaded tensors view, their CRCs computed
    on the way, then the rest of the copy's (none when the agent's check or the writer's seal
    covers that very snapshot: ``SnapshotStore.covered``). (The state, None when a check failed;
    the bytes sent.) A snapshot gone before it could be sent is announced as such: the receivers
    give up at once, never waiting out the timeout."""
    import torch
    import torch.distributed as dist

    mine = [i for i, s in enumerate(plan.srcs) if s == me]
    lead = bool(mine) and mine[0] == 0
    sent = [0, False]

    def check(h: dict[str, Any], mm: Any) -> bool:
        if sent[1]:
            return False  # a second slot of the same step: the receivers have had the first
        sent[1] = True
        size = int(h["size"])
        if lead:
            header = json.dumps(h).encode()
            dist.broadcast(torch.tensor([len(header), size], dtype=torch.int64), src=me, group=plan.groups[0])
            dist.broadcast(
                torch.frombuffer(bytearray(header), dtype=torch.uint8), src=me, group=plan.groups[0]
            )
        known = store.covered(h)
        bounds = cut(h["tensors"], size, len(plan.srcs))
        sums = {i: None if known else Crcs(in_stripe(h["tensors"], *bounds[i])) for i in mine}

        def one(i: int) -> None:
            lo, n = bounds[i]
            _flag(lo, n, me, plan.groups[i])
            if n:
                _stream(mm, lo, n, me, plan.groups[i], sums[i])

        # the rest of its own copy (the other stripes' tensors) is checked meanwhile, not after:
        # every rank waits for the sources at the end of the restore
        ours = [bounds[i] for i in mine]
        rest = [m for m in h["tensors"] if not any(lo <= int(m["offset"]) < lo + n for lo, n in ours)]
        fns: list[Callable[[], Any]] = [lambda i=i: one(i) for i in mine]
        if not known:
            fns.append(lambda: crcs_match({"tensors": rest}, mm))
        done = together(fns)
        sent[0] = sum(n for _, n in ours)
        if known:
            return True
        return all(c is not None and c.ok() for c in sums.values()) and bool(done[-1])

    state = store.load(step, map_location=map_location, check=check, epoch=epoch)
    if not sent[1]:  # nothing to send from: said at once, on every group it serves
        if lead:
            dist.broadcast(torch.tensor([-1, -1], dtype=torch.int64), src=me, group=plan.groups[0])
        for i in mine:
            _flag(-1, -1, me, plan.groups[i])
    return state, int(sent[0])


def _peer_header(hbuf: Any, step: int, size: int, epoch: int | None = None) -> dict[str, Any] | None:
    """The peer's header if it parses, its own CRC matches and it is of ``step`` and ``size`` (and
    of ``epoch``, when given: the history agreed on)."""
    try:
        h = json.loads(bytes(hbuf.numpy()))
    except ValueError:
        return None
    if not sound(h):
        return None
    if int(h.get("step", -1)) != step or int(h.get("size", -1)) != size:
        return None
    if epoch is not None and epoch_of(h) != epoch:
        return None
    return h


def _pull_all(plan: Plan, into: Any, size: int, h: dict[str, Any] | None, reserve: Any = None) -> str:
    """Receive every stripe at once into ``into`` (None: dropped, a piece at a time). ``""`` when
    every stripe arrived whole, its tensors' CRCs matched ``h``'s and the stripes tile
    ``[0, size)``; else what went wrong."""

    def one(i: int) -> tuple[int, int, str]:
        src, group = plan.srcs[i], plan.groups[i]
        lo, n = _flag(0, 0, src, group)
        if lo < 0:
            return lo, 0, "a stripe's source had nothing to send"
        if n <= 0:
            return lo, 0, ""
        fits = into is not None and h is not None and lo + n <= size
        sums = Crcs(in_stripe(h["tensors"], lo, n)) if fits else None
        whole = _stream(into if fits else None, lo, n, src, group, sums, reserve if fits else None)
        if not fits:
            return lo, n, "dropped"
        return lo, n, "no room" if not whole else "" if sums is not None and sums.ok() else "CRC mismatch"

    got = together([lambda i=i: one(i) for i in range(len(plan.srcs))])
    bad = sorted({why for _, _, why in got if why})
    if bad:
        return ", ".join(bad)
    return "" if tiles([(lo, n) for lo, n, _ in got], size) else "the stripes do not tile the snapshot"


def receive(
    step: int,
    plan: Plan,
    map_location: Any,
    store: SnapshotStore | None = None,
    epoch: int | None = None,
) -> tuple[dict[str, Any] | None, int, list[dict[str, Any]] | None, tuple[bool, float] | None]:
    """Receive a peer's snapshot; the state if its step (and ``epoch``, given) and every CRC
    check, else None; its size; its header's ``tensors`` (layout and CRCs, checked); whether it
    was kept in ``store``.

    The CRCs are checked as the bytes arrive, stripe by stripe, not in a pass of their own.
    ``store`` (this node's, given to its local rank 0): the bytes arrive straight in a slot of it
    (:meth:`SnapshotStore.receive`, its pages allocated piece by piece as they arrive) and the
    state is loaded from there (on the CPU views of the slot, lent; its CRCs already checked):
    the node keeps the step with no copy of its own, and no second buffer. Bytes that fail their
    check never get a header (never loaded, not kept). Kept is then ``(True, 0.0)``;
    ``(False, 0.0)`` when the store has no room (the bytes then go into a buffer, as without a
    store); None without a store (the caller keeps it).
    """
    import torch
    import torch.distributed as dist

    sizes = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(sizes, src=plan.srcs[0], group=plan.groups[0])
    hlen, size = int(sizes[0]), int(sizes[1])
    h = None
    if size >= 0:
        hbuf = torch.empty(hlen, dtype=torch.uint8)
        dist.broadcast(hbuf, src=plan.srcs[0], group=plan.groups[0])
        h = _peer_header(hbuf, step, size, epoch)
    kept: tuple[bool, float] | None = None
    if h is not None and store is not None:

        def fill(mm: Any, reserve: Any) -> None:
            why = _pull_all(plan, mm, size, h, reserve)
            if why:
                raise Torn(why)

        try:
            why = store.receive(h, fill)
        except Torn as e:  # the slot stays torn (no header): never loaded
            print(f"petctl checkpoint: step {step} from a peer not loaded ({e})", file=sys.stderr)
            return None, size, None, None
        if why == OK:
            state = store.load(step, map_location=map_location, check=store.verified(), epoch=epoch)
            if state is None:
                return None, size, None, None
            return state, size, h["tensors"], (True, 0.0)
        print(
            f"petctl checkpoint: step {step}, restored from a peer, not kept in this node's memory ({why})",
            file=sys.stderr,
        )
        kept = (False, 0.0)  # fill() was not called: the bytes go into a buffer below
    if h is None:  # every stripe received and dropped, to keep the groups in step
        _pull_all(plan, None, max(size, 0), None)
        return None, max(size, 0), None, kept
    blob = torch.empty(size, dtype=torch.uint8)
    if _pull_all(plan, blob, size, h):
        return None, size, None, kept
    out = []
    for m in h["tensors"]:
        dt = dtype_from_name(m["dtype"])
        if not m["nbytes"]:
            out.append(torch.empty(m["shape"], dtype=dt, device=map_location))
            continue
        # on the CPU a view of the received buffer (no second copy); else a copy to the device
        out.append(
            blob[m["offset"] : m["offset"] + m["nbytes"]].view(dt).reshape(m["shape"]).to(map_location)
        )
    return decode_structure(h["structure"], out), size, h["tensors"], kept
