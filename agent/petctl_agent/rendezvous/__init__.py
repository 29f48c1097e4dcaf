"""petctl's own rendezvous handler on etcd's v3 API: ``--rdzv-backend petctl-etcd``.

May import: the contracts (spec, settings, workarounds); torchrun loads it without the agent.

Why not torch's ``etcd-v2`` (``DynamicRendezvousHandler`` + ``EtcdRendezvousBackend``): it
keeps the whole rendezvous state in one JSON blob that every node rewrites with
compare-and-swap and *polls* (1 s sleep + 1 s cache), waits a last call (30 s by default)
once MIN is reached, and only counts a node dead after keep-alive x attempts (5 s x 3). A
membership change therefore costs 8-20 s even tuned. (python-etcd and the v2 API stay only
for that fallback; etcd 3.6 removed v2.) Here, through :mod:`.etcdv3`, our stdlib client of
etcd's v3 JSON gateway:

* **Membership**: one key per node, ``<base>/nodes/<id>``, written once on the node's
  **lease** (TTL ``ttl``, 6 s, kept alive every ``refresh``, 1 s: keepalives are no raft
  writes). Leaving revokes the lease (the key goes at once); a dead node's lease expires. A
  re-registration while the key lives (a new lease, same key) is no loss.
* **Rounds**: one key per round, ``<base>/rounds/<r>``: an *open marker* (txn
  ``create_revision == 0``), replaced by the *record* in a txn on the marker's
  ``mod_revision``: ordered participant ids, rank 0's address and master port (ids only).
  The same txn puts the record it replaces on a short lease and deletes old joins and
  stores; older records are never touched again. Every node watches ``<base>/rounds/`` by
  revision (no event window; a ``Compacted`` revision costs one re-read).
* **Joins**: ``<base>/joins/<r>/<id>`` (on the node's lease), one write per node per round,
  watched only by the leader.
* **Leader**: the first *live* node in the order "participants of the last round (in rank
  order), then newcomers by registration revision", normally rank 0 of the last round. It
  alone watches ``<base>/nodes/`` and the joins; every other node watches only the leader's
  key and the rounds. O(N) requests per round.
* **Opening and closing** (:mod:`.decide`, pure functions on ``time.monotonic``): a round
  opens when a participant is gone or newcomers are *ready* (joined), batched by the size
  hint until none has become ready for ``hint_wait``, at most ``hint_max`` from the first.
  It closes once MIN joined, the
  one-shot ``settle`` passed (skipped when the hint is met or no newcomer joined), and every
  registered node that
  has not joined is past its straggler deadline; nodes registering later than
  ``join_window`` after the opening wait for the next round.
* **Loss detection**: fast from the data plane (a peer's collectives fail, a worker exits:
  the agent re-joins and its join opens the round), slow from the lease (the backstop, which
  rides through a 3 s pause of an agent or of etcd).
* **Store**: rank 0's agent serves the workers' TCPStore (``use_agent_store``, as torchrun's) on
  the port it picked below the kernel's ephemeral range and holds listening from its join; the
  record carries it. The agent-side store in
  ``RendezvousInfo`` is :class:`.store.V3Store` under ``<base>/store/<r>/``.
* **etcd outages**: every watcher re-reads after an error and resumes from the read's
  revision; a restarted etcd (same data) keeps the leases. A replaced etcd is seen by its
  boot token (``/petctl/etcd-boot-token``, read with every full read) changing or
  disappearing, or by the store revision going back: every view is dropped, the keeper
  re-registers, running nodes see their round record gone and form a new round in the
  previous rank order (kept in local memory).

No deadline reads the wall clock: every one is a ``time.monotonic`` difference, and lease
TTLs run on etcd's own monotonic clock.

Register with torch: importing this package registers ``petctl-etcd`` in torch's handler
registry; ``python -m petctl_agent.rendezvous <torchrun args>`` runs torchrun with it. See
docs/rendezvous.md.

Modules, one job each: :mod:`.config` (settings), :mod:`.layout` (the etcd keys and how their
values read), :mod:`.etcdv3` (the v3 client; its connections :mod:`.etcd_transport`, values and
results :mod:`.etcd_types`, a txn's compares and ops :mod:`.etcd_ops`, watches :mod:`.etcd_watch`),
:mod:`.client` (the handler's client and request counter), :mod:`.watcher` (a local copy of a
key or prefix kept current by a watch), :mod:`.membership` (registration on a lease, the keeper,
the boot token), :mod:`.decide` (the leader's decisions), :mod:`.leader` (opening and closing
rounds), :mod:`.joining` (``next_rendezvous``), :mod:`.store` (the agent-side store),
:mod:`.handler` (the torch handler and its state), :mod:`.registry` (torch's registry,
``python -m``), :mod:`.entry` (torchrun's entry point).
"""

from petctl_agent.rendezvous.client import RequestCounter
from petctl_agent.rendezvous.config import BACKEND, DEFAULT_PORT, DEFAULT_PREFIX, Config
from petctl_agent.rendezvous.entry import torchrun_handler
from petctl_agent.rendezvous.handler import PetctlRendezvousHandler
from petctl_agent.rendezvous.joining import RendezvousLeftError
from petctl_agent.rendezvous.registry import create_handler, main, register

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "Config",
    "PetctlRendezvousHandler",
    "RendezvousLeftError",
    "RequestCounter",
    "create_handler",
    "main",
    "register",
    "torchrun_handler",
]

register()
