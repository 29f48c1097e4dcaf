"""Checkpoints of replicated state through node-local memory snapshots (``$PETCTL_SNAPSHOT_DIR``).

On when the agent exports ``PETCTL_SNAPSHOT_DIR`` (its node's store, ``/dev/shm/petctl/<job>/<instance>``,
by default; docs/agent.md, "Memory snapshots"). Then, for plain (not sharded) state:

- save: local rank 0 of every node copies the state into the node's ``replicated`` snapshot
  (``checkpointing/snapshot.py``); the ranks agree (MIN over the checkpoint's gloo group) that
  every node's copy fit; global rank 0 then asks its agent's persister (``persist.request``,
  ``checkpointing/persist.py``) to write that step to the checkpoint directory, and training goes
  on. At the job's last step, and on a drain that no staying node with a persister covers, rank 0
  waits until ``latest`` names the step (a node that leaves takes its memory with it). Without a persister serving the store (no agent), rank 0
  persists in a thread of its own, as before. Any node's "no-fit"/"unsupported" makes every rank
  take today's path (:func:`petctl_agent.checkpoint.save`) and that node's agent publishes a
  ``snapshot_fallback`` event.
- resume: the restore comes from the nearest copy of the *agreed snapshot* -- the newest, by
  ``(epoch, step)`` (``checkpointing/timeline.py``: the epoch names the worker generation, i.e. the
  history, a step is of), that some rank's node holds complete and that is not older than
  ``latest`` (a pointer without an epoch: epoch 0). Its holders are the ranks whose node holds that
  very snapshot: that epoch, that step and the content of the first holder's copy
  (``peer.digest``). A rank whose node holds the same step from another history, or other bytes,
  is no holder: it gets the agreed copy as a newcomer does, never loads its own (after a fallback
  to EFS two nodes could each hold "step N" of two histories). One all-gather agrees on all of it
  and on this generation's epoch (``timeline.begin``):

  1. the node's own snapshot of that step (checked by epoch, step and CRCs);
  2. else (no complete header of it on this node) a peer's: the ranks that hold that very snapshot
     send its bytes in stripes, each over a gloo group (a flow) of its own with the ranks that need
     it, all at once (``checkpointing/peer.py``: several flows lift AWS's 5 Gbit/s single-flow
     cap); the first source sends the header (timeout ``PETCTL_SNAPSHOT_PEER_TIMEOUT``, default
     60 s, per piece) to one rank per node (the node's other ranks load the copy it received into
     the node's store), each source straight out of the mapping
     its own restored tensors view, checking the CRCs as the pieces go (its load's one pass: the
     receivers never wait for the source's own load); the receivers check every CRC as the
     pieces arrive. A holder whose own copy fails its check (the source's too: then with every
     receiver) gets it the same way, once more, from a rank whose store holds the step and whose
     copy passed;
  3. else (no rank holds a step as new as ``latest``, or the source's copy or a receiver's check
     failed) every rank loads the checkpoint directory as today -- after a rank whose store holds
     the agreed step, its copy checked, when it is newer than ``latest``, had it persisted (:func:`_persist_before_efs`:
     a drain of the rank-0 node does not wait for EFS, so the drained step may be only in a
     survivor's memory).

  The ranks end the restore with one MIN over a gloo group with the same timeout. If that or the
  broadcast fails (the source died mid-transfer: the process group is broken for every rank),
  every rank raises :class:`PeerRestoreError` and the worker exits: falling back to EFS on only
  the ranks that saw the failure would leave the ranks at different steps, and the ranks can no
  longer agree over a broken group. The agent then restarts the round without the dead node,
  whose survivors still hold the agreed step (the next source), or EFS answers.

A node restored from a peer keeps the step: its local rank 0 receives the peer's bytes straight
into a slot of its own store, its pages allocated piece by piece as they arrive (the peer header's
CRCs, checked on arrival, are taken, so it is complete at once; no room: a buffer, not kept), so a later restart of that node
restores from itself. On the CPU the restored tensors are views of the snapshot's file, not copies
(``SnapshotStore.load``), and local rank 0 then has the store make the files its next writes will
need new in the background (``SnapshotStore.prepare_spares``), once the first step after the restore
is done (``ckpt.step``: not beside it, where every node's allocation would slow the first step). Rank 0 hands a restored step newer than
``latest`` to its node's persister; when its node could not keep it (no room), it writes the step to
EFS itself, the old way: EFS, the source of truth for a restart of the whole job, never lags by more
than one persist.

Each node's local rank 0 writes what its restore used to ``restore.json`` in the store (source
``self``/``peer``/``efs``, bytes, seconds, ``kept_seconds``); the agent publishes it as a
``snapshot_restored`` event.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from petctl_agent import knobs
from petctl_agent.checkpointing import fetch, peer, persist, timeline
from petctl_agent.checkpointing.atomic import atomic_write
from petctl_agent.checkpointing.drain import LEAVE, _local_drain_flag
from petctl_agent.checkpointing.files import read_pointer
from petctl_agent.checkpointing.persist import Persister
from petctl_agent.checkpointing.snapshot import SnapshotStore, node_name
from petctl_agent.checkpointing.writing import OK
from petctl_agent.distributed import dist_on, dist_rank

NAME = "replicated"
#: reports to the agent, in the store's directory (node/snapshots.py reads the same names)
RESTORE_REPORT = "restore.json"
FALLBACK_REPORT = "fallback.json"
_persisters: dict[tuple[str, str], Persister] = {}
_stores: dict[str, SnapshotStore] = {}
# (store, size): the spares a restore left for after the first step (start_due_spares)
_due_spares: list[tuple[SnapshotStore, int]] = []


class PeerRestoreError(RuntimeError):
    """A restore from a peer's memory failed mid-transfer: the worker exits, the next round retries."""


