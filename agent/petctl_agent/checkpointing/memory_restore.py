"""The restore of replicated state from node memory (:mod:`.memory`, "resume"): one all-gather
agrees on the snapshot and its holders, then each rank loads its node's own copy or receives a
peer's (:mod:`.peer`), once more from a copy that passed when a holder's own failed, and every
rank ends on the same verdict (else EFS, or :class:`.memory_store.PeerRestoreError`).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import fetch, peer, timeline
from petctl_agent.checkpointing.files import read_pointer
from petctl_agent.checkpointing.memory_keep import (
    keep_copy,
    kick_durable,
    persist_before_efs,
)
from petctl_agent.checkpointing.memory_store import (
    PeerRestoreError,
    agreed_snapshot_dir,
    held_header,
    local_rank,
    node_key,
    report_restore,
    seen,
    snapshot_size,
    spares_after_first_step,
    store_of,
)
from petctl_agent.distributed import dist_on, dist_rank


def _all_gather(value: int, group: Any) -> list[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t[0]) for t in out]


def _all_gather_rows(values: list[int], group: Any) -> list[list[int]]:
    """Every rank's ``values`` (int64s, as many on every rank), in rank order: one all-gather."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(values, dtype=torch.int64), group=group)
    return [[int(v) for v in t] for t in out]


