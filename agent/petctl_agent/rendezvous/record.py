"""What a closed round leaves in etcd, and what is read back from it: the record and the rank
keys (:func:`publish_round`, :func:`read_rank`, :func:`read_current_rank`), the record's
``returned``/``out`` (:func:`_came_back`), and the rank order and ``seq`` carried across etcds
(:func:`next_seq`, :func:`_order_from_joins`). Functions of what they are given; the leader
(:mod:`.leading`) writes, every node reads. See docs/rendezvous.md, "Closing a round, and ranks".
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from petctl_agent.rendezvous import etcd_ops, etcd_types
from petctl_agent.rendezvous import etcdv3 as v3
from petctl_agent.rendezvous.layout import HEAD, Keys, loads

#: etcd's default ``--max-txn-ops``: the most operations one txn may carry (etcd-io/etcd#7976)
MAX_TXN_OPS = etcd_ops.MAX_TXN_OPS
#: ids of the open marker's ``waiting`` and ``gone`` lists (their counts are in ``n_waiting``, ``n_gone``)
MARKER_IDS = 16


def publish_round(
    etcd: v3.Client,
    keys: Keys,
    target: int,
    parts: list[str],
    record: dict[str, Any],
    cmp: list[dict[str, Any]],
    ops: list[dict[str, Any]],
) -> tuple[etcd_types.TxnResult, dict[str, Any]]:
    """Close round ``target`` with ``parts`` (rank order): each participant's rank in its own key
    ``ranks/<target>/<nonce>/<id>`` (batches of at most ``MAX_TXN_OPS`` puts, written before the
    record), then one txn guarded by ``cmp`` that writes the record (naming the nonce) and the full
    order (``members/<target>``), deletes round ``target - 2``'s ranks and order, and runs ``ops``
    (at most ``MAX_TXN_OPS - 4``). A leader that loses the race leaves rank keys only
    under a nonce no record names; they go with the round's other keys (``ranks/<target>/`` is
    deleted when round ``target + 2`` closes). Returns the txn's result and the record."""
    nonce = uuid.uuid4().hex[:12]
    puts = [etcd_ops.put_op(keys.rank(target, nonce, n), str(i)) for i, n in enumerate(parts)]
    for i in range(0, len(puts), MAX_TXN_OPS):
        etcd.txn([], puts[i : i + MAX_TXN_OPS])
    rec = {
        **record,
        "state": "closed",
        "round": target,
        "n": len(parts),
        "head": parts[:HEAD],
        "nonce": nonce,
    }
    ops = [
        etcd_ops.put_op(keys.round(target), json.dumps(rec)),
        etcd_ops.put_op(keys.members(target), json.dumps(parts)),
        etcd_ops.delete_op(keys.ranks(target - 2), prefix=True),  # every nonce's, a lost race's too
        etcd_ops.delete_op(keys.members(target - 2)),
        *ops,
    ]
    return etcd.txn(cmp, ops), rec


def read_rank(etcd: v3.Client, keys: Keys, target: int, rec: dict[str, Any], node_id: str) -> int | None:
    """This node's rank in closed round ``target`` (its record ``rec``); None: left out."""
    kv = etcd.get(keys.rank(target, str(rec.get("nonce", "")), node_id))
    return _rank(kv)


def read_current_rank(
    etcd: v3.Client, keys: Keys, target: int, rec: dict[str, Any], node_id: str
) -> tuple[int | None, bool]:
    """:func:`read_rank`, and whether round ``target + 1`` has closed since (one txn): a view
    that lags (a paused agent, a slow watch) can show ``target`` closed with us after the next
    round replaced it without us. Our rank key lives on until ``target + 2`` closes, so the
    rank alone would have us start workers for a round our peers have left."""
    r = etcd.txn(
        [],
        [
            etcd_ops.range_op(keys.rank(target, str(rec.get("nonce", "")), node_id)),
            etcd_ops.range_op(keys.round(target + 1)),
        ],
    )
    rank, nxt = r.responses
    assert isinstance(rank, etcd_types.RangeResult) and isinstance(nxt, etcd_types.RangeResult)
    replaced = bool(nxt.kvs) and loads(nxt.kvs[0].value).get("state") == "closed"
    return _rank(rank.kvs[0] if rank.kvs else None), replaced


