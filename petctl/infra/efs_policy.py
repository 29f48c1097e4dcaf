"""A file system the user brings (``setup --efs-id``) must keep each job in its own directory.

Each job mounts the file system through its own access point, as its own POSIX user, and sees
nothing above ``/petctl/jobs/<job>``. That holds only if nobody can mount *without* an access point
(the root, which holds every job's checkpoints): a checkpoint one job writes into another's
directory runs its code there at the next ``torch.load``. EFS's default policy (no policy set)
"grants full access to any anonymous client that can connect" (iam-access-control-nfs-efs.html,
"Default EFS file system policy"), and every job's instances reach the mount targets.

So :func:`open_to_root_mounts` reads the policy and says why it is not safe, or None when it is:

* no policy: the default one, which lets anyone mount the root;
* no Deny, for every principal, of ``elasticfilesystem:ClientMount`` whenever the request has no
  ``elasticfilesystem:AccessPointArn`` (``Null`` true, or a negated ``String``/``Arn`` operator on that
  key, which also matches when the key is absent: IAM User Guide, "Condition operators", negated
  operators and missing keys);
* an Allow of a client action to every principal (``*``) that no access-point condition narrows:
  any instance could then mount any job's access point, which undoes the per-job roles.

:func:`merged_policy` is what ``--efs-apply-policy`` writes: petctl's two Deny statements (the very
ones ``infra.yaml.j2`` sets on a file system petctl creates) added to the statements the file
system already has, never replacing them (a file system has one policy, and its owner's Allows
for an administrator stay).
"""

from __future__ import annotations

import fnmatch
from typing import Any

CLIENT_ACTIONS = (
    "elasticfilesystem:ClientMount",
    "elasticfilesystem:ClientWrite",
    "elasticfilesystem:ClientRootAccess",
)
AP_KEY = "elasticfilesystem:accesspointarn"  # condition keys compare case-insensitively
#: Negated operators match a request without the key too, so such a Deny refuses root mounts.
NEGATED = {"stringnotequals", "stringnotlike", "arnnotequals", "arnnotlike"}


def petctl_policy() -> dict[str, Any]:
    """The file system policy ``infra.yaml.j2`` gives the file system petctl creates (one source)."""
    from petctl import templates

    template = templates.load_template(templates.render_infra(az_count=1, create_efs=True))
    return template["Resources"]["FileSystem"]["Properties"]["FileSystemPolicy"]


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _everyone(statement: dict[str, Any]) -> bool:
    principal = statement.get("Principal")
    if principal == "*":
        return True
    return isinstance(principal, dict) and "*" in [str(p) for p in _list(principal.get("AWS"))]


def _covers(statement: dict[str, Any], action: str, fs_arn: str) -> bool:
    if "NotAction" in statement or "NotResource" in statement or "NotPrincipal" in statement:
        return False  # not reasoned about: never counted as the protecting Deny
    actions = [str(a).lower() for a in _list(statement.get("Action"))]
    if not any(fnmatch.fnmatchcase(action.lower(), a) for a in actions):
        return False
    resources = [str(r) for r in _list(statement.get("Resource"))] or ["*"]
    return any(fnmatch.fnmatchcase(fs_arn, r) for r in resources)


def _denies_without_access_point(condition: dict[str, Any]) -> bool:
    """True when the condition holds for every request that names no access point: it tests only
    the access point key, in a way a missing key satisfies."""
    tests = [
        (op.lower(), key.lower(), value) for op, block in condition.items() for key, value in block.items()
    ]
    if len(tests) != 1:
        return False  # another test could fail for a root mount, and the Deny would not apply
    op, key, value = tests[0]
    if key != AP_KEY:
        return False
    if op == "null":
        return [str(v).lower() for v in _list(value)] == ["true"]
    return op in NEGATED


#: Operators that pin the access point key to the values given (not a pattern, not a negation)
EXACT = {"stringequals", "arnequals"}


def _narrowed_to_access_points(condition: dict[str, Any]) -> bool:
    """Does the condition pin the access point to named ARNs? ``StringEquals``/``ArnEquals`` on
    the key with concrete values only: ``Null: false`` or ``StringLike: "*"`` admit any access
    point, and any job's instance could mount another job's."""
    for op, block in condition.items():
        if op.lower() not in EXACT:
            continue
        for key, value in block.items():
            values = [str(v) for v in _list(value)]
            if key.lower() == AP_KEY and values and not any("*" in v or "?" in v for v in values):
                return True
    return False


def open_to_root_mounts(policy: dict[str, Any] | None, fs_arn: str) -> str | None:
    """Why ``policy`` (None: the file system has none) lets a client reach every job's files, or
    None when it does not."""
    if policy is None:
        return "has no file system policy, so EFS's default lets any client that reaches a mount target mount its root"
    statements = [s for s in _list(policy.get("Statement")) if isinstance(s, dict)]
    guarded = any(
        s.get("Effect") == "Deny"
        and _everyone(s)
        and _covers(s, "elasticfilesystem:ClientMount", fs_arn)
        and _denies_without_access_point(s.get("Condition") or {})
        for s in statements
    )
    if not guarded:
        return (
            "has a file system policy that does not deny mounts without an access point "
            "(a Deny of elasticfilesystem:ClientMount to every principal when elasticfilesystem:AccessPointArn "
            "is Null), so a client can mount its root"
        )
    for s in statements:
        if (
            s.get("Effect") == "Allow"
            and _everyone(s)
            and any(_covers(s, a, fs_arn) for a in CLIENT_ACTIONS)
            and not _narrowed_to_access_points(s.get("Condition") or {})
        ):
            sid = f" {s['Sid']}" if s.get("Sid") else ""
            return (
                f"has a file system policy whose statement{sid} allows every principal to mount it, "
                f"so any job's instance could mount another job's access point"
            )
    return None


def merged_policy(current: dict[str, Any] | None) -> dict[str, Any]:
    """``current`` with petctl's statements added (those whose Sid it already has are replaced)."""
    ours = petctl_policy()
    if current is None:
        return ours
    sids = {s.get("Sid") for s in ours["Statement"]}
    kept = [s for s in _list(current.get("Statement")) if not (isinstance(s, dict) and s.get("Sid") in sids)]
    return {**current, "Version": current.get("Version", "2012-10-17"), "Statement": kept + ours["Statement"]}