def resume(directory: Path, map_location: Any) -> tuple[dict[str, Any], int] | None:
    """The agreed step's state from this node's memory or a peer's; None: load EFS (collective)."""
    sdir = agreed_snapshot_dir()  # collective: every rank takes the memory path, or none
    if sdir is None:
        return None
    t0 = time.monotonic()
    # a node that joins: its agent's fetch of the peers' newest snapshot ends first (fetch.py)
    waited = fetch.wait_for_fetch(sdir, knobs.snapshot_peer_timeout())
    store = store_of(sdir)
    newest = store.newest()
    # a snapshot is known by (epoch, step), not its step alone (timeline.py): two nodes may hold
    # "step N" of two histories after a fallback to EFS, and an abandoned one's steps may be higher
    mine = newest.key if newest is not None else timeline.NONE
    pointer = read_pointer(directory)
    efs = timeline.key(pointer)  # an old pointer, without an epoch: epoch 0
    if not dist_on():
        timeline.begin(seen(store, pointer), time.time_ns())  # this generation's epoch
        if mine[1] < 0 or mine < efs:
            return None
        state = store.load(mine[1], map_location=map_location, check=store.prechecked(), epoch=mine[0])
        if state is None:
            return None
        report_restore("self", mine[1], newest.header["size"] if newest else 0, time.monotonic() - t0)
        spares_after_first_step(store, snapshot_size(store, mine))
        kick_durable(store, directory, mine, efs, state, held=True)
        return state, mine[1]
    import torch.distributed as dist

    timeout = timedelta(seconds=knobs.snapshot_peer_timeout())
    marks: list[tuple[str, float]] = []  # where this rank's restore spent its time (a stderr line)

    def mark(what: str) -> None:
        marks.append((what, time.monotonic()))

    group = dist.new_group(backend="gloo", timeout=timeout)  # every rank: the restore's own group
    plan: peer.Plan | None = None
    end = None
    try:
        # One all-gather tells every rank all it needs (timeline.py, peer.py): each rank's newest
        # snapshot (epoch, step), the `latest` it read (epoch, step), the largest epoch it sees
        # and its clock (this generation's epoch), whether it holds that snapshot (its header and
        # a data file of its size: size + 1, else 0) and its content (peer.digest), its node
        # (the ranks sharing a store) and local rank, and the stripes it allows
        held = held_header(store, mine) if mine[1] >= 0 else None
        lr = min(local_rank(), 31)
        rows = _all_gather_rows(
            [
                *mine,
                *efs,
                seen(store, pointer),
                time.time_ns(),
                int(held["size"]) + 1 if held is not None else 0,
                peer.digest(held),
                node_key(sdir) << 5 | lr,
                lr << 5 | peer.streams(),
            ],
            group,
        )
        mark("agree")  # mostly waiting for the last rank to get here (process start, init)
        timeline.begin(max(v[4] for v in rows), max(v[5] for v in rows))
        # the agreed snapshot: the newest (epoch, step) any rank's node holds complete, if not
        # older than the newest `latest` any rank read (EFS is shared; a persister may move it
        # between two ranks' reads): else EFS is the source
        best = max((v[0], v[1]) for v in rows)
        efs = max((v[2], v[3]) for v in rows)
        if best[1] < 0 or best < efs:
            return None
        epoch, agreed = best
        # its holders: the ranks whose node holds that very snapshot -- that epoch and step, and
        # the content of the lowest such rank's copy. Any other rank needs it, a holder of the
        # same step from another history (or other bytes) included: it never loads its own
        first = next((r for r, v in enumerate(rows) if (v[0], v[1]) == best and v[6]), None)
        if first is None:
            return None
        holds = [v[6] if (v[0], v[1]) == best and v[7] == rows[first][7] else 0 for v in rows]
        holders = [r for r, v in enumerate(holds) if v]
        needers = [r for r, v in enumerate(holds) if not v]
        source, nbytes, known = "self", 0, None
        kept: tuple[bool, float] | None = None
        state = None
        me = dist.get_rank()
        srcs = [holders[0]]  # the first source sends the header; its bytes are checked as they go
        receivers, followers, mine_receiver = needers, [], -1
        if needers:
            # the stripes' sources (peer.py): the holders, local rank first (nodes before ranks),
            # taken in turn; as many stripes as every rank allows
            k = min(v[9] & 31 for v in rows)
            same = sorted(holders, key=lambda r: ((rows[r][9] >> 5) & 31, r))
            srcs = [same[i % len(same)] for i in range(k)]
            # one receiver per node (the ranks sharing this store): its lowest local rank takes
            # the bytes over the network into the node's store, the node's other ranks (followers)
            # then load that copy -- a node of 8 GPUs takes 1 GiB off the network, not 8 (a
            # binomial broadcast among them would also send the source's bytes several times)
            nodes = [v[8] for v in rows]
            first_of: dict[int, int] = {}
            for r in sorted(needers, key=lambda r: (nodes[r] & 31, r)):
                first_of.setdefault(nodes[r] >> 5, r)
            # only a local rank 0 writes its node's store: a node whose lowest needer is not one
            # (LOCAL_RANK unset) has every needer receive for itself, as before
            lead = {n: r for n, r in first_of.items() if nodes[r] & 31 == 0}
            followers = [r for r in needers if nodes[r] >> 5 in lead and r != lead[nodes[r] >> 5]]
            receivers = [r for r in needers if r not in followers]
            mine_receiver = lead.get(nodes[me] >> 5, -1)
        for attempt in (1, 2):
            if needers:
                if end is None:
                    # for the gather after the transfer, where the ranks outside it wait: each
                    # piece is bounded by the peer timeout, so the whole transfer by as many (one
                    # timeout there failed every rank on a transfer longer than 60 s)
                    pieces = -(-(max(holds) - 1) // peer.chunk())
                    end = dist.new_group(backend="gloo", timeout=timeout * (pieces + 3))
                plan = peer.Plan(srcs, receivers, timeout)
                mark("group")
                if me in srcs:
                    # sent straight out of the mapping its own state views, the CRCs checked on
                    # the way: the receivers never wait for a load of the source's own
                    loaded, n = peer.send(store, agreed, plan, me, map_location, epoch=epoch)
                    state = state if state is not None else loaded
                    nbytes = nbytes or n
                elif me in receivers:
                    into = store if local_rank() == 0 else None  # the store's one writer on this node
                    state, nbytes, known, kept = peer.receive(agreed, plan, map_location, into, epoch=epoch)
                    source = "peer"
                elif state is None and me not in followers:  # another holder: its own copy, meanwhile
                    state = store.load(
                        agreed, map_location=map_location, check=store.prechecked(), epoch=epoch
                    )
                # a source's: its send and load (one pass); a receiver's: its slot's pages, the
                # bytes and their CRCs (as they arrive); another holder's: its own load
                if me not in followers:
                    mark("send" if me in srcs else "receive" if me in receivers else "load")
                if followers:
                    # which receivers' nodes now hold the step: their followers load that copy
                    # (checked in full: its writer, the receiver, lives on)
                    took = _all_gather(int(bool(kept and kept[0])), end)
                    if me in followers:
                        source = "peer"
                        mark("wait")  # for its node's receiver
                        if mine_receiver >= 0 and took[mine_receiver]:
                            state = store.load(
                                agreed, map_location=map_location, check=store.prechecked(), epoch=epoch
                            )
                            kept = (state is not None, 0.0)
                            mark("load")
            elif state is None:
                # its CRCs checked by the agent while this worker started, if that is still the
                # very snapshot (SnapshotStore.verify); else here, in full
                state = store.load(agreed, map_location=map_location, check=store.prechecked(), epoch=epoch)
                mark("load")
            # bit 0: this rank has the state; bit 1: it can serve it -- its node's store holds the
            # step (its own copy, or a peer's received into it) and that copy passed its checks.
            # A receiver whose node could not keep the step (a plain buffer) is no source: its
            # `peer.send` would announce nothing, its persister would ignore a request for the step
            serves = state is not None and (source == "self" or bool(kept and kept[0]))
            flags = _all_gather(int(state is not None) | int(serves) << 1, end or group)
            mark("end")
            oks = [v & 1 for v in flags]
            sources = [r for r, v in enumerate(flags) if v & 2]
            bad = [r for r, v in enumerate(oks) if not v]
            # a receiver failing while every source's copy passed: the transfer itself (no room,
            # bytes changed on the way): EFS, below. Else (a holder's own copy failed, a
            # source's included: then every receiver failed too) one more transfer to every
            # rank that failed, from a rank whose copy passed (one stream)
            transfer_failed = bool(needers) and not set(srcs) & set(bad) and any(r in receivers for r in bad)
            if not bad or attempt == 2 or not sources or transfer_failed:
                break
            if plan is not None:
                plan.destroy()
            # every rank that failed (a follower whose node's receiver kept nothing included)
            # receives over the network itself this time
            plan, srcs, needers, receivers, followers = None, [sources[0]], bad, bad, []
        ok = min(oks)
    except Exception as e:  # noqa: BLE001 - a dead peer breaks the group for every rank
        raise PeerRestoreError(
            f"restore from a peer's memory failed ({type(e).__name__}: {e}); "
            "exiting so the next round restores from a surviving copy or EFS"
        ) from e
    finally:
        if plan is not None:
            plan.destroy()
        for g in (end, group):
            try:
                if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
                pass
    if not ok:  # a check failed: every rank loads EFS (the group still agreed) ...
        # ... once a rank whose store holds the agreed step, its copy checked, put it there (a
        # drain did not wait for EFS). A torn copy, or a step received into a plain buffer, is
        # no source: its persister could not serve the request
        if best > efs and sources:
            persist_before_efs(store, best, directory, sources[0])
        return None
    extra: dict[str, Any] = {}
    held = source == "self"
    if source == "peer":
        if local_rank() == 0:  # the store's one writer on this node
            # received straight into the store (kept, no copy), or no room there; else a copy now
            held, extra["kept_seconds"] = kept if kept is not None else keep_copy(store, state, best, known)
        else:
            held = True  # local rank 0 keeps it (global rank 0 is local rank 0 under torchrun)
    if source == "self":
        nbytes = newest.header["size"] if newest is not None and newest.key == best else 0
        if nbytes and fetch.fetched(sdir, newest.header):
            source = "prefetch"  # from a peer, by this node's agent as the round closed (fetch.py)
    report_restore(source, agreed, nbytes, time.monotonic() - t0, **extra)
    last, parts = t0, [f"fetch wait {waited:.2f}"] if waited >= 0.005 else []
    if parts:
        last += waited
    for what, t in marks:
        parts.append(f"{what} {t - last:.2f}")
        last = t
    print(
        f"petctl checkpoint: rank {dist_rank()} restored step {agreed} from {source} in "
        f"{time.monotonic() - t0:.2f} s ({', '.join(parts)})",
        file=sys.stderr,
        flush=True,
    )
    if local_rank() == 0 and held:
        # the next writes' new files (the lent slot's, a newcomer's second slot) made meanwhile
        spares_after_first_step(store, snapshot_size(store, best))
    if dist_rank() == 0:
        kick_durable(store, directory, best, efs, state, held=held)
    return state, agreed
