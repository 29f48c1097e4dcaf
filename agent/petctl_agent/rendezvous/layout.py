"""Where one rendezvous lives in etcd, and how its values read (docs/rendezvous.md, "Protocol").

All keys of a run sit under ``<prefix>/<run_id>/``: ``nodes/<id>`` (membership, on the node's
lease), ``rounds/<r>`` (open marker, then the record; ``rounds/closed``), ``joins/<r>/<id>`` (on
the node's lease), ``ranks/<r>/<nonce>/<id>`` (each participant's rank, read once by that node),
``members/<r>`` (the full rank order, read only by a leader that takes over) and
``store/<r>/...`` (the agent-side store); ``failures/<r>/<instance-id>`` (a node's worker failure in
round r) and ``culprits/<r>`` (the node round r's failure began on, with its count: the agent's
``elastic/culprit.py``). Round numbers have 10 digits, so keys sort by round.
"""

from __future__ import annotations

import json
from typing import Any

#: a watcher's copy of a key: (value, create_revision, mod_revision)
Item = tuple[str, int, int]
#: round -> (its open marker or record, the key's create_revision)
Rounds = dict[int, tuple[dict[str, Any], int]]


class Keys:
    """The etcd keys of one run (directories end in ``/`` so that a prefix covers only them)."""

    def __init__(self, prefix: str, run_id: str) -> None:
        self.base = f"{prefix.rstrip('/')}/{run_id}"
        self.nodes = f"{self.base}/nodes/"
        self.rounds = f"{self.base}/rounds/"
        self.closed = f"{self.rounds}closed"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    def round(self, r: int) -> str:
        return f"{self.rounds}{r:010d}"

    def joins(self, r: int) -> str:
        return f"{self.base}/joins/{r:010d}/"

    def join(self, r: int, node_id: str) -> str:
        return f"{self.joins(r)}{node_id}"

    def store(self, r: int) -> str:
        return f"{self.base}/store/{r:010d}/"

    def ranks(self, r: int) -> str:
        return f"{self.base}/ranks/{r:010d}/"

    def rank(self, r: int, nonce: str, node_id: str) -> str:
        return f"{self.ranks(r)}{nonce}/{node_id}"

    def members(self, r: int) -> str:
        return f"{self.base}/members/{r:010d}"

    def failures(self, r: int) -> str:
        return f"{self.base}/failures/{r:010d}/"

    def failure(self, r: int, instance_id: str) -> str:
        return f"{self.failures(r)}{instance_id}"

    @property
    def culprits(self) -> str:
        return f"{self.base}/culprits/"

    def culprit(self, r: int) -> str:
        return f"{self.culprits}{r:010d}"


#: ids at the head of a record (the leader and its successors): what finding the leader reads
HEAD = 8


def head(rec: dict[str, Any] | None) -> list[str]:
    """The first ids of a record's rank order (its ``head``); [] for none."""
    return list((rec or {}).get("head", []))


def key_name(key: str) -> str:
    """The last part of a key: a node id, a round number."""
    return key.rstrip("/").rsplit("/", 1)[-1]


def loads(v: str | bytes | None) -> dict[str, Any]:
    """A JSON object value; anything else reads as empty."""
    try:
        d = json.loads(v or "{}")
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}


def rounds_view(items: dict[str, Item]) -> tuple[Rounds, bool]:
    """The rounds and the closed flag, from a watcher's copy of the rounds prefix."""
    out: Rounds = {}
    closed = False
    for k, (v, created, _) in items.items():
        name = key_name(k)
        if name == "closed":
            closed = True
        elif name.isdigit():
            out[int(name)] = (loads(v), created)
    return out, closed


def latest_closed(rounds: Rounds) -> tuple[int, dict[str, Any] | None]:
    """The newest closed round and its record; (0, None) when none is."""
    closed = [r for r, (v, _) in rounds.items() if v.get("state") == "closed"]
    if not closed:
        return 0, None
    r = max(closed)
    return r, rounds[r][0]
