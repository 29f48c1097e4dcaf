"""cfn-lint rules for IAM: no broad managed policies; no SSM parameter reads; S3 writes only to one
job's own reports; a job's TLS keys read only by name, and never both by one role.

An action or resource hidden behind an intrinsic counts as a violation (see :mod:`petctl.lint_rules`).
cfn-lint loads this file by path: keep it free of relative imports.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator
from typing import Any

from cfnlint.template import Template

from petctl.lint_rules._common import Finding, as_list, each_property, get_in, rule, strings

LEAST_PRIVILEGE_URL = (
    "https://docs.aws.amazon.com/IAM/latest/UserGuide/best-practices.html#grant-least-privilege"
)
#: What can hold identity policies and attach managed ones.
IDENTITIES = ["AWS::IAM::Role", "AWS::IAM::User", "AWS::IAM::Group"]
#: Object writes an instance could use to change or remove what a job reads.
WRITE_ACTIONS = (
    "s3:putobject",
    "s3:putobjectacl",
    "s3:putobjecttagging",
    "s3:deleteobject",
    "s3:deleteobjectversion",
    "s3:restoreobject",
    "s3:replicateobject",
)
#: A write resource: this job's own reports (status/, boot/, the checkpoint deletion's
#: boot/cleanup/); never code/, dist/ or job.json.
SCOPED = re.compile(
    r"^arn:\$\{AWS::Partition\}:s3:::(\$\{[A-Za-z0-9]+\}|[a-z0-9][a-z0-9.-]+)"
    r"/petctl/jobs/\$\{JobName\}/(status|boot|boot/cleanup)/\*$"
)
#: The one object a statement granting only s3:DeleteObject may also name: the job's CA key,
#: which the agent deletes when the job ends (nothing can be written or read through it).
CA_KEY_DELETE = re.compile(
    r"^arn:\$\{AWS::Partition\}:s3:::(\$\{[A-Za-z0-9]+\}|[a-z0-9][a-z0-9.-]+)"
    r"/petctl/jobs/\$\{JobName\}/tls/ca\.key$"
)

#: Object reads (identity policies) that would fetch a job's keys.
READ_ACTIONS = ("s3:getobject", "s3:getobjectversion")
#: The job's secret keys under petctl/jobs/<job>/tls/ (petctl/tls.py).
TLS_KEYS = ("ca.key", "client.key")


def _sub_text(value: Any) -> Any:
    """The text of a ``{"Fn::Sub": text}``; any other value as it is."""
    if isinstance(value, dict) and list(value) == ["Fn::Sub"]:
        return value["Fn::Sub"]
    return value


def _grants(actions: Any, wanted: Iterable[str]) -> bool:
    """Whether IAM ``actions`` (wildcards allowed) cover one of ``wanted`` (lower case).

    An intrinsic among them counts as a grant: a promise we cannot read is not kept.
    """
    if any(not isinstance(a, str) for a in as_list(actions)):
        return True
    patterns = [a.lower() for a in as_list(actions)]
    return any(fnmatch.fnmatchcase(action, p) for p in patterns for action in wanted)


def _policy_documents(cfn: Template) -> list[tuple[list, Any]]:
    """``(path, PolicyDocument)`` of every identity policy: inline role/user/group policies and
    AWS::IAM::Policy / AWS::IAM::ManagedPolicy resources."""
    found: list[tuple[list, Any]] = []
    for name, policies in each_property(cfn, IDENTITIES, "Policies"):
        for index, policy in enumerate(policies if isinstance(policies, list) else []):
            if isinstance(policy, dict):
                path = ["Resources", name, "Properties", "Policies", index, "PolicyDocument"]
                found.append((path, policy.get("PolicyDocument")))
    for name, document in each_property(
        cfn, ["AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"], "PolicyDocument"
    ):
        found.append((["Resources", name, "Properties", "PolicyDocument"], document))
    return found


def _allow_statements(document: Any) -> Iterator[tuple[int, dict]]:
    """``(index, statement)`` of each Allow statement of a policy document."""
    for index, statement in enumerate(as_list(get_in(document, "Statement"))):
        if isinstance(statement, dict) and statement.get("Effect") == "Allow":
            yield index, statement


#: AWS managed policies that grant ssm:GetParameter(s) on every parameter of the account.
PARAMETER_READING_POLICIES = (
    "AmazonSSMManagedInstanceCore",
    "AmazonEC2RoleforSSM",
    "AmazonSSMReadOnlyAccess",
)
#: Reads of SSM parameters (SecureStrings included) and of their history.
PARAMETER_READS = (
    "ssm:getparameter",
    "ssm:getparameters",
    "ssm:getparametersbypath",
    "ssm:getparameterhistory",
)


@rule(
    "E9111",
    "https://docs.aws.amazon.com/systems-manager/latest/userguide/getting-started-create-iam-instance-profile.html",
    "iam",
    "ssm",
)
def NoParameterReads(cfn: Template) -> Iterator[Finding]:
    """No role reads SSM parameters

    IAM roles, users and groups attach no AWS managed policy that reads every SSM parameter of the
    account (AmazonSSMManagedInstanceCore, AmazonEC2RoleforSSM, AmazonSSMReadOnlyAccess), and no
    identity policy allows ssm:GetParameter* (wildcards such as ssm:* or ssm:Get* included):
    Session Manager needs none of it, and a job's instance could read another job's secrets.
    """
    for name, arns in each_property(cfn, IDENTITIES, "ManagedPolicyArns"):
        for index, arn in enumerate(as_list(arns or [])):
            if any(p in text for text in strings(arn) for p in PARAMETER_READING_POLICIES):
                yield (
                    ["Resources", name, "Properties", "ManagedPolicyArns", index],
                    f"{name} attaches a managed policy that reads every SSM parameter; grant Session "
                    f"Manager's actions inline instead",
                )
    for path, document in _policy_documents(cfn):
        for index, statement in _allow_statements(document):
            if "NotAction" in statement or _grants(statement.get("Action", []), PARAMETER_READS):
                yield [*path, "Statement", index], f"{path[1]} allows reading SSM parameters"


@rule("E9106", LEAST_PRIVILEGE_URL, "iam")
def NoFullAccessManagedPolicies(cfn: Template) -> Iterator[Finding]:
    """No *FullAccess managed policies

    IAM roles, users and groups attach no managed policy whose ARN contains 'FullAccess'.
    """
    for name, arns in each_property(cfn, IDENTITIES, "ManagedPolicyArns"):
        for index, arn in enumerate(as_list(arns or [])):
            if any("FullAccess" in text for text in strings(arn)):
                yield (
                    ["Resources", name, "Properties", "ManagedPolicyArns", index],
                    f"{name} attaches a *FullAccess managed policy; grant least privilege instead",
                )


def _scoped(resource: Any, delete_only: bool = False) -> bool:
    resource = _sub_text(resource)
    if not isinstance(resource, str):
        return False
    return bool(SCOPED.match(resource)) or (delete_only and bool(CA_KEY_DELETE.match(resource)))


def _delete_only(actions: Any) -> bool:
    """Exactly ``s3:DeleteObject`` (no wildcard, nothing else)."""
    listed = as_list(actions)
    return bool(listed) and all(isinstance(a, str) and a.lower() == "s3:deleteobject" for a in listed)


@rule("E9108", LEAST_PRIVILEGE_URL, "iam", "s3")
def S3WritesScopedToTheJob(cfn: Template) -> Iterator[Finding]:
    """IAM policies write to S3 only under one job's status/ or boot/ prefix

    Every Allow statement of an identity policy that grants an S3 object write (PutObject,
    DeleteObject, s3:*, wildcards...) names only resources
    arn:${AWS::Partition}:s3:::<bucket>/petctl/jobs/${JobName}/{status,boot}/*, so an instance can
    never overwrite another job's objects or its own job's code, spec or wheel. One exception: a
    statement whose only action is s3:DeleteObject may name the job's CA key
    (petctl/jobs/${JobName}/tls/ca.key), which the agent deletes when the job ends.
    NotAction/NotResource in such statements are violations.
    """
    for path, document in _policy_documents(cfn):
        for index, statement in _allow_statements(document):
            where = [*path, "Statement", index]
            if "NotAction" in statement or "NotResource" in statement:
                if "NotAction" in statement or _grants(statement.get("Action"), WRITE_ACTIONS):
                    yield where, f"{path[1]}: NotAction/NotResource hide which S3 writes are allowed"
                continue
            if not _grants(statement.get("Action"), WRITE_ACTIONS):
                continue
            delete_only = _delete_only(statement.get("Action"))
            for resource in as_list(statement.get("Resource")):
                if not _scoped(resource, delete_only):
                    yield (
                        [*where, "Resource"],
                        f"{path[1]} allows S3 writes outside one job's prefix "
                        f"(petctl/jobs/${{JobName}}/status/* or boot/*): {resource}",
                    )


def _key_pattern(resource: Any) -> str | None:
    """The object-key part of an S3 ARN (``None``: not readable as one)."""
    resource = _sub_text(resource)
    if not isinstance(resource, str):
        return None
    if resource == "*":
        return "*"
    _, sep, rest = resource.partition(":::")
    return rest.partition("/")[2] if sep else ""


@rule("E9110", LEAST_PRIVILEGE_URL, "iam", "s3", "tls")
def TlsKeysReadExactly(cfn: Template) -> Iterator[Finding]:
    """A job's TLS keys are readable only by name, and never both by one role

    An identity policy may read petctl/jobs/${JobName}/tls/ca.key or tls/client.key only through a
    resource naming that object exactly (no wildcard that sweeps them in, such as
    petctl/jobs/${JobName}/*), and no policy reads both: the CA key signs servers, the client key
    is a client's, and a role holding both could pose as the job's etcd.
    """
    for path, document in _policy_documents(cfn):
        exact: set[str] = set()
        for index, statement in _allow_statements(document):
            if not _grants(statement.get("Action", []), READ_ACTIONS) and "NotAction" not in statement:
                continue
            where = [*path, "Statement", index, "Resource"]
            for resource in as_list(statement.get("Resource", "*")):
                pattern = _key_pattern(resource)
                for key in TLS_KEYS:
                    probe = f"petctl/jobs/${{JobName}}/tls/{key}"
                    if pattern == probe:
                        exact.add(key)
                    elif pattern is None or fnmatch.fnmatchcase(probe, pattern):
                        yield where, f"{path[1]} reads tls/{key} through a wildcard: {resource}"
        if len(exact) == len(TLS_KEYS):
            yield path, f"{path[1]} reads both the job's CA key and its client key"
