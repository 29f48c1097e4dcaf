"""A sharded step's directory in node memory (``<snapshot dir>/sharded/ckpt-<step>.dcp``): its files
read as tensors to send (mapped, not copied) and written atomically, their CRC-32C, the ranks'
completion markers (``petctl-rank-<r>.json``, :data:`MARKER_FMT`), and the steps a node's memory
holds, newest first; and :func:`say`, the ``petctl checkpoint:`` line this path writes to stderr.

Tests replace :func:`read_tensor` here (a sender that dies mid-transfer): its callers look it up
through this module at the call.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import crcs
from petctl_agent.checkpointing.files import CKPT_RE

MARKER_FMT = "petctl-sharded-2"  # -2: CRC-32C (``crc32c``; -1 held zlib crc32s, never read now)
_MARKER_RE = re.compile(r"^petctl-rank-(\d+)\.json$")
CHUNK = 8 << 20


def say(msg: str) -> None:
    print(f"petctl checkpoint: {msg}", file=sys.stderr, flush=True)


def crc_file(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            crc = crcs.crc(chunk, crc)
    return crc


def read_tensor(path: Path, size: int) -> Any:
    """The file's bytes as a uint8 tensor to send: its tmpfs pages mapped, not copied."""
    import torch

    if os.stat(path).st_size != size:
        raise OSError(f"{path.name}: not {size} bytes")
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def write_atomic(path: Path, t: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", buffering=0) as f:
        f.write(memoryview(t.numpy()))
    os.replace(tmp, path)


def read_markers(stepdir: Path, step: int) -> list[dict[str, Any]]:
    out = []
    try:
        names = os.listdir(stepdir)
    except OSError:
        return out
    for n in names:
        if not _MARKER_RE.match(n):
            continue
        try:
            m = json.loads((stepdir / n).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("format") == MARKER_FMT and m.get("step") == step:
            out.append(m)
    return out


def steps(root: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), root / n) for n in names if (m := CKPT_RE.match(n)) and n.endswith(".dcp")]
    return sorted(found, reverse=True)
