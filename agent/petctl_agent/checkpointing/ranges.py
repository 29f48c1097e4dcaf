"""What a sharded restore receives: only the byte ranges of the step that each node's new layout
reads, after a check that they fit in the node's memory (``sharded_memory.resume``).

DCP's ``.metadata`` says where each stored chunk lies: ``Metadata.storage_data`` maps each chunk's
``MetadataIndex`` to ``_StorageInfo(relative_path, offset, length)``. A rank's load plan (the
``DefaultLoadPlanner``'s local plan for the state dict it fills, at its new layout) names the chunks
it reads, and DCP's ``FileSystemReader`` reads exactly those ranges (a seek, then ``length``
bytes). So each rank computes its ranges (:func:`reads`), every rank learns all of them (one
gather), and each node's lowest rank (its leader) receives the union of its ranks' ranges in the
files its node lacks (:func:`assign`), from the holders of those files, least-loaded first.

A received file is a sparse file of the shard file's full size holding only the ranges the node's
ranks read: written in place through a shared mapping of a temp file in the node's tmpfs (no
anonymous buffer), each range checked against the CRC-32C its sender computed from its intact
copy, then renamed into place. DCP then loads from the node's directory as before. The holes are
never read; such a file never matches the marker's whole-file CRC, so the node never offers it to
a later restore.

Memory: before any receive, each node's leader reserves the bytes its node will receive
(``budget.reserve``, the machine's ledger); any node's "no" and every rank goes to EFS, with the
reason (``Received.refused``). ``.metadata`` (small) goes first, to the nodes that lack it, after its
own check: the ranges are computed from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import crcs

META = ".metadata"
#: a transfer: (file name, sending rank, receiving rank, the file's size, its ranges [(offset, length)])
Transfer = tuple[str, int, int, int, list[tuple[int, int]]]


@dataclass
class Received:
    """What :func:`receive` did. ``node``: bytes this rank's node received (its leader's; the same
    on every rank of the node); ``rank``: bytes this rank received; ``peers``: the saving ranks
    whose files the node received ranges of; ``refused``: why the node's memory could not take
    them (empty: it could)."""

    node: int = 0
    rank: int = 0
    peers: list[int] = field(default_factory=list)
    refused: str = ""


class FetchError(RuntimeError):
    """Some rank could not plan or receive its part (every rank raises it together)."""


# ---------------------------------------------------------------- planning


def reads(stepdir: Path, into: dict[str, Any], unsafe_load: bool | None = None) -> list[list[Any]]:
    """The byte ranges this rank's DCP load of ``stepdir`` into ``into`` reads: ``[[file, offset,
    length], ...]``, sorted and merged. Reads ``.metadata`` as ``sharded.load_sharded`` does (DCP's
    record types only unless unsafe loads are allowed) and adds the same per-rank slot to ``into``.

    Raises what the load would raise first (``UnsafeCheckpointError``, ``MissingStateError``).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.stateful import Stateful

    from petctl_agent.checkpointing.files import unsafe_allowed
    from petctl_agent.checkpointing.sharded import _check_keys, _safe_metadata_load

    if unsafe_allowed(unsafe_load):
        metadata = FileSystemReader(str(stepdir)).read_metadata()
    else:
        with open(stepdir / META, "rb") as f:
            metadata = _safe_metadata_load(f, stepdir)
    _check_keys(stepdir, metadata, into)
    sd = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in into.items()}  # as dcp.load
    planner = DefaultLoadPlanner()
    planner.set_up_planner(sd, metadata, False)
    spans: dict[str, list[tuple[int, int]]] = {}
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        spans.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length)))
    return [[n, o, ln] for n, sp in sorted(spans.items()) for o, ln in merge(sp)]


def merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges sorted, overlapping or adjacent ones joined, empty ones dropped."""
    out: list[list[int]] = []
    for o, n in sorted((int(o), int(n)) for o, n in spans if n > 0):
        if out and o <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], o + n - out[-1][0])
        else:
            out.append([o, n])
    return [(o, n) for o, n in out]


def assign(
    wants: dict[int, dict[str, list[tuple[int, int]]]],
    holders: dict[str, list[int]],
    sizes: dict[str, int],
) -> list[Transfer]:
    """The transfers that give each receiving leader (``wants``: leader -> file -> ranges it lacks)
    its ranges, each file's from the holder (``holders``: file -> leaders holding it intact) that
    sends the fewest bytes so far (then the lowest rank). Every rank computes the same list."""
    load: dict[int, int] = {}
    out: list[Transfer] = []
    for dst in sorted(wants):
        for name in sorted(wants[dst]):
            spans = merge(wants[dst][name])
            if not spans:
                continue
            src = min((r for r in holders[name] if r != dst), key=lambda r: (load.get(r, 0), r))
            load[src] = load.get(src, 0) + sum(n for _, n in spans)
            out.append((name, src, dst, sizes[name], spans))
    return out


def received_by(transfers: list[Transfer], dst: int) -> int:
    return sum(n for t in transfers if t[2] == dst for _, n in t[4])


# ---------------------------------------------------------------- moving bytes


def _target(path: Path, size: int) -> Any:
    """A file of ``size`` bytes (sparse: no page taken yet), mapped shared: what is received into
    it lands in the node's tmpfs directly."""
    import torch

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def transfer(
    stepdir: Path,
    rank: int,
    transfers: list[Transfer],
    group: Any,
    read: Callable[[Path, int], Any],
    timeout: timedelta,
) -> int:
    """Send and receive this rank's part of ``transfers`` (point to point on ``group``); each
    received file checked range by range against its sender's CRCs, then renamed into place.
    Returns the bytes this rank received. ``read(path, size)``: a sender's file as a uint8 tensor."""
    import torch
    import torch.distributed as dist

    works, recvs, tmps, tag = [], [], [], 0
    try:
        for name, src, dst, size, spans in transfers:
            if src == rank:
                whole = read(stepdir / name, size)
                sums = []
                for k, (o, n) in enumerate(spans):
                    piece = whole[o : o + n]
                    sums.append(crcs.crc(memoryview(piece.numpy())))
                    works.append(dist.isend(piece, dst=dst, group=group, tag=tag + k))
                crc_t = torch.tensor(sums, dtype=torch.int64)
                works.append(dist.isend(crc_t, dst=dst, group=group, tag=tag + len(spans)))
            elif dst == rank:
                tmp = stepdir / f".{name}.part"
                tmps.append(tmp)
                buf = _target(tmp, size)
                for k, (o, n) in enumerate(spans):
                    works.append(dist.irecv(buf[o : o + n], src=src, group=group, tag=tag + k))
                crc_t = torch.empty(len(spans), dtype=torch.int64)
                works.append(dist.irecv(crc_t, src=src, group=group, tag=tag + len(spans)))
                recvs.append((name, src, spans, tmp, buf, crc_t))
            tag += len(spans) + 1
        for w in works:
            w.wait(timeout)
        got = 0
        for name, src, spans, tmp, buf, crc_t in recvs:
            for k, (o, n) in enumerate(spans):
                if crcs.crc(memoryview(buf[o : o + n].numpy())) != int(crc_t[k]):
                    raise OSError(f"{name} bytes {o}..{o + n} from rank {src}: CRC mismatch")
            os.replace(tmp, stepdir / name)
            got += sum(n for _, n in spans)
        return got
    finally:
        for tmp in tmps:
            try:
                tmp.unlink()  # not renamed: a transfer cut short leaves nothing behind
            except OSError:
                pass


def fetch_files(
    stepdir: Path,
    rank: int,
    transfers: list[tuple[str, int, int, int, int]],
    group: Any,
    read: Callable[[Path, int], Any],
    timeout: timedelta,
) -> int:
    """Whole files ``(name, src, dst, size, crc)`` (``.metadata``), each checked against its
    marker's CRC, then written by temp + rename. Returns the bytes this rank received."""
    import torch
    import torch.distributed as dist

    works, recvs = [], []
    for tag, (n, src, dst, size, crc) in enumerate(transfers):
        if src == rank:
            works.append(dist.isend(read(stepdir / n, size), dst=dst, group=group, tag=tag))
        elif dst == rank:
            buf = torch.empty(size, dtype=torch.uint8)
            works.append(dist.irecv(buf, src=src, group=group, tag=tag))
            recvs.append((n, src, size, crc, buf))
    for w in works:
        w.wait(timeout)
    got = 0
    for n, src, size, crc, buf in recvs:
        if crcs.crc(memoryview(buf.numpy())) != crc:
            raise OSError(f"{n} from rank {src}: CRC mismatch")
        tmp = stepdir / f".{n}.{os.getpid()}.tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(memoryview(buf.numpy()))
        os.replace(tmp, stepdir / n)
        got += size
    return got


# ---------------------------------------------------------------- the whole receive (collective)


@dataclass
class Step:
    """One restore's inputs, the same on every rank: ``nodes`` (each rank's node), ``has`` (each
    leader's intact files of the planned save), ``files`` (the plan: name -> [owner, size, crc])."""

    nodes: list[str]
    has: dict[int, set[str]]
    files: dict[str, list[int]]

    def leader(self, rank: int) -> int:
        return min(r for r, n in enumerate(self.nodes) if n == self.nodes[rank])