def _store(sdir: Path) -> SnapshotStore:
    """One store per directory in this process: its next write waits for the previous one's header."""
    s = _stores.get(str(sdir))
    if s is None:
        s = _stores[str(sdir)] = SnapshotStore(sdir, NAME)
    return s


def snapshot_dir() -> Path | None:
    d = knobs.snapshot_dir()
    return Path(d) if d else None


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _peer_timeout() -> float:
    return knobs.snapshot_peer_timeout()


def _all_min(values: list[int]) -> list[int]:
    """Element-wise MIN over every rank (the checkpoint's gloo group), or ``values`` alone."""
    if not dist_on():
        return values
    import torch
    import torch.distributed as dist

    from petctl_agent.checkpointing.group import ckpt_group

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ckpt_group())
    return [int(v) for v in t]


def _report(sdir: Path, name: str, body: dict[str, Any]) -> None:
    """A report for the agent (local rank 0 only); never fatal."""
    if _local_rank() != 0:
        return
    try:
        sdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(sdir / name, json.dumps({**body, "t": time.time()}).encode())
    except OSError:
        pass


def report_restore(source: str, step: int | None, nbytes: int, seconds: float, **extra: Any) -> None:
    """Record which source this node's restore used (``self``/``peer``/``efs``) for the agent.

    ``extra``: more fields for the event (JSON-able): ``kept_seconds`` (a peer's copy written into
    this node's store), the sharded path's ``shards``/``newest``/``back_to``.
    """
    sdir = snapshot_dir()
    if sdir is not None:
        body = {"source": source, "step": step, "bytes": int(nbytes), "seconds": round(seconds, 3), **extra}
        _report(sdir, RESTORE_REPORT, body)


def _persister(store: SnapshotStore, directory: Path, keep: int) -> Persister:
    key = (str(store.dir), str(directory))
    p = _persisters.get(key)
    if p is None:
        p = _persisters[key] = Persister(store, directory, keep)
    p.keep = keep
    return p


def _checkpoint_timeout() -> float:
    return knobs.checkpoint_timeout()


def _wait_persisted(
    store: SnapshotStore,
    step: int,
    directory: Path,
    keep: int,
    timeout: float | None = None,
    epoch: int = 0,
) -> bool:
    """True once ``latest`` names ``step`` of ``epoch`` (or newer, by ``(epoch, step)``: the
    agent's persister's, else our own write.

    False when neither got it there within ``timeout`` (default ``PETCTL_CHECKPOINT_TIMEOUT``;
    the caller then writes the state it holds the old way: a wait for EFS is never unbounded).
    """
    sdir = store.dir
    want = (int(epoch), int(step))
    deadline = time.monotonic() + (_checkpoint_timeout() if timeout is None else timeout)
    while time.monotonic() < deadline:
        if timeline.key(read_pointer(directory)) >= want:
            return True
        st = persist.state(sdir)
        if not persist.served(sdir) or (st.get("error_step") == step and st.get("dir") == str(directory)):
            break  # nobody serves the store, or its write failed: ours raises what it fails with
        time.sleep(0.02)
    per = _persister(store, directory, keep)
    with per._lock:
        persist.persist_newest(store, directory, keep)
    if timeline.key(read_pointer(directory)) < want:
        return per.wait(timeout=max(5.0, deadline - time.monotonic()))
    return True


