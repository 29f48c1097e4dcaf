"""The account's default EBS key must be one Auto Scaling may use, or no instance launches.

Every volume the job's launch templates describe says ``Encrypted: true`` without a key, so EBS
encrypts it with the account's default EBS key (``GetEbsDefaultKmsKeyId``). AWS's managed key
(``alias/aws/ebs``) always works. A customer managed key works only if Auto Scaling's
service-linked role (``AWSServiceRoleForAutoScaling``) may use it, through the key policy or a
grant; otherwise every launch fails ("Client.InternalError: Client error on launch") and the
group retries forever (Amazon EC2 Auto Scaling User Guide, "Required AWS KMS key policy for use
with encrypted volumes"). ``run-job`` checks that before anything is created. What petctl cannot
read (no ``kms:GetKeyPolicy``) it says and goes on: the key may still be fine.
"""

from __future__ import annotations

import json
from typing import Any

from petctl.context import Context
from petctl.errors import ConfigError

#: What EC2 does with the key for Auto Scaling's launches: create the volume's data key, decrypt
#: it, and grant itself use of it (the service-linked role's grant for the volume).
NEEDED = ("kms:CreateGrant", "kms:Decrypt", "kms:GenerateDataKeyWithoutPlaintext")
SLR_PATH = "role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"


def service_linked_role(partition: str, account: str) -> str:
    return f"arn:{partition}:iam::{account}:{SLR_PATH}"


def _covers(actions: Any, needed: str) -> bool:
    actions = [actions] if isinstance(actions, str) else list(actions or [])
    for a in actions:
        a = a.lower()
        if a in ("*", "kms:*", needed.lower()) or (a.endswith("*") and needed.lower().startswith(a[:-1])):
            return True
    return False


def _principals(statement: dict[str, Any]) -> list[str]:
    p = statement.get("Principal")
    if p == "*":
        return ["*"]
    aws = (p or {}).get("AWS") if isinstance(p, dict) else None
    return [aws] if isinstance(aws, str) else list(aws or [])


def policy_allows(policy: dict[str, Any], role: str) -> bool:
    """Whether the key policy's Allow statements naming ``role`` (or ``*``) cover every NEEDED
    action. Conditions are not evaluated (AWS's documented statements carry one on CreateGrant:
    ``kms:GrantIsForAWSResource``, which EC2's own grant meets)."""
    statements = policy.get("Statement") or []
    statements = [statements] if isinstance(statements, dict) else statements
    allowed = [
        s for s in statements if s.get("Effect") == "Allow" and any(p in ("*", role) for p in _principals(s))
    ]
    return all(any(_covers(s.get("Action"), n) for s in allowed) for n in NEEDED)


def grants_allow(grants: list[dict[str, Any]], role: str) -> bool:
    ops = {op for g in grants if g.get("GranteePrincipal") == role for op in g.get("Operations") or []}
    return all(n.split(":", 1)[1] in ops for n in NEEDED)


def check(ctx: Context) -> None:
    """Refuse, in one line, a default EBS key that Auto Scaling's role may not use."""
    gateway = ctx.gateway()
    key = gateway.compute.ebs_default_key_id()
    if key is None or key.endswith("alias/aws/ebs"):
        return
    keys = gateway.keys
    meta = keys.describe(key)
    if meta is None:
        ctx.ui.warn(f"could not read the account's default EBS key {key}; if launches fail, check its policy")
        return
    if meta.get("KeyManager") == "AWS":
        return
    arn = meta["Arn"]
    if meta.get("KeyState") not in (None, "Enabled"):
        raise ConfigError(
            f"the account's default EBS key {arn} is {meta['KeyState']}: no encrypted volume can be "
            "made; enable it, or set another default (aws ec2 modify-ebs-default-kms-key-id)"
        )
    role = service_linked_role(arn.split(":")[1], gateway.check_credentials())
    policy, grants = keys.policy_and_grants(arn)
    if policy is None:
        ctx.ui.warn(
            f"could not read the policy of the account's default EBS key {arn}; Auto Scaling's "
            "service-linked role must be allowed to use it, or every launch fails"
        )
        return
    if policy_allows(json.loads(policy), role) or grants_allow(grants or [], role):
        return
    raise ConfigError(
        f"the account's default EBS key {arn} is a customer managed key that Auto Scaling's "
        f"service-linked role ({role}) may not use, so every launch would fail: allow it "
        f"{', '.join(NEEDED)} in the key policy or a grant (aws kms create-grant), or set the "
        "default back to alias/aws/ebs (aws ec2 reset-ebs-default-kms-key-id)"
    )
