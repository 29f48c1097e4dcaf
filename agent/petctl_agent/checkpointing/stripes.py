"""What a memory snapshot's two trips between nodes share: its stripes, the test that two copies
are the very same bytes, and every tensor's CRC as its bytes arrive.

A snapshot goes node to node two ways (docs/agent.md, "Memory snapshots"): the agent's fetch for a
node that joins, over TCP from its peers' persisters before its workers start (:mod:`.fetch`), and
the workers' restore over gloo, for a node that still holds no copy, or one that differs
(:mod:`.peer`). Both

- cut the snapshot on tensor boundaries into up to ``PETCTL_SNAPSHOT_STREAMS`` stripes of about
  equal size (:func:`streams`, :func:`cut`), one flow each, and move them all at once
  (:func:`together`): AWS caps a single flow between two instances at 5 Gbps outside a cluster
  placement group, far below a GPU instance's network;
- take the stripes of one transfer only from holders of the same content (:func:`digest`), so that
  they fit together (:func:`choose`, for the fetch; the workers' all-gather applies the same test);
- check every tensor's CRC as its stripe's bytes arrive, a piece behind them (:class:`Crcs`), and
  keep nothing that failed (:class:`Torn`: no header is written, so it is never loaded).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from petctl_agent.checkpointing import crcs, timeline
from petctl_agent.checkpointing.header import header_crc

#: stripes (flows) per transfer, at most
STREAMS = 4
MAX_STREAMS = 16

S = TypeVar("S")


class Torn(Exception):
    """A stripe did not arrive whole, or its bytes failed their CRCs (or could not be stored): no
    header is written, so it is never loaded and never kept."""


def streams() -> int:
    """``PETCTL_SNAPSHOT_STREAMS`` (1-16; default 4): the flows a transfer uses at most."""
    raw = os.environ.get("PETCTL_SNAPSHOT_STREAMS") or str(STREAMS)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_STREAMS:
        print(
            f"petctl checkpoint: PETCTL_SNAPSHOT_STREAMS={raw!r} is not a whole number from 1 to {MAX_STREAMS}; "
            f"using {STREAMS if n < 1 else MAX_STREAMS}",
            file=sys.stderr,
        )
        n = STREAMS if n < 1 else MAX_STREAMS
    return n


def cut(tensors: list[dict[str, Any]], size: int, k: int) -> list[tuple[int, int]]:
    """Exactly ``k`` ranges ``(offset, bytes)`` tiling ``[0, size)``, cut only where a tensor starts,
    at the first start at or past each ``size * i / k`` (so about equal where the tensors allow;
    a tensor of half the state makes at most two useful stripes); empty ones last."""
    starts = sorted({int(m["offset"]) for m in tensors if int(m["nbytes"]) and 0 < int(m["offset"]) < size})
    cuts = [0]
    for i in range(1, k):
        target = size * i // k
        nxt = next((s for s in starts if s >= target and s > cuts[-1]), None)
        if nxt is None:
            break
        cuts.append(nxt)
    cuts.append(size)
    out = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    return out + [(size, 0)] * (k - len(out))


def tiles(ranges: list[tuple[int, int]], size: int) -> bool:
    """Do the non-empty ``ranges`` ``(offset, bytes)`` cover ``[0, size)`` exactly, end to end (as
    the stripes of :func:`cut` do)? A receiver's check of the stripes its sources announced."""
    at = 0
    for lo, n in sorted(r for r in ranges if r[1]):
        if lo != at:
            return False
        at = lo + n
    return at == size


def in_stripe(tensors: list[dict[str, Any]], lo: int, n: int) -> list[dict[str, Any]]:
    """The tensors that start in bytes ``[lo, lo + n)`` (a stripe of :func:`cut` holds them whole)."""
    return [m for m in tensors if lo <= int(m["offset"]) < lo + n]