def _not_persisted(sdir: Path, step: int) -> bool:
    """Rank 0 only: the snapshot never reached EFS in time; False makes the caller write it the old way."""
    why = f"step {step} not persisted from memory within {_checkpoint_timeout():.0f} s"
    print(f"petctl checkpoint: {why}; writing it to EFS directly", file=sys.stderr)
    _report(sdir, FALLBACK_REPORT, {"step": int(step), "reason": why})
    return False


def save(
    state: dict[str, Any],
    step: int,
    directory: Path,
    keep: int,
    *,
    wait: bool,
    complete: bool = False,
    leaving: bool = False,
) -> bool:
    """Snapshot ``state`` on every node; True when it did (persisting), False: use today's path.

    Collective (but rank 0 alone returns False when ``wait`` and the step did not reach EFS within
    ``PETCTL_CHECKPOINT_TIMEOUT``: the caller's old path then writes it; every rank still meets
    one barrier). ``wait``: rank 0 returns only once ``latest`` names ``step`` (last step, a node
    leaving). ``complete``: every node's snapshot is complete (header written) on return (the
    workers stop for a join: their memory stays, but a worker that exits kills the crc thread).
    ``leaving``: the wait is only for a drain where some node leaves (not the last step): the ranks
    then skip it when a node that stays holds the step and has its agent's persister serving its
    store (a survivor is a copy; the persist goes on in the background: rank 0's persister serves
    the request even when its node leaves, and the restarted round's rank 0, on a node that stayed,
    hands a restored step newer than ``latest`` to its own -- :func:`_kick`). Every node leaving,
    or no node that stays having a persister, still waits for EFS.
    """
    sdir = snapshot_dir()
    if sdir is None:
        return False
    store = _store(sdir)
    # which history this step is of (timeline.py): agreed at the restore, else here, once
    epoch = timeline.ensure(lambda: _seen(store, read_pointer(directory)))
    why = ""
    if _local_rank() == 0:
        # a stop or the last step waits for the header anyway: its CRCs then on several cores
        why = store.write(state, step, world_size=1, rank=0, wait=wait or complete, epoch=epoch)
    ok = why in ("", OK)
    flags = [int(ok)]
    if wait and leaving:
        # this node's memory outlives the drain and its agent's persister serves it: it holds the
        # step and can put it on EFS (MIN: -1 when some node can; rank 0's node need not be it)
        covers = _local_drain_flag() < LEAVE and persist.served(sdir)
        flags.append(-int(covers))
    agreed = _all_min(flags)
    if wait and leaving and agreed[1] < 0:
        wait, complete = False, True  # a survivor holds the step; a persister writes it (below)
    if not agreed[0]:
        if why and why != OK:
            print(
                f"petctl checkpoint: memory snapshot of step {step} skipped ({why}); writing to EFS",
                file=sys.stderr,
            )
            _report(sdir, FALLBACK_REPORT, {"step": int(step), "reason": why})
        return False
    if dist_rank() == 0:
        if persist.served(sdir):
            # the header follows: the persister waits for it
            persist.request(sdir, step, directory, keep, epoch)
            if wait:
                store.flush()
                if not _wait_persisted(store, step, directory, keep, epoch=epoch):
                    return _not_persisted(sdir, step)
        else:
            per = _persister(store, directory, keep)
            per.kick()
            if wait and not per.wait(timeout=_checkpoint_timeout()):
                return _not_persisted(sdir, step)
    elif (wait or complete) and _local_rank() == 0:
        store.flush()
    if complete and dist_rank() == 0:
        store.flush()
    return True


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


def _seen(store: SnapshotStore, pointer: dict[str, Any] | None) -> int:
    """The largest epoch among this node's complete snapshots and ``latest`` (timeline.py)."""
    return max([c.epoch for c in store.complete()] + [timeline.epoch_of(pointer)])