def receive(
    step: Step,
    stepdir: Path,
    rank: int,
    into: dict[str, Any],
    unsafe_load: bool | None,
    *,
    gather: Callable[[Any], list[Any]],
    reserve: Callable[[int], tuple[Any, str]],
    group: Callable[[], Any],
    read: Callable[[Path, int], Any],
    timeout: timedelta,
) -> Received:
    """Give each node the bytes its ranks' load of the planned step reads (collective).

    ``reserve(n)``: the node's reservation of ``n`` bytes (``done()`` once they are written), or
    ``(None, why)``. Returns what was received, or :class:`Received` with ``refused`` (on every
    rank: some node's memory said no, before any receive). Raises :class:`FetchError` on every
    rank when some rank could not receive ``.metadata`` or plan its reads, and what a failed range
    transfer raises on the ranks it involves (the caller then agrees on the outcome)."""
    me = step.leader(rank)
    leaders = sorted(set(step.has))
    holders = {n: [d for d in leaders if n in step.has[d]] for n in step.files}
    out = Received()
    # 1. .metadata to the nodes that lack it: the ranges are computed from it
    meta = [d for d in leaders if META not in step.has[d]]
    ok, err = True, ""
    if meta:
        msize = step.files[META][1]
        held, refused = _agree(rank, me, msize if me in meta else 0, gather, reserve)
        if refused:
            return Received(refused=refused)
        moves = [
            (META, holders[META][k % len(holders[META])], d, msize, step.files[META][2])
            for k, d in enumerate(meta)
        ]
        try:
            stepdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            out.rank += fetch_files(stepdir, rank, moves, group(), read, timeout)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            ok, err = False, f"{META}: {type(e).__name__}: {e}"
        finally:
            if held is not None:
                held.done()
        out.node = msize if me in meta else 0
        # every rank's outcome, and a barrier: a node's other ranks read the file its leader received
        bad = [f"rank {r}: {e['err']}" for r, e in enumerate(gather({"ok": ok, "err": err})) if not e["ok"]]
        if bad:
            raise FetchError("; ".join(bad))
    # 2. the ranges, when some node lacks some data file
    data = [n for n in step.files if n != META]
    if not any(n not in step.has[d] for d in leaders for n in data):
        return out
    from petctl_agent.checkpointing.files import UnsafeCheckpointError
    from petctl_agent.checkpointing.sharded import MissingStateError

    ok, err, mine = True, "", []
    try:
        mine = reads(stepdir, into, unsafe_load)
    except (UnsafeCheckpointError, MissingStateError):
        mine = []  # the load raises it on every rank, as it would without memory
    except Exception as e:  # noqa: BLE001 - told to every rank in the gather
        ok, err = False, f"planning the load: {type(e).__name__}: {e}"
    everyone = gather({"ok": ok, "err": err, "reads": mine})
    bad = [f"rank {r}: {e['err']}" for r, e in enumerate(everyone) if not e["ok"]]
    if bad:
        raise FetchError("; ".join(bad))
    wants: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for r, e in enumerate(everyone):
        d = step.leader(r)
        for name, o, n in e["reads"]:
            if name not in step.has[d]:
                wants.setdefault(d, {}).setdefault(name, []).append((int(o), int(n)))
    moves = assign(wants, holders, {n: f[1] for n, f in step.files.items()})
    need = received_by(moves, me)
    held, refused = _agree(rank, me, need, gather, reserve)
    if refused:
        return Received(refused=refused)
    try:
        stepdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        out.rank += transfer(stepdir, rank, moves, group(), read, timeout)
    finally:
        if held is not None:
            held.done()
    out.node += need
    out.peers = sorted({step.files[t[0]][0] for t in moves if t[2] == me})
    return out


def _agree(
    rank: int,
    me: int,
    need: int,
    gather: Callable[[Any], list[Any]],
    reserve: Callable[[int], tuple[Any, str]],
) -> tuple[Any, str]:
    """Each node's leader reserves the ``need`` bytes its node will receive. ``(reservation or
    None, "")`` when every node could, else ``(None, why)`` on every rank, naming the nodes."""
    held, why = None, ""
    if rank == me and need > 0:
        try:
            held, why = reserve(need)
        except OSError as e:
            why = f"checking memory: {e}"
        if held is None:
            why = f"{need / 2**20:.2f} MiB to receive; {why}"
    verdicts = gather(why)
    if not any(verdicts):
        return held, ""
    if held is not None:
        held.done()
    return None, "; ".join(f"node of rank {r}: {w}" for r, w in enumerate(verdicts) if w)