def pieces(lo: int, n: int, size: int) -> Iterator[tuple[int, int]]:
    """Bytes ``[lo, lo + n)`` in ranges ``(offset, bytes)`` of ``size`` at most, in order."""
    for off in range(lo, lo + n, size):
        yield off, min(size, lo + n - off)


def digest(header: dict[str, Any] | None) -> int:
    """A 31-bit fingerprint of a snapshot's content as its header states it (size, and every
    tensor's offset, size and CRC; 0: none). Two holders with the same digest hold the same
    bytes, so their stripes fit together."""
    if header is None:
        return 0
    body = [
        int(header["size"]),
        [[int(m["offset"]), int(m["nbytes"]), int(m["crc32c"])] for m in header["tensors"]],
    ]
    return (crcs.crc(json.dumps(body).encode()) & 0x7FFFFFFF) or 1


def sound(h: Any) -> bool:
    """Is ``h`` (a header as a peer sent it, decoded) a header whose own CRC matches?"""
    return isinstance(h, dict) and h.get("header_crc") == header_crc(h)


def choose(heads: list[tuple[S, dict[str, Any] | None]]) -> tuple[dict[str, Any], list[S]] | None:
    """The newest snapshot the peers hold -- by ``(epoch, step)``: the newest history's newest step,
    never a higher step of an abandoned one (:mod:`.timeline`) -- and its holders: of it, the copy
    (its :func:`digest`) the most of them hold, so every stripe comes from the very same
    bytes; None when no peer answered with a snapshot."""
    got = [(src, h) for src, h in heads if h is not None]
    if not got:
        return None
    newest = max(timeline.key(h) for _, h in got)
    by: dict[int, list[tuple[S, dict[str, Any]]]] = {}
    for src, h in got:
        if timeline.key(h) == newest:
            by.setdefault(digest(h), []).append((src, h))
    best = max(by.values(), key=len)
    return best[0][1], [src for src, _ in best]


class Crcs:
    """Running CRCs of a snapshot's tensors (a stripe's), fed the bytes piece by piece in order.

    A transfer feeds each piece a piece late: :meth:`landed` when its bytes are in, :meth:`catch_up`
    while the next piece travels (gloo, the kernel's copy and awscrt all release the GIL)."""

    def __init__(self, tensors: list[dict[str, Any]]) -> None:
        self.metas = sorted(tensors, key=lambda m: int(m["offset"]))
        self.crc = [0] * len(self.metas)
        self.first = 0  # the first tensor not yet wholly fed
        self.behind: tuple[int, int] | None = None  # a piece landed, not yet fed

    def update(self, view: memoryview, off: int, n: int) -> None:
        """Feed bytes ``[off, off + n)`` of the snapshot (``view`` is the whole snapshot's)."""
        end = off + n
        for i in range(self.first, len(self.metas)):
            m = self.metas[i]
            lo, hi = int(m["offset"]), int(m["offset"]) + int(m["nbytes"])
            if lo >= end:
                break
            a, b = max(lo, off), min(hi, end)
            if a < b:
                self.crc[i] = crcs.crc(view[a:b], self.crc[i])
            if hi <= end:
                self.first = i + 1

    def landed(self, off: int, n: int) -> None:
        """Bytes ``[off, off + n)`` are in ``view``: fed at the next :meth:`catch_up`."""
        self.behind = (off, n)

    def catch_up(self, view: memoryview) -> None:
        """Feed the piece that landed last, if not yet fed."""
        if self.behind is not None:
            off, n = self.behind
            self.behind = None
            self.update(view, off, n)

    def ok(self) -> bool:
        return all(c == int(m["crc32c"]) for c, m in zip(self.crc, self.metas))


def together(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` at once (threads; gloo, sockets and awscrt release the GIL); their results, in
    order. The first exception is raised once all have ended (each piece is bounded by its flow's
    timeout)."""
    if len(fns) == 1:
        return [fns[0]()]
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errs.append(e)

    threads = [threading.Thread(target=run, args=(i,), name=f"petctl-stripe-{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out
