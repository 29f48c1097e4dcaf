"""The requests of an etcd v3 txn, as etcd's JSON gateway reads them: comparisons
(:func:`compare`: mod or create revision, version, value, lease) and operations (:func:`put_op`,
:func:`delete_op`, :func:`range_op`), with the request bodies they share with
:class:`~.etcdv3.Client`'s calls (``_put_body``, ``_range_body``; ``_range_opts``: a range's
limit, sort and create-revision bounds), and how many operations one txn may carry
(:data:`MAX_TXN_OPS`). Pure functions: dicts in, dicts out.
"""

from __future__ import annotations

from typing import Any

from petctl_agent.rendezvous.etcd_types import _b64, prefix_end

#: etcd's default ``--max-txn-ops``: the most operations one txn may carry (etcd-io/etcd#7976);
#: more is refused ("too many operations in txn request"), so callers batch
MAX_TXN_OPS = 128

# ---- requests: compares and ops ---------------------------------------------------------------------
_TARGETS = {"mod": "MOD", "create": "CREATE", "version": "VERSION", "value": "VALUE", "lease": "LEASE"}
_FIELDS = {"MOD": "mod_revision", "CREATE": "create_revision", "VERSION": "version", "VALUE": "value"}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def compare(key: str, target: str, op: str, value: int | str | bytes) -> dict[str, Any]:
    """A txn comparison: ``compare(k, "mod", "==", 7)``; target ``mod``/``create``/``version``/
    ``value``/``lease``; op ``==``/``!=``/``<``/``>``. ``compare(k, "create", "==", 0)``: absent."""
    if target not in _TARGETS or op not in _RESULTS:
        raise ValueError(f"compare({key!r}, {target!r}, {op!r}): target must be one of "
                         f"{sorted(_TARGETS)} and op one of {sorted(_RESULTS)}")  # fmt: skip
    t = _TARGETS[target]
    c: dict[str, Any] = {"key": _b64(key), "target": t, "result": _RESULTS[op]}
    if t == "VALUE":
        if not isinstance(value, (str, bytes)):
            raise ValueError(f"compare({key!r}, 'value', ...): the value must be str or bytes")
        c["value"] = _b64(value)
    elif isinstance(value, int):
        c[_FIELDS.get(t, "lease")] = str(value)
    else:
        raise ValueError(f"compare({key!r}, {target!r}, ...): the value must be an int")
    return c


def put_op(key: str, value: str | bytes, lease: int = 0, prev_kv: bool = False) -> dict[str, Any]:
    return {"request_put": _put_body(key, value, lease, prev_kv)}


def delete_op(
    key: str, prefix: bool = False, prev_kv: bool = False, end: str | None = None
) -> dict[str, Any]:
    return {"request_delete_range": _range_body(key, prefix, end, prev_kv=prev_kv)}


def range_op(
    key: str,
    prefix: bool = False,
    limit: int = 0,
    keys_only: bool = False,
    sort: str | None = None,
    min_create: int = 0,
    max_create: int = 0,
    revision: int = 0,
    count_only: bool = False,
    end: str | None = None,
) -> dict[str, Any]:
    """A txn's read; the options as :meth:`Client.range`'s (``revision``: at that revision, 0:
    the txn's; ``count_only``: the count, no keys; ``end``: every key from ``key`` up to, not
    including, ``end``)."""
    return {
        "request_range": _range_body(
            key,
            prefix,
            end,
            revision=str(revision) if revision else None,
            count_only=count_only,
            **_range_opts(limit, keys_only, sort, min_create, max_create),
        )
    }


#: ``sort`` of a range: "<target>" ascending or "-<target>" descending; the RangeRequest enums
#: by name, as etcd's JSON gateway reads them (``sort_target``: KEY, VERSION, CREATE, MOD, VALUE)
_SORT_TARGETS = {"key": "KEY", "version": "VERSION", "create": "CREATE", "mod": "MOD", "value": "VALUE"}


def _range_opts(
    limit: int, keys_only: bool, sort: str | None, min_create: int, max_create: int
) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "limit": str(limit) if limit else None,
        "keys_only": keys_only,
        "min_create_revision": str(min_create) if min_create else None,
        "max_create_revision": str(max_create) if max_create else None,
    }
    if sort:
        target = _SORT_TARGETS.get(sort.lstrip("-"))
        if target is None:
            raise ValueError(
                f"sort={sort!r}: must be one of {sorted(_SORT_TARGETS)}, '-' first for descending"
            )
        opts["sort_order"] = "DESCEND" if sort.startswith("-") else "ASCEND"
        opts["sort_target"] = target
    return opts


def _put_body(key: str, value: str | bytes, lease: int, prev_kv: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    if prev_kv:
        body["prev_kv"] = True
    return body


def _range_body(key: str, prefix: bool, end: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key)}
    if prefix or end is not None:
        body["range_end"] = _b64(prefix_end(key) if end is None else end)
    body.update({k: v for k, v in extra.items() if v})
    return body