def _rank(kv: etcd_types.KeyValue | None) -> int | None:
    if kv is None:
        return None
    try:
        return int(kv.text)
    except ValueError:
        return None


def _came_back(marker: str | None, prev_record: str | None, parts: list[str]) -> dict[str, Any]:
    """The record's ``returned`` and ``out`` (at most ``MARKER_IDS`` ids each, only when not empty).

    ``out``: nodes the opening marker named gone that are not in this round. ``returned``:
    participants of this round that were named gone by its marker, or are the previous round's
    ``out``: the same node id (the same agent process) came back within a round, so it was never
    lost (its agent stalled past the lease read, not dead). The agents charge the restart they
    took as free for that "loss" (docs/rendezvous.md, "A node named gone that comes back").
    """
    named_now = loads(marker).get("gone") if marker else None
    out_before = loads(prev_record).get("out") if prev_record else None
    gone = [str(n) for n in named_now] if isinstance(named_now, list) else []
    named = set(gone) | ({str(n) for n in out_before} if isinstance(out_before, list) else set())
    in_round = set(parts)
    got: dict[str, Any] = {}
    back = sorted(named & in_round)
    if back:
        got["returned"] = back[:MARKER_IDS]
    out = sorted(n for n in gone if n not in in_round)
    if out:
        got["out"] = out[:MARKER_IDS]
    # n_out: how many named gone are not in this round. A marker names at most MARKER_IDS ids:
    # the ones it did not list are counted out (not known to be back), so n_out > len(out) says
    # "not every one is known": an agent then never charges (docs/rendezvous.md)
    n_gone = loads(marker).get("n_gone") if marker else None
    n_out = len(out) + (max(0, n_gone - len(gone)) if isinstance(n_gone, int) else 0)
    if n_out:
        got["n_out"] = n_out
    return got


def _prev(j: dict[str, Any]) -> tuple[int, int, str | None] | None:
    """A join's ``prev``: ``[seq, rank, token]`` (the ``seq`` of the round it last ran in, its
    rank there, the boot token of the etcd that round ran on); ``[round, rank]`` from a node
    that predates them."""
    p = j.get("prev")
    if not isinstance(p, list) or len(p) not in (2, 3) or not all(isinstance(x, int) for x in p[:2]):
        return None
    token = p[2] if len(p) == 3 and isinstance(p[2], str) else None
    return p[0], p[1], token


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def next_seq(rec: dict[str, Any] | None, latest: int, joins: dict[str, dict[str, Any]]) -> int:
    """The ``seq`` of the round that follows closed round ``latest`` (its record ``rec``; None:
    no closed round in this etcd). Round numbers restart on every etcd, so they cannot be
    compared across a replacement; ``seq`` is a Lamport clock that can: one more than the
    newest round any participant ran in (``prev``) or saw closed (``seen``), on any etcd, and
    than this etcd's last round. With no replacement ever it equals the round number."""
    top = _int(rec.get("seq", latest)) if rec is not None else 0
    for j in joins.values():
        p = _prev(j)
        top = max(top, p[0] if p else 0, _int(j.get("seen")))
    return top + 1


def _order_from_joins(joins: dict[str, dict[str, Any]]) -> list[str]:
    """With no closed round in this etcd (a first round, or etcd replaced): the rank order each
    joined node remembers (``prev``), those of the newest round only. Newest by ``seq``, not by
    round number: after two replacements a node that last ran on the first etcd carries a round
    number of that etcd, which says nothing against the second one's. Two rounds with the same
    ``seq`` (on two etcds, no node of one having seen the other) are told apart by the etcd's
    boot token: the one most joined nodes ran in wins."""
    prevs = {n: p for n, p in ((n, _prev(j)) for n, j in joins.items()) if p is not None}
    if not prevs:
        return []
    top = max(p[0] for p in prevs.values())
    groups: dict[str | None, list[str]] = {}
    for n, p in prevs.items():
        if p[0] == top:
            groups.setdefault(p[2], []).append(n)
    _, best = max(groups.items(), key=lambda kv: (len(kv[1]), kv[0] or ""))
    return sorted(best, key=lambda n: (prevs[n][1], n))