def resume(directory: Path, map_location: Any) -> tuple[dict[str, Any], int] | None:
    """The agreed step's state from this node's memory or a peer's; None: load EFS (collective)."""
    sdir = snapshot_dir()
    if sdir is None:
        return None
    t0 = time.monotonic()
    # a node that joins: its agent's fetch of the peers' newest snapshot ends first (fetch.py)
    waited = fetch.wait_for_fetch(sdir, _peer_timeout())
    store = _store(sdir)
    newest = store.newest()
    # a snapshot is known by (epoch, step), not its step alone (timeline.py): two nodes may hold
    # "step N" of two histories after a fallback to EFS, and an abandoned one's steps may be higher
    mine = newest.key if newest is not None else timeline.NONE
    pointer = read_pointer(directory)
    efs = timeline.key(pointer)  # an old pointer, without an epoch: epoch 0
    if not dist_on():
        timeline.begin(_seen(store, pointer), time.time_ns())  # this generation's epoch
        if mine[1] < 0 or mine < efs:
            return None
        state = store.load(mine[1], map_location=map_location, check=store.prechecked(), epoch=mine[0])
        if state is None:
            return None
        report_restore("self", mine[1], newest.header["size"] if newest else 0, time.monotonic() - t0)
        _spares_after_first_step(store, _snapshot_size(store, mine))
        _kick(store, directory, mine, efs, state, held=True)
        return state, mine[1]
    import torch.distributed as dist

    timeout = timedelta(seconds=_peer_timeout())
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
        held = _held(store, mine) if mine[1] >= 0 else None
        lr = min(_local_rank(), 31)
        rows = _all_gather_rows(
            [
                *mine,
                *efs,
                _seen(store, pointer),
                time.time_ns(),
                int(held["size"]) + 1 if held is not None else 0,
                peer.digest(held),
                _node_key(sdir) << 5 | lr,
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
                    into = store if _local_rank() == 0 else None  # the store's one writer on this node
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
            _persist_before_efs(store, best, directory, sources[0])
        return None
    extra: dict[str, Any] = {}
    held = source == "self"
    if source == "peer":
        if _local_rank() == 0:  # the store's one writer on this node
            # received straight into the store (kept, no copy), or no room there; else a copy now
            held, extra["kept_seconds"] = kept if kept is not None else _keep(store, state, best, known)
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
    if _local_rank() == 0 and held:
        # the next writes' new files (the lent slot's, a newcomer's second slot) made meanwhile
        _spares_after_first_step(store, _snapshot_size(store, best))
    if dist_rank() == 0:
        _kick(store, directory, best, efs, state, held=held)
    return state, agreed


def _spares_after_first_step(store: SnapshotStore, size: int) -> None:
    """The spares (``SnapshotStore.prepare_spares``) a restore leaves due, started by
    :func:`start_due_spares` once the first step after it is done (``ckpt.step``), not beside it.

    After a membership change every node restores at once, and each then allocates (and zeroes)
    one or two new files of the state's size: a lent slot's replacement, a newcomer's second slot.
    Started beside the first step, that kernel work competes with it and stalls every rank's
    first collective (the job's slowest rank sets the pace). The next write needs them only at the
    next checkpoint, steps later; one that comes first allocates its own file, as without a spare.
    """
    if size > 0:
        _due_spares.append((store, size))


def start_due_spares() -> None:
    """Start the spares a restore left due (:func:`_spares_after_first_step`); cheap when none are."""
    while _due_spares:
        store, size = _due_spares.pop()
        store.prepare_spares(size)


def _efs_wait_timeout() -> float:
    """The others' bound on :func:`_persist_before_efs`'s holder: 2T + 60 s (T:
    ``PETCTL_CHECKPOINT_TIMEOUT``). The holder waits at most T/2 for its agent's persister, then
    writes the step itself (one write, as a checkpoint's own fallback does) and waits at most 5 s
    more: its worst case, T/2 + a write + 5 s, stays under it for any write shorter than 1.5T."""
    return 2 * _checkpoint_timeout() + 60


def _persist_before_efs(store: SnapshotStore, key: tuple[int, int], directory: Path, holder: int) -> None:
    """Every rank is about to load EFS although rank ``holder`` holds ``key`` (epoch, step), newer than
    ``latest`` (a drain whose rank 0 left did not wait for EFS: a staying node's memory was the
    copy). The holder persists it first -- its agent's persister, else in this process, as a
    checkpoint's wait does (bounded: :func:`_efs_wait_timeout`) -- and every rank waits for it, so
    the fallback loads that step, not an older one (docs/agent.md, "Memory snapshots"). A holder
    whose store lacks a complete copy of the step (its persister would ignore the request) says so
    at once: every rank loads EFS as it is."""
    import torch.distributed as dist

    epoch, step = key
    keep = knobs.checkpoint_keep()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_efs_wait_timeout()))
    try:
        if dist.get_rank() == holder:
            newest = store.newest()
            done = False
            if not _holds(store, key) or newest is None or newest.key != key:
                why = "this node's memory no longer holds it complete"
            else:
                why = "could not be persisted"
                try:
                    if persist.served(store.dir):
                        persist.request(store.dir, step, directory, keep, epoch)
                    done = _wait_persisted(
                        store, step, directory, keep, timeout=_checkpoint_timeout() / 2, epoch=epoch
                    )
                except Exception as e:  # noqa: BLE001 - EFS trouble: the ranks load the older step
                    print(f"petctl checkpoint: {type(e).__name__}: {e}", file=sys.stderr)
            print(
                f"petctl checkpoint: the restore from memory failed; step {step} "
                + ("persisted from this node's memory first" if done else why)
                + ": every rank loads EFS",
                file=sys.stderr,
                flush=True,
            )
        dist.barrier(group=group)
    except Exception as e:  # noqa: BLE001 - the holder died meanwhile: as a peer dying mid-transfer
        raise PeerRestoreError(
            f"waiting for step {step} to reach EFS failed ({type(e).__name__}: {e}); exiting"
        ) from e
    finally:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001
            pass


