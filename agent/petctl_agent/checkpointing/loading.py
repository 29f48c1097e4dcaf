"""Loading the checkpoint directory: the newest readable checkpoint, by one rank alone or agreed by
every rank (what ``petctl_agent.checkpoint.load_latest`` and ``resume`` load from EFS).

Alone (:func:`load_newest`): the file ``latest`` names, checked against its sha256, else older
ones newest first. Agreed (:func:`load_agreed`, collective): the ranks exchange what they see over
the checkpoint's gloo group and try the steps newest first together, so that every rank loads the
same step; an error on one rank is raised on every rank (:func:`gather_checked`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing.files import (
    CKPT_RE,
    UnsafeCheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_file,
    read_pointer,
)
from petctl_agent.checkpointing.group import ckpt_group
from petctl_agent.checkpointing.sharded import MissingStateError, NeedsStateError, load_sharded
from petctl_agent.distributed import dist_rank, dist_world


def load_newest(
    directory: str | os.PathLike | None,
    map_location: Any,
    into: dict[str, Any] | None,
    unsafe_load: bool | None,
    *,
    agree: bool,
) -> tuple[dict[str, Any], int] | None:
    """:func:`petctl_agent.checkpoint.load_latest` with the saved per-rank entry as saved (every rank's)."""
    d = checkpoint_dir(directory)
    if map_location is None:
        from petctl_agent.distributed import rank_device

        map_location = rank_device()
    if agree and dist_world() > 1:
        return load_agreed(d, map_location, into, unsafe_load)
    pointer = read_pointer(d)
    candidates: list[tuple[Path, str | None]] = []
    if pointer and pointer.get("file"):
        candidates.append((d / pointer["file"], pointer.get("sha256")))
    for s, path in list_checkpoints(d):
        if any(path == c for c, _ in candidates):
            continue
        if pointer and "step" in pointer and s > int(pointer["step"]):
            continue  # written after the pointer we trust: never made it to 'latest'
        candidates.append((path, None))
    for i, (path, sha) in enumerate(candidates):
        try:
            if path.name.endswith(".dcp"):
                return load_sharded(path, into, unsafe_load)
            return load_file(path, sha, map_location, unsafe_load)
        except (NeedsStateError, UnsafeCheckpointError):
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable newest falls back
            what = "newest " if i == 0 else ""
            print(f"petctl checkpoint: {what}{path.name} unreadable ({e}); trying older", file=sys.stderr)
    return None


#: rounds of :func:`load_agreed`: a round whose steps no rank set could all read starts again
#: (once more, twice at most) in case `latest` moved on while its older steps were pruned
AGREE_ROUNDS = 3


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, over the checkpoint's gloo group (CPU, whatever the
    default group's backend: no CUDA tensor needed under NCCL; bounded by its timeout,
    ``PETCTL_CHECKPOINT_TIMEOUT``). A dead peer raises here on every rank: never a hang."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=ckpt_group())
    return out


def gather_checked(what: str, fn: Callable[[], Any]) -> list[Any]:
    """:func:`gather` of ``fn()``: every rank's value, or the same error raised on every rank.

    A rank whose ``fn`` raises (EFS: ``ESTALE``, ``EIO``, ``EACCES`` listing the directory) must
    not raise before the gather: its peers would wait in it until ``PETCTL_CHECKPOINT_TIMEOUT``
    (1800 s) if the script catches the error and goes on. It sends the error instead, and when any
    rank sent one every rank raises the first: an ``OSError`` (that errno) naming the rank, or a
    ``RuntimeError``.
    """
    try:
        mine: tuple[Any, ...] = (None, None, fn())
    except Exception as e:  # noqa: BLE001 - every error reaches every rank, not just this one
        errno = e.errno if isinstance(e, OSError) else None
        mine = (errno, f"rank {dist_rank()} could not {what} ({type(e).__name__}: {e})", None)
    got = gather(mine)
    for errno, msg, _ in got:
        if msg is not None:
            line = f"petctl checkpoint: {msg}; resume raises this on every rank"
            raise OSError(errno, line) if errno is not None else RuntimeError(line)
    return [v for _, _, v in got]


