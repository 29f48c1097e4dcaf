"""The memory path's checksum (checkpointing/crcs.py): CRC-32C, the same numbers on several threads."""

from __future__ import annotations

import mmap
import os
import random

import pytest

from petctl_agent.checkpointing import crcs


def _crc32c_bitwise(data: bytes) -> int:
    """CRC-32C by its definition (reflected 0x82F63B78, init and final xor all ones): a yardstick
    that shares no code with the library."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_crc_is_crc32c() -> None:
    assert crcs.crc(b"123456789") == 0xE3069283  # the catalogue's check value for CRC-32C
    assert crcs.crc(b"") == 0
    data = random.Random(1).randbytes(4099)
    assert crcs.crc(data) == _crc32c_bitwise(data)
    assert crcs.crc(data[1000:], crcs.crc(data[:1000])) == crcs.crc(data)  # continues a running value


def test_crc_takes_a_view_of_a_shared_mapping() -> None:
    """What the snapshot code hands it: a slice of a memoryview of a writable mmap."""
    data = random.Random(2).randbytes(1 << 20)
    mm = mmap.mmap(-1, len(data))
    mm[:] = data
    view = memoryview(mm)
    try:
        assert crcs.crc(view[5 : 5 + 70_000]) == crcs.crc(data[5 : 5 + 70_000])
    finally:
        view.release()
        mm.close()


@pytest.mark.parametrize("cut", [0, 1, 7, 4096, 100_000, 1 << 20])
def test_combine_is_the_crc_of_the_concatenation(cut: int) -> None:
    data = random.Random(cut).randbytes((1 << 20) + 333)
    a, b = data[:cut], data[cut:]
    assert crcs.combine(crcs.crc(a), crcs.crc(b), len(b)) == crcs.crc(data)
    assert crcs.combine(crcs.crc(data), 0, 0) == crcs.crc(data)


@pytest.mark.parametrize("nthreads", [1, 2, 5])
def test_tensor_crcs_match_one_pass_across_pieces_and_threads(monkeypatch, nthreads: int) -> None:
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
    want = [_crc32c_bitwise(data[m["offset"] : m["offset"] + m["nbytes"]]) for m in metas]
    view = memoryview(data)
    assert crcs.tensor_crcs(view, metas, nthreads) == want
    assert crcs.tensor_crcs(view, [], nthreads) == []


def test_threads_setting(monkeypatch) -> None:
    for raw, want in (("1", 1), ("3", 3), ("99", crcs.MAX_THREADS), ("x", 1), ("0", 1)):
        monkeypatch.setenv("PETCTL_CRC_THREADS", raw)
        assert crcs.threads() == want, raw
    monkeypatch.delenv("PETCTL_CRC_THREADS")
    assert crcs.threads() == max(1, min(crcs.MAX_THREADS, len(os.sched_getaffinity(0))))


def _header(pieces: list[bytes]) -> tuple[dict, bytes]:
    data, tensors = b"", []
    for p in pieces:
        tensors.append({"offset": len(data), "nbytes": len(p), "crc32c": crcs.crc(p)})
        data += p
    return {"tensors": tensors}, data


def _mapped(data: bytes) -> mmap.mmap:
    mm = mmap.mmap(-1, len(data))
    mm[:] = data
    return mm


def test_crcs_match_checks_every_tensor() -> None:
    """The one pass over a snapshot's bytes (a load, the verification, a peer, the persister)."""
    from petctl_agent.checkpointing.verification import crcs_match

    header, data = _header([b"a" * 100, b"", b"b" * 300])
    mm = _mapped(data)
    assert crcs_match(header, mm)
    mm[150] = ord("c")
    assert not crcs_match(header, mm)
    assert crcs_match({"tensors": []}, None)


def test_crcs_match_looks_for_a_seal_every_look_bytes_and_stops_checking_once_sealed() -> None:
    """The persister's pass: a seal found before the first tensor, or after ``look`` bytes checked,
    stands for the rest (a wrong byte there is not looked at); a torn byte before it is found."""
    from petctl_agent.checkpointing.verification import crcs_match

    header, data = _header([b"x" * 64] * 6)
    mm = _mapped(data)
    mm[5 * 64] = ord("y")  # the last tensor is wrong
    looks: list[int] = []

    def sealed_after(n: int):
        def sealed() -> bool:
            looks.append(1)
            return len(looks) > n

        return sealed

    assert not crcs_match(header, mm, sealed=lambda: False, look=128)
    looks.clear()
    assert crcs_match(header, mm, sealed=sealed_after(0), look=128)  # sealed from the start
    assert len(looks) == 1
    looks.clear()
    assert crcs_match(header, mm, sealed=sealed_after(2), look=128)  # looks before tensors 0, 2, 4
    assert len(looks) == 3
    looks.clear()
    assert not crcs_match(header, mm, sealed=sealed_after(3), look=128)  # the wrong one checked first
    assert len(looks) == 3
