"""Who may mount an EFS file system, decided as EFS does at mount time (the local ``mount`` shim and
the daemon's ``RequiresMountsFor=`` both ask :func:`authorize`).

EFS's rules (docs.aws.amazon.com/efs/latest/ug/iam-access-control-nfs-efs.html):

* no file system policy: the default one, full access for any client that reaches a mount target;
* with a policy, a client that mounts without ``iam`` is anonymous: only the file system policy's
  statements for principal ``*`` apply to it;
* a client that mounts with ``iam`` is its instance role: an Allow in *either* the file system
  policy or the role's identity policies allows an action; an explicit Deny in either wins;
* the condition keys EFS sets for NFS clients: ``aws:SecureTransport`` (``tls``),
  ``elasticfilesystem:AccessPointArn`` (``accesspoint=``, absent otherwise),
  ``elasticfilesystem:AccessedViaMountTarget`` (always true here).

Only what petctl's policies use is read (Allow/Deny, Action lists with wildcards, Resource,
Principal ``*``/``{"AWS": …}``, the operators StringEquals, StringLike, ArnEquals, ArnLike, Bool,
Null); anything else is refused rather than guessed. Standard library only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from .base import Refused

OPERATORS = ("StringEquals", "StringLike", "ArnEquals", "ArnLike", "Bool", "Null")


def _list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _condition_holds(condition: dict[str, Any], context: dict[str, str]) -> bool:
    for operator, tests in (condition or {}).items():
        if operator not in OPERATORS:
            raise Refused(
                f"file system policy condition operator {operator} is not emulated ({', '.join(OPERATORS)})"
            )
        for key, wanted in tests.items():
            values = [str(v) for v in _list(wanted)]
            actual = context.get(key)
            if operator == "Null":
                if (actual is None) != (values[0].lower() == "true"):
                    return False
            elif actual is None:
                return False
            elif operator in ("StringLike", "ArnLike"):
                if not any(fnmatch.fnmatchcase(actual, v) for v in values):
                    return False
            elif operator == "Bool":
                if actual.lower() not in [v.lower() for v in values]:
                    return False
            elif actual not in values:
                return False
    return True


def _matches(statement: dict[str, Any], action: str, resource: str, context: dict[str, str]) -> bool:
    if "NotAction" in statement or "NotResource" in statement or "NotPrincipal" in statement:
        raise Refused("NotAction/NotResource/NotPrincipal in an EFS policy are not emulated")
    if not any(fnmatch.fnmatchcase(action.lower(), str(a).lower()) for a in _list(statement.get("Action"))):
        return False
    resources = _list(statement.get("Resource")) or ["*"]  # a file system policy may leave it out
    if not any(fnmatch.fnmatchcase(resource, str(r)) for r in resources):
        return False
    return _condition_holds(statement.get("Condition") or {}, context)


def _principals(statement: dict[str, Any]) -> list[str]:
    principal = statement.get("Principal")
    if principal == "*":
        return ["*"]
    if isinstance(principal, dict):
        return [str(p) for p in _list(principal.get("AWS"))]
    return []


def authorize(
    action: str,
    fs_arn: str,
    policy: dict[str, Any] | None,
    identity: Iterable[dict[str, Any]] | None,
    principal_arns: Iterable[str],
    context: dict[str, str],
) -> str | None:
    """None when ``action`` (``elasticfilesystem:ClientMount``…) is allowed, else why not.

    ``identity``: the role's policy documents when the client mounts with ``iam`` (None: anonymous);
    ``principal_arns``: the role's ARN, which a file system policy's ``Principal`` may name."""
    if policy is None:
        return None  # the default file system policy
    names = {"*", *principal_arns} if identity is not None else {"*"}
    fs_statements = [s for s in _list(policy.get("Statement")) if names & set(_principals(s))]
    statements = fs_statements + [s for doc in identity or [] for s in _list(doc.get("Statement"))]
    matching = [s for s in statements if _matches(s, action, fs_arn, context)]
    if any(s.get("Effect") == "Deny" for s in matching):
        return f"an explicit Deny in {'the file system policy or the role' if identity is not None else 'the file system policy'}"
    if any(s.get("Effect") == "Allow" for s in matching):
        return None
    if identity is None:
        return "the file system policy allows no anonymous client (mount with iam)"
    return "neither the file system policy nor the instance role allows it"
