"""crc32s on several threads (checkpointing/crcs.py): the same numbers ``zlib.crc32`` gives."""

from __future__ import annotations

import os
import random
import zlib

import pytest

from petctl_agent.checkpointing import crcs


@pytest.mark.parametrize("cut", [0, 1, 7, 4096, 100_000, 1 << 20])
def test_combine_is_the_crc32_of_the_concatenation(cut: int) -> None:
    data = random.Random(cut).randbytes((1 << 20) + 333)
    a, b = data[:cut], data[cut:]
    assert crcs.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)
    assert crcs.combine(zlib.crc32(data), 0, 0) == zlib.crc32(data)


@pytest.mark.parametrize("nthreads", [1, 2, 5])
def test_tensor_crcs_match_zlib_across_pieces_and_threads(monkeypatch, nthreads: int) -> None:
    monkeypatch.setattr(crcs, "PIECE", 1000)  # tensors of many pieces, joined with combine
    data = random.Random(nthreads).randbytes(20_000)
    metas = [
        {"offset": 0, "nbytes": 0},  # empty
        {"offset": 0, "nbytes": 999},  # one piece
        {"offset": 1024, "nbytes": 1000},  # exactly one piece
        {"offset": 2048, "nbytes": 7777},  # eight pieces, a short last one
        {"offset": 9856, "nbytes": 10_000},  # ten pieces
        {"offset": 19_904, "nbytes": 96},
    ]
    view = memoryview(data)
    want = [zlib.crc32(view[m["offset"] : m["offset"] + m["nbytes"]]) for m in metas]
    assert crcs.tensor_crcs(view, metas, nthreads) == want
    assert crcs.tensor_crcs(view, [], nthreads) == []


def test_threads_setting(monkeypatch) -> None:
    for raw, want in (("1", 1), ("3", 3), ("99", crcs.MAX_THREADS), ("x", 1), ("0", 1)):
        monkeypatch.setenv("PETCTL_CRC_THREADS", raw)
        assert crcs.threads() == want, raw
    monkeypatch.delenv("PETCTL_CRC_THREADS")
    assert crcs.threads() == max(1, min(crcs.MAX_THREADS, len(os.sched_getaffinity(0))))
