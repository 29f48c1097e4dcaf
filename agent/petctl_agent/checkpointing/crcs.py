"""The checksum of every byte the memory path keeps or moves: CRC-32C, on several cores at once.

Every snapshot byte is checksummed at least once on a membership change's path: the writer's
header (a drain, a join, the last step wait for it), a peer transfer's receiver and source, the
persister's check before EFS, the sharded path's markers. That was ``zlib.crc32``: 0.478 s per GiB
on one core here (zlib 1.2.13's table-driven loop). :func:`crc` is CRC-32C (Castagnoli) from
``awscrt.checksums`` (AWS's common runtime, the library boto3's own ``[crt]`` extra installs for
S3's CRC32C checksums): SSE4.2/PCLMUL or ARMv8 CRC instructions, 0.088 s per GiB on one core here,
the GIL released (``bench/bench_snapshot.py --floor``, the ``crc_*`` rows). With three nodes on
two cores, a 1 GiB drain's stop (the last step to the next round) went from 1.60 to 0.77 s
(``bench/bench_snapshot.py``). The same 32 bits of detection; CRC-32C is the checksum iSCSI,
ext4's metadata and S3 use.

A waited write still spreads its pass over threads: pieces of the bytes are checksummed at once
and the pieces of one tensor joined with :func:`combine` (zlib's ``crc32_combine`` algorithm,
which holds for any reflected CRC whose init and final xor are all ones: CRC-32C's).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from awscrt import checksums

#: bytes per piece a thread checksums (a tensor of fewer is one piece)
PIECE = 32 << 20
#: threads at most (a node's cores are shared with its other ranks)
MAX_THREADS = 8
#: CRC-32C's polynomial, reflected (Castagnoli)
_POLY = 0x82F63B78


def crc(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` (any bytes-like: bytes, a memoryview of a mapping), continuing ``value``
    (the CRC-32C of the bytes before it). Releases the GIL."""
    return checksums.crc32c(data, value)


def _times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _operator(nbytes: int) -> list[int]:
    """The GF(2) matrix that appends ``nbytes`` zero bytes to a CRC-32C (zlib's ``crc32_combine``)."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    op = _square(_square(op))  # four zero bits
    result: list[int] | None = None
    n = nbytes
    op = _square(op)  # one zero byte (eight bits)
    while n:
        if n & 1:
            result = op if result is None else [_times(op, c) for c in result]
        n >>= 1
        if n:
            op = _square(op)
    return result if result is not None else [1 << i for i in range(32)]


_ops: dict[int, list[int]] = {}
_ops_lock = threading.Lock()


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` given ``crc1 = crc(A)``, ``crc2 = crc(B)``, ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    with _ops_lock:
        op = _ops.get(len2)
    if op is None:
        op = _operator(len2)
        with _ops_lock:
            if len(_ops) < 64:
                _ops[len2] = op
    return _times(op, crc1) ^ crc2


def threads() -> int:
    """``PETCTL_CRC_THREADS`` (default: the CPUs this process may use, at most 8; 1: no threads)."""
    raw = os.environ.get("PETCTL_CRC_THREADS")
    try:
        n = int(raw) if raw else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        n = 1
    return max(1, min(MAX_THREADS, n))


def tensor_crcs(view: memoryview, metas: list[dict[str, Any]], nthreads: int | None = None) -> list[int]:
    """The CRC-32C of each tensor's bytes ``view[offset : offset + nbytes]``, computed in up to
    ``nthreads`` threads (default :func:`threads`) over :data:`PIECE`-byte pieces."""
    n = threads() if nthreads is None else max(1, nthreads)
    pieces: list[tuple[int, int, int]] = []  # (tensor, start, length)
    for i, m in enumerate(metas):
        off, size = int(m["offset"]), int(m["nbytes"])
        for a in range(off, off + size, PIECE):
            pieces.append((i, a, min(PIECE, off + size - a)))
    if n == 1 or len(pieces) < 2:
        return [crc(view[int(m["offset"]) : int(m["offset"]) + int(m["nbytes"])]) for m in metas]
    got: list[int] = [0] * len(pieces)
    nxt = [0]
    lock = threading.Lock()
    errs: list[BaseException] = []

    def work() -> None:
        try:
            while True:
                with lock:
                    k = nxt[0]
                    nxt[0] += 1
                if k >= len(pieces):
                    return
                _, a, ln = pieces[k]
                got[k] = crc(view[a : a + ln])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errs.append(e)

    ts = [threading.Thread(target=work, name=f"petctl-crc-{j}") for j in range(min(n, len(pieces)) - 1)]
    for t in ts:
        t.start()
    work()  # this thread works too
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    out: list[int | None] = [None] * len(metas)
    for (i, _, ln), c in zip(pieces, got):
        prev = out[i]
        out[i] = c if prev is None else combine(prev, c, ln)  # only a tensor's later pieces combine
    return [0 if c is None else c for c in out]  # None: an empty tensor (CRC of no bytes: 0)