def load_agreed(
    d: Path, map_location: Any, into: dict[str, Any] | None, unsafe_load: bool | None
) -> tuple[dict[str, Any], int] | None:
    """:func:`petctl_agent.checkpoint.load_latest` with every rank loading the same step (collective).

    Each rank reading ``latest`` and falling back on its own can land on different steps: the
    agent's persister moves ``latest`` at any time, and one rank's unreadable copy sends that rank
    alone to an older step -- the replicas then silently diverge. So the ranks exchange what they
    see (pointer, listing); the newest pointer's step bounds the candidates (``latest`` only moves
    forward: every step up to it was durable and in ``latest`` once), and they try the candidates
    newest first *together*: each rank loads the step (the sha256 any rank's pointer gave for its
    file; else the file's own checks), they exchange the outcome, and any rank's failure sends every
    rank to the next older step. An unsafe load or a sharded step without ``into`` on any rank
    raises on every rank. When every candidate failed, one more round in case ``latest`` moved on
    meanwhile (the older files pruned behind it); else None on every rank.
    """
    rank = dist_rank()
    tried: set[int] = set()
    prev_bound: int | None = None
    for _ in range(AGREE_ROUNDS):
        seen = gather_checked(
            f"list {d}", lambda: (read_pointer(d), [(s, p.name) for s, p in list_checkpoints(d)])
        )
        pointers = [p for p, _ in seen if isinstance(p, dict) and "step" in p]
        bound = max((int(p["step"]) for p in pointers), default=None)
        if prev_bound is not None and (bound is None or bound <= prev_bound):
            return None  # nothing newer appeared: the retry would try nothing new
        names: dict[int, str] = {}
        for _, listing in seen:
            for s, name in listing:
                names.setdefault(int(s), name)
        for p in pointers:
            if p.get("file") and CKPT_RE.match(str(p["file"])):
                names.setdefault(int(p["step"]), str(p["file"]))
        shas = {str(p["file"]): p["sha256"] for p in reversed(pointers) if p.get("file") and p.get("sha256")}
        candidates = sorted(
            (s for s in names if s not in tried and (bound is None or s <= bound)), reverse=True
        )
        if not candidates:
            return None
        for s in candidates:
            tried.add(s)
            path = d / names[s]
            out, code, msg = None, 1, ""
            if path.name.endswith(".dcp"):
                # DCP's load is collective: every rank enters it or none does
                ready = gather_checked(f"stat {path}", lambda p=path: (p.is_dir(), into is None))
                if any(needs for _, needs in ready):
                    load_sharded(path, None, unsafe_load)  # raises NeedsStateError, before any collective
                if not all(there for there, _ in ready):
                    if rank == 0:
                        missing = [r for r, (there, _) in enumerate(ready) if not there]
                        print(
                            f"petctl checkpoint: {path.name} missing on rank(s) {missing}; every rank tries older",
                            file=sys.stderr,
                        )
                    continue
            try:
                if path.name.endswith(".dcp"):
                    out = load_sharded(path, into, unsafe_load)
                else:
                    out = load_file(path, shas.get(path.name), map_location, unsafe_load)
                code = 0
            except UnsafeCheckpointError as e:
                code, msg = 2, str(e)
            except MissingStateError as e:
                code, msg = 3, str(e)
            except Exception as e:  # noqa: BLE001 - any unreadable copy sends every rank to an older one
                msg = f"{type(e).__name__}: {e}"
                print(f"petctl checkpoint: rank {rank}: {path.name} unreadable ({msg})", file=sys.stderr)
            outcomes = gather((code, msg))
            for c, m in outcomes:  # a refusal, or state missing, on any rank: the same line everywhere
                if c == 2:
                    raise UnsafeCheckpointError(m)
                if c == 3:
                    raise MissingStateError(m)
            bad = [r for r, (c, _) in enumerate(outcomes) if c]
            if not bad:
                return out
            if rank == 0:
                print(
                    f"petctl checkpoint: {path.name} unreadable on rank(s) {bad}; every rank tries older",
                    file=sys.stderr,
                )
        prev_bound = bound if bound is not None else -1
    return None
