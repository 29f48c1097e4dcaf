"""What the nodes' memories hold of sharded steps, and what a restore can take from them.

Each node's inventory (:func:`inventory`: steps, save ids, epochs, and only the files whose size and
CRC match their marker), whether the survivors' inventories together cover a step (:func:`covered`:
every saving rank's files and ``.metadata``, of one save), what is missing when they do not
(:func:`missing`, for the going-back line), where a node's shards of the restored step came from
(:func:`shard_sources`), and the largest epoch a node has seen (:func:`seen`, timeline.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import replicas, shardfiles, timeline
from petctl_agent.checkpointing.files import read_pointer


def seen(root: Path, directory: Path) -> int:
    """The largest epoch among this node's markers and ``latest`` (timeline.py; no CRC pass)."""
    out = timeline.epoch_of(read_pointer(Path(directory)))
    for s, p in shardfiles.steps(root):
        for m in shardfiles.read_markers(p, s):
            out = max(out, timeline.epoch_of(m))
    return out


def inventory(root: Path) -> dict[str, Any]:
    """What this node's memory holds, checked: ``{step: {"id", "epoch", "world", "files": {name:
    [owner, size, crc]}}}`` (``epoch``: the history the step is of, timeline.py).

    A file is offered only when a marker names it and its size and CRC match (torn or rewritten:
    left out); markers of one step with different save ids: the step is left out (stale mix).
    """
    out: dict[str, Any] = {}
    for s, p in shardfiles.steps(root):
        markers = shardfiles.read_markers(p, s)
        ids = {m.get("id") for m in markers}
        if len(ids) != 1:
            continue
        files: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for m in markers:
            counts.update(m.get("counts", {}))
            for n, f in m.get("files", {}).items():
                fp = p / n
                if not isinstance(f.get("crc32c"), int):  # a malformed marker: not offered
                    continue
                try:
                    if fp.stat().st_size != f["size"] or shardfiles.crc_file(fp) != f["crc32c"]:
                        continue
                except OSError:
                    continue
                files[n] = [int(f["owner"]), int(f["size"]), int(f["crc32c"])]
        if files:
            out[str(s)] = {
                "id": ids.pop(),
                "epoch": min(timeline.epoch_of(m) for m in markers),
                "world": int(markers[0]["world_size"]),
                "counts": counts,
                "files": files,
            }
    return out


def covered(step: str, entries: list[dict[str, Any]], sid: str | None = None) -> dict[str, Any] | None:
    """Every file of ``step`` (one save id: ``sid``, given) and who holds it, if the nodes'
    memories cover it."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if step in e and (sid is None or e[step]["id"] == sid):
            by_id.setdefault(e[step]["id"], []).append(e[step])
    for sid, parts in sorted(by_id.items()):
        world = parts[0]["world"]
        files: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for part in parts:
            counts.update(part["counts"])
            for n, f in part["files"].items():
                files.setdefault(n, f)
        if ".metadata" in files and not _lost(world, counts, files):
            return {"id": sid, "world": world, "files": files}
    return None


def _lost(world: int, counts: dict[str, int], files: dict[str, list[int]]) -> list[int]:
    """The ranks (of the saving world) whose files are not all among ``files``."""
    have: dict[int, int] = {}
    for n, f in files.items():
        if n != ".metadata":
            have[f[0]] = have.get(f[0], 0) + 1
    return [r for r in range(world) if str(r) not in counts or have.get(r, 0) < counts[str(r)]]


def shard_sources(
    rank: int, nodes: list[str], invs: list[dict[str, Any]], step: str, plan: dict[str, Any], peers: list[int]
) -> dict[str, list[int]]:
    """Where this node's shards of the plan came from (by the saving rank that owns them): ``self``
    (files its memory held: its own shards and the replicas it kept) and ``peer`` (``peers``: the
    owners of the files it received ranges of; a file it neither held nor read is in neither)."""
    mine = invs[replicas.leader(rank, nodes)].get(step)
    has = set(mine["files"]) if mine and mine["id"] == plan["id"] else set()
    held = {owner for n, (owner, _, _) in plan["files"].items() if n != ".metadata" and n in has}
    out = {"self": sorted(held), "peer": sorted(peers)}
    return {k: v for k, v in out.items() if v}


def missing(step: str, invs: list[dict[str, Any]], sid: str | None = None) -> str:
    parts = [i[step] for i in invs if step in i and (sid is None or i[step]["id"] == sid)]
    world = max((p["world"] for p in parts), default=0)
    files: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for p in parts:
        counts.update(p["counts"])
        for n, f in p["files"].items():
            files.setdefault(n, f)
    lost = [f"rank {r}'s shard" for r in _lost(world, counts, files)]
    lost += [] if ".metadata" in files else [".metadata"]
    return ", ".join(lost) or "a consistent set"