def _snapshot_size(store: SnapshotStore, key: tuple[int, int]) -> int:
    c = next((c for c in store.complete() if c.key == key), None)
    return int(c.header["size"]) if c is not None else 0


def _keep(
    store: SnapshotStore, state: dict[str, Any], key: tuple[int, int], known: list[dict[str, Any]] | None
) -> tuple[bool, float]:
    """Write a peer's snapshot, received and checked, into this node's own store, so that a later
    restart of this node restores from itself (not a second trip over the network, or EFS when the
    source is gone by then). Blocks only for the copy: the CRCs came with the snapshot, so the
    header goes in place at once. (True when kept, the seconds it took.) Kept under the peer's
    ``key`` (epoch, step): it is that history's snapshot, not one of this generation's."""
    epoch, step = key
    t = time.monotonic()
    try:
        why = store.write(state, step, world_size=1, rank=0, known=known, epoch=epoch)
    except Exception as e:  # noqa: BLE001 - never fatal: the state is restored; only the copy is missing
        why = f"{type(e).__name__}: {e}"
    took = round(time.monotonic() - t, 3)
    if why != OK:
        print(
            f"petctl checkpoint: step {step}, restored from a peer, not kept in this node's memory ({why})",
            file=sys.stderr,
        )
    return why == OK, took


def _kick(
    store: SnapshotStore,
    directory: Path,
    key: tuple[int, int],
    efs: tuple[int, int],
    state: dict[str, Any],
    *,
    held: bool,
) -> None:
    """Rank 0 restored a snapshot newer than ``latest`` (by ``(epoch, step)``, ``key`` against
    ``efs``): make sure it reaches EFS, the source of truth for a restart of the whole job -- the
    agent's persister (else ours) when this node's store holds it (``held``: its own snapshot, or a
    peer's it kept), else written now, the old way, under the snapshot's epoch."""
    if key <= efs:
        return
    epoch, step = key
    keep = knobs.checkpoint_keep()
    if not held:  # this node's memory could not keep the step (a newcomer whose store is full)
        why = f"step {step} restored from a peer but not held in this node's memory"
        print(f"petctl checkpoint: {why}; writing it to EFS directly", file=sys.stderr)
        _report(store.dir, FALLBACK_REPORT, {"step": int(step), "reason": why})
        from petctl_agent.checkpointing.files import write_file

        write_file(state, step, directory, keep, forward_only=True, epoch=epoch)
        return
    if persist.served(store.dir):
        persist.request(store.dir, step, directory, keep, epoch)
    else:
        _persister(store, directory, keep).kick()


def _held(store: SnapshotStore, key: tuple[int, int]) -> dict[str, Any] | None:
    """The header of this node's complete snapshot of ``key`` (epoch, step) (header intact, data
    file of its size), or None. Cheap: its bytes are checked by whoever loads or sends them."""
    for c in store.complete():
        if c.key == key:
            try:
                if os.stat(store.data_path(c.slot)).st_size == int(c.header["size"]):
                    return c.header
            except OSError:
                pass
    return None


def _node_key(sdir: Path) -> int:
    """A 56-bit key of this rank's node: the host and its store (the ranks of one node share it).
    (A collision would only make a rank wait for another node's receiver, then get the step in
    the retry: its own store lacks it.)"""
    return int.from_bytes(hashlib.blake2b(node_name(sdir).encode(), digest_size=7).digest(), "big")


def _holds(store: SnapshotStore, key: tuple[int, int]) -> bool:
    return _held(store, key) is not None


def close_persisters() -> None:
    """Stop this process's persister threads and forget its stores (tests; a worker just exits)."""
    _due_spares.clear()
    timeline.reset()
    while _persisters:
        _, p = _persisters.popitem()
        p.close()
    while _stores:
        _stores.popitem()[1].close()
