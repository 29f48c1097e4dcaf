"""What the agent's fetch and the workers' gloo restore share (``checkpointing/stripes.py``): the
stripes a snapshot is cut into, their tiling, the copies that may serve them, the running CRCs."""

from __future__ import annotations

import threading

import pytest

from petctl_agent.checkpointing import crcs, stripes


def _header(data: bytes, offsets: list[int], step: int = 3, epoch: int = 1) -> dict:
    ends = [*offsets[1:], len(data)]
    metas = [{"offset": a, "nbytes": b - a, "crc32c": crcs.crc(data[a:b])} for a, b in zip(offsets, ends)]
    return {"step": step, "epoch": epoch, "size": len(data), "tensors": metas}


def test_the_cut_tiles_and_a_gap_or_overlap_does_not() -> None:
    metas = [{"offset": o, "nbytes": 100} for o in (0, 128, 256, 384)]
    for k in (1, 2, 3, 4, 8):
        assert stripes.tiles(stripes.cut(metas, 512, k), 512), k
    assert stripes.tiles([(256, 256), (0, 256), (512, 0)], 512)  # in any order, empty ones ignored
    assert not stripes.tiles([(0, 128), (256, 256)], 512)  # a gap
    assert not stripes.tiles([(0, 300), (256, 256)], 512)  # an overlap
    assert not stripes.tiles([(0, 256)], 512)  # short
    assert stripes.tiles([], 0)
    assert stripes.in_stripe(metas, 128, 256) == metas[1:3]
    assert list(stripes.pieces(10, 25, 10)) == [(10, 10), (20, 10), (30, 5)]
    assert list(stripes.pieces(10, 0, 10)) == []


def test_running_crcs_a_piece_behind_match_only_the_right_bytes() -> None:
    data = bytes(range(256)) * 40
    h = _header(data, [0, 1000, 4000, 9000])
    for lo, n in stripes.cut(h["tensors"], len(data), 3):
        if not n:
            continue
        sums = stripes.Crcs(stripes.in_stripe(h["tensors"], lo, n))
        view = memoryview(data)
        for off, k in stripes.pieces(lo, n, 333):  # pieces that cut tensors anywhere
            sums.catch_up(view)
            sums.landed(off, k)
        assert sums.behind is not None  # the last piece is not fed yet
        sums.catch_up(view)
        assert sums.ok(), (lo, n)
    bad = bytearray(data)
    bad[5000] ^= 1
    sums = stripes.Crcs(h["tensors"])
    sums.update(memoryview(bytes(bad)), 0, len(bad))
    assert not sums.ok()


def test_only_the_newest_snapshot_of_the_most_holders_is_chosen() -> None:
    data = bytes(range(200))
    same = _header(data, [0, 100], step=6, epoch=20)
    other = _header(data[::-1], [0, 100], step=6, epoch=20)
    assert stripes.digest(same) == stripes.digest(dict(same)) != stripes.digest(other)
    assert stripes.digest(None) == 0
    older_history = _header(data, [0, 100], step=9, epoch=10)
    picked = stripes.choose([("a", older_history), ("b", other), ("c", same), ("d", same), ("e", None)])
    assert picked is not None and picked[0] == same and picked[1] == ["c", "d"]
    assert stripes.choose([("a", None)]) is None


def test_a_header_is_sound_only_with_its_own_crc() -> None:
    from petctl_agent.checkpointing.header import header_crc

    h = _header(b"x" * 10, [0])
    assert not stripes.sound(h) and not stripes.sound(None) and not stripes.sound([1])
    h["header_crc"] = header_crc(h)
    assert stripes.sound(h)
    h["step"] += 1
    assert not stripes.sound(h)


def test_together_runs_at_once_and_raises_the_first_error_after_all_ended() -> None:
    gate = threading.Barrier(3, timeout=5)
    assert stripes.together([lambda i=i: (gate.wait(), i)[1] for i in range(3)]) == [0, 1, 2]
    ended: list[int] = []

    def boom() -> None:
        raise ValueError("torn")

    with pytest.raises(ValueError, match="torn"):
        stripes.together([boom, lambda: ended.append(1)])
    assert ended == [1]
