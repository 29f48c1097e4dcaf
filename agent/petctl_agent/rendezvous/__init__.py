"""petctl's own rendezvous handler on etcd (v2 API, python-etcd): ``--rdzv-backend petctl-etcd``.

May import: the contracts (spec, settings, workarounds); torchrun loads it without the agent.

Why not torch's ``etcd-v2`` (``DynamicRendezvousHandler`` + ``EtcdRendezvousBackend``): it
keeps the whole rendezvous state in one JSON blob that every node rewrites with
compare-and-swap and *polls* (1 s sleep + 1 s cache), waits a last call (30 s by default)
once MIN is reached, and only counts a node dead after keep-alive x attempts (5 s x 3). A
membership change therefore costs 8-20 s even tuned. Here:

* **Membership**: one key per node, ``<base>/nodes/<id>``, TTL ``ttl`` (2 s) refreshed every
  ``refresh`` (0.5 s) with etcd's silent refresh (``refresh=true``: no watch event). Leaving
  deletes it at once; a dead node's key expires (etcd's expiry sweep adds <= 0.5 s).
* **Rounds**: one key per round, ``<base>/rounds/<r>``. A participant that wants a new round
  (or the leader, on a membership change) creates it as an *open marker*
  (``prevExist=false``); the leader replaces it with the *record* (``prevIndex`` CAS):
  ordered participants, their addresses, master address and port. Every node watches
  ``<base>/rounds``; that is how running nodes learn that a new round is open
  (:meth:`num_nodes_waiting`) and how joining nodes learn that theirs closed.
* **Joins**: ``<base>/joins/<r>/<id>``, one write per node per round, watched only by the
  leader.
* **Leader**: the first *live* node in the order "participants of the last round (in rank
  order), then newcomers by registration index". Normally rank 0 of the last round, so
  rank 0 stays put. The leader alone watches ``<base>/nodes`` (all membership events) and
  the joins; every other node watches only the leader's key (silent while it lives) and
  the rounds directory. So a round costs O(N) etcd requests, never O(N^2): each node
  registers once, refreshes, writes one join, and receives ~3 round events (open, record,
  expiry of the previous record); the leader additionally receives one event per join.
* **Closing**: the leader closes round r as soon as every live registered node has joined
  it, at least ``min_nodes`` did, and no node registered within the last ``settle`` seconds
  (0.5 s; skipped when the ``expected_nodes`` hint is already met). Extra nodes beyond
  ``max_nodes`` wait for the next round. Nodes that are still booting are not registered,
  so they never hold a round open: a node registers when it first calls
  :meth:`next_rendezvous`.
* **Store**: workers host their own TCPStore (``use_agent_store`` is False): rank 0's node
  picks a free port below the ephemeral range when it joins and the record carries it as ``MASTER_PORT``; no store
  round trip is needed to learn it, so a dead rank 0 can never leave others blocked in
  ``store.get("MASTER_ADDR")``. The agent-side store returned in ``RendezvousInfo`` is torch's
  ``EtcdStore`` under ``<base>/store/<r>`` (only used by torch's exit barrier and by the
  non-identical rank assignment).
* **etcd outages**: every watcher re-reads its keys after a connection error and resumes from
  the read's index; a restarted etcd (same data) changes nothing, and membership losses
  seen within ``ttl + 1`` s of a reconnect are not acted on (keys that expired while etcd
  was down come back with the next refresh). A replaced etcd (empty data dir; seen as a
  changed cluster id, an index that went backwards, or our key gone) drops every watcher's
  view, the refresher re-registers, running nodes see their round record gone and form a
  new round; the previous rank order is kept from local memory.

Register with torch: importing this package registers ``petctl-etcd`` in torch's handler
registry; ``python -m petctl_agent.rendezvous <torchrun args>`` runs torchrun with it. See
docs/rendezvous.md.

Modules, one job each: :mod:`.config` (settings), :mod:`.layout` (the etcd keys and how their
values read), :mod:`.client` (python-etcd clients that count requests and notice a new etcd),
:mod:`.watcher` (a local copy of a key tree kept current by a watch), :mod:`.membership`
(registration, the refresher, losing etcd's state), :mod:`.leader` (opening and closing
rounds), :mod:`.joining` (``next_rendezvous``), :mod:`.handler` (the torch handler and its
state), :mod:`.registry` (torch's registry, ``python -m``), :mod:`.entry` (torchrun's entry point).
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
