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
     the agreed step, its copy checked, when it is newer than ``latest``, had it persisted (:func:`.memory_keep.persist_before_efs`:
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

Made of: this worker's hold on the store, its persisters and its reports (:mod:`.memory_store`),
the save (:mod:`.memory_save`), the restore (:mod:`.memory_restore`) and what follows it -- a
peer's copy kept, the step made durable, the persist before a fall back to EFS
(:mod:`.memory_keep`). This module is their face: ``petctl_agent.checkpoint`` calls ``memory.save``,
``memory.resume`` and the rest through it.
"""

from __future__ import annotations

from petctl_agent.checkpointing.memory_restore import resume
from petctl_agent.checkpointing.memory_save import save
from petctl_agent.checkpointing.memory_store import (
    FALLBACK_REPORT,
    NAME,
    RESTORE_REPORT,
    PeerRestoreError,
    agreed_snapshot_dir,
    close_persisters,
    report_restore,
    snapshot_dir,
    start_due_spares,
)

__all__ = [
    "FALLBACK_REPORT",
    "NAME",
    "RESTORE_REPORT",
    "PeerRestoreError",
    "agreed_snapshot_dir",
    "close_persisters",
    "report_restore",
    "resume",
    "save",
    "snapshot_dir",
    "start_due_spares",
]
