"""cfn-lint rules for petctl's security promises (see docs/contracts.md and the issues).

Each rule is deliberately literal: a value hidden behind Fn::If, a parameter without a safe default
or any other intrinsic counts as a violation, because a promise we cannot read is not kept.
This file is loaded by path by cfn-lint: keep it free of relative imports.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from cfnlint.rules import CloudFormationLintRule, RuleMatch
from cfnlint.template import Template

OPEN_CIDRS = {"0.0.0.0/0", "::/0"}


def _properties(resource: Any) -> dict:
    props = resource.get("Properties") if isinstance(resource, dict) else None
    return props if isinstance(props, dict) else {}


def _is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _strings(value: Any) -> list[str]:
    """Every string literal inside a value, intrinsic functions included (Fn::Sub, Fn::Join...)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def _resolve(cfn: Template, value: Any) -> Any:
    """A Ref to a template parameter -> its Default (what a stack gets when nobody overrides it)."""
    if isinstance(value, dict) and list(value) == ["Ref"]:
        parameter = cfn.template.get("Parameters", {}).get(value["Ref"])
        if isinstance(parameter, dict):
            return parameter.get("Default")
    return value


class LaunchTemplateRequiresImdsV2(CloudFormationLintRule):
    id = "E9101"
    shortdesc = "Launch templates require IMDSv2"
    description = "Every AWS::EC2::LaunchTemplate sets MetadataOptions.HttpTokens to 'required'."
    source_url = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-IMDS-new-instances.html"
    tags = ["petctl", "security", "ec2", "imds"]

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for name, resource in cfn.get_resources(["AWS::EC2::LaunchTemplate"]).items():
            data = _properties(resource).get("LaunchTemplateData")
            options = data.get("MetadataOptions") if isinstance(data, dict) else None
            tokens = options.get("HttpTokens") if isinstance(options, dict) else None
            if tokens != "required":
                matches.append(
                    RuleMatch(
                        ["Resources", name, "Properties", "LaunchTemplateData", "MetadataOptions"],
                        f"Launch template {name} must require IMDSv2 (MetadataOptions.HttpTokens: required)",
                    )
                )
        return matches


class NoOpenIngress(CloudFormationLintRule):
    id = "E9102"
    shortdesc = "No ingress from the whole internet"
    description = "No security group ingress rule allows 0.0.0.0/0 or ::/0."
    source_url = "https://docs.aws.amazon.com/vpc/latest/userguide/security-group-rules.html"
    tags = ["petctl", "security", "ec2", "network"]

    def _check_rule(self, cfn: Template, rule: Any, path: list) -> list[RuleMatch]:
        if not isinstance(rule, dict):
            return []
        matches = []
        for key in ("CidrIp", "CidrIpv6"):
            if key in rule and _resolve(cfn, rule[key]) in OPEN_CIDRS:
                matches.append(RuleMatch([*path, key], f"Ingress open to the internet ({key}) at {path[1]}"))
        return matches

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for name, resource in cfn.get_resources(["AWS::EC2::SecurityGroup"]).items():
            rules = _properties(resource).get("SecurityGroupIngress") or []
            for index, rule in enumerate(rules if isinstance(rules, list) else []):
                path = ["Resources", name, "Properties", "SecurityGroupIngress", index]
                matches.extend(self._check_rule(cfn, rule, path))
        for name, resource in cfn.get_resources(["AWS::EC2::SecurityGroupIngress"]).items():
            matches.extend(self._check_rule(cfn, _properties(resource), ["Resources", name, "Properties"]))
        return matches


class EfsEncrypted(CloudFormationLintRule):
    id = "E9103"
    shortdesc = "EFS file systems are encrypted"
    description = "Every AWS::EFS::FileSystem sets Encrypted: true."
    source_url = "https://docs.aws.amazon.com/efs/latest/ug/encryption.html"
    tags = ["petctl", "security", "efs", "encryption"]

    def match(self, cfn: Template) -> list[RuleMatch]:
        return [
            RuleMatch(["Resources", name, "Properties"], f"EFS file system {name} must set Encrypted: true")
            for name, resource in cfn.get_resources(["AWS::EFS::FileSystem"]).items()
            if not _is_true(_properties(resource).get("Encrypted"))
        ]


class BucketEncryptedAndPrivate(CloudFormationLintRule):
    id = "E9104"
    shortdesc = "S3 buckets are encrypted and block public access"
    description = (
        "Every AWS::S3::Bucket has default server-side encryption and a PublicAccessBlockConfiguration "
        "with all four settings true."
    )
    source_url = (
        "https://docs.aws.amazon.com/AmazonS3/latest/userguide/access-control-block-public-access.html"
    )
    tags = ["petctl", "security", "s3"]
    BLOCK_SETTINGS = ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")
    ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for name, resource in cfn.get_resources(["AWS::S3::Bucket"]).items():
            props = _properties(resource)
            encryption = props.get("BucketEncryption")
            rules = (
                encryption.get("ServerSideEncryptionConfiguration") if isinstance(encryption, dict) else None
            )
            algorithms = [
                rule.get("ServerSideEncryptionByDefault", {}).get("SSEAlgorithm")
                for rule in (rules if isinstance(rules, list) else [])
                if isinstance(rule, dict) and isinstance(rule.get("ServerSideEncryptionByDefault"), dict)
            ]
            if not algorithms or any(a not in self.ALGORITHMS for a in algorithms):
                matches.append(
                    RuleMatch(
                        ["Resources", name, "Properties"],
                        f"Bucket {name} must set default encryption ({' or '.join(self.ALGORITHMS)})",
                    )
                )
            block = props.get("PublicAccessBlockConfiguration")
            missing = [
                s for s in self.BLOCK_SETTINGS if not (isinstance(block, dict) and _is_true(block.get(s)))
            ]
            if missing:
                matches.append(
                    RuleMatch(
                        ["Resources", name, "Properties"],
                        f"Bucket {name} must block public access: {', '.join(missing)} not true",
                    )
                )
        return matches


class NoLaunchConfiguration(CloudFormationLintRule):
    id = "E9105"
    shortdesc = "No launch configurations"
    description = (
        "Launch configurations cannot require IMDSv2 everywhere and are deprecated: use launch templates."
    )
    source_url = "https://docs.aws.amazon.com/autoscaling/ec2/userguide/launch-configurations.html"
    tags = ["petctl", "security", "autoscaling"]

    def match(self, cfn: Template) -> list[RuleMatch]:
        return [
            RuleMatch(["Resources", name], f"{name} is a launch configuration; use AWS::EC2::LaunchTemplate")
            for name in cfn.get_resources(["AWS::AutoScaling::LaunchConfiguration"])
        ]


class NoFullAccessManagedPolicies(CloudFormationLintRule):
    id = "E9106"
    shortdesc = "No *FullAccess managed policies"
    description = "IAM roles, users and groups attach no managed policy whose ARN contains 'FullAccess'."
    source_url = "https://docs.aws.amazon.com/IAM/latest/UserGuide/best-practices.html#grant-least-privilege"
    tags = ["petctl", "security", "iam"]

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        types = ["AWS::IAM::Role", "AWS::IAM::User", "AWS::IAM::Group"]
        for name, resource in cfn.get_resources(types).items():
            arns = _properties(resource).get("ManagedPolicyArns") or []
            for index, arn in enumerate(arns if isinstance(arns, list) else [arns]):
                if any("FullAccess" in text for text in _strings(arn)):
                    matches.append(
                        RuleMatch(
                            ["Resources", name, "Properties", "ManagedPolicyArns", index],
                            f"{name} attaches a *FullAccess managed policy; grant least privilege instead",
                        )
                    )
        return matches


class BucketRequiresTls(CloudFormationLintRule):
    id = "E9107"
    shortdesc = "S3 buckets deny requests without TLS"
    description = (
        "Every AWS::S3::Bucket has a bucket policy denying requests where aws:SecureTransport is false."
    )
    source_url = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/security-best-practices.html"
    tags = ["petctl", "security", "s3"]

    @staticmethod
    def _denies_plain_http(statement: Any) -> bool:
        if not isinstance(statement, dict) or statement.get("Effect") != "Deny":
            return False
        condition = statement.get("Condition")
        bool_condition = condition.get("Bool") if isinstance(condition, dict) else None
        if not isinstance(bool_condition, dict):
            return False
        value = bool_condition.get("aws:SecureTransport")
        return value is False or (isinstance(value, str) and value.lower() == "false")

    def match(self, cfn: Template) -> list[RuleMatch]:
        protected = set()
        for resource in cfn.get_resources(["AWS::S3::BucketPolicy"]).values():
            props = _properties(resource)
            bucket = props.get("Bucket")
            document = props.get("PolicyDocument")
            statements = document.get("Statement") if isinstance(document, dict) else None
            statements = statements if isinstance(statements, list) else [statements]
            if isinstance(bucket, dict) and "Ref" in bucket and any(map(self._denies_plain_http, statements)):
                protected.add(bucket["Ref"])
        return [
            RuleMatch(
                ["Resources", name], f"Bucket {name} needs a bucket policy denying aws:SecureTransport false"
            )
            for name in cfn.get_resources(["AWS::S3::Bucket"])
            if name not in protected
        ]


def _policy_documents(cfn: Template) -> list[tuple[list, Any]]:
    """``(path, PolicyDocument)`` of every identity policy: inline role/user/group policies and
    AWS::IAM::Policy / AWS::IAM::ManagedPolicy resources."""
    found: list[tuple[list, Any]] = []
    for name, resource in cfn.get_resources(["AWS::IAM::Role", "AWS::IAM::User", "AWS::IAM::Group"]).items():
        policies = _properties(resource).get("Policies") or []
        for index, policy in enumerate(policies if isinstance(policies, list) else []):
            if isinstance(policy, dict):
                path = ["Resources", name, "Properties", "Policies", index, "PolicyDocument"]
                found.append((path, policy.get("PolicyDocument")))
    for name, resource in cfn.get_resources(["AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"]).items():
        found.append(
            (["Resources", name, "Properties", "PolicyDocument"], _properties(resource).get("PolicyDocument"))
        )
    return found


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


class S3WritesScopedToTheJob(CloudFormationLintRule):
    id = "E9108"
    shortdesc = "IAM policies write to S3 only under one job's status/ or boot/ prefix"
    description = (
        "Every Allow statement of an identity policy that grants an S3 object write (PutObject, "
        "DeleteObject, s3:*, wildcards...) names only resources "
        "arn:${AWS::Partition}:s3:::<bucket>/petctl/jobs/${JobName}/{status,boot}/*, so an instance can never "
        "overwrite another job's objects or its own job's code, spec or wheel. NotAction/NotResource "
        "in such statements are violations."
    )
    source_url = "https://docs.aws.amazon.com/IAM/latest/UserGuide/best-practices.html#grant-least-privilege"
    tags = ["petctl", "security", "iam", "s3"]
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
    #: A write resource: this job's own reports (status/, boot/); never code/, dist/ or job.json.
    SCOPED = re.compile(
        r"^arn:\$\{AWS::Partition\}:s3:::(\$\{[A-Za-z0-9]+\}|[a-z0-9][a-z0-9.-]+)"
        r"/petctl/jobs/\$\{JobName\}/(status|boot)/\*$"
    )

    def _writes(self, actions: Any) -> bool:
        patterns = [a.lower() for a in _as_list(actions) if isinstance(a, str)]
        if any(not isinstance(a, str) for a in _as_list(actions)):
            return True  # an intrinsic we cannot read
        return any(fnmatch.fnmatchcase(write, p) for p in patterns for write in self.WRITE_ACTIONS)

    def _scoped(self, resource: Any) -> bool:
        if isinstance(resource, dict) and list(resource) == ["Fn::Sub"]:
            resource = resource["Fn::Sub"]
        return isinstance(resource, str) and bool(self.SCOPED.match(resource))

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for path, document in _policy_documents(cfn):
            statements = document.get("Statement") if isinstance(document, dict) else None
            for index, statement in enumerate(_as_list(statements)):
                if not isinstance(statement, dict) or statement.get("Effect") != "Allow":
                    continue
                where = [*path, "Statement", index]
                if "NotAction" in statement or "NotResource" in statement:
                    if "NotAction" in statement or self._writes(statement.get("Action")):
                        matches.append(
                            RuleMatch(
                                where, f"{path[1]}: NotAction/NotResource hide which S3 writes are allowed"
                            )
                        )
                    continue
                if not self._writes(statement.get("Action")):
                    continue
                for resource in _as_list(statement.get("Resource")):
                    if not self._scoped(resource):
                        matches.append(
                            RuleMatch(
                                [*where, "Resource"],
                                f"{path[1]} allows S3 writes outside one job's prefix "
                                f"(petctl/jobs/${{JobName}}/status/* or boot/*): {resource}",
                            )
                        )
        return matches


#: etcd flags a TLS-only server needs: https client URLs and client certificates signed by the job's CA.
_ETCD_TLS_FLAGS = ("--client-cert-auth", "--trusted-ca-file", "--cert-file", "--key-file")
_URL_FLAG = re.compile(r"--(listen|advertise)-client-urls[ =]+(\S+)")


class EtcdServesTlsOnly(CloudFormationLintRule):
    id = "E9109"
    shortdesc = "etcd serves its clients over TLS with client certificates"
    description = (
        "Every launch template whose user data starts etcd (--listen-client-urls) serves and advertises "
        "https:// client URLs only, with --client-cert-auth, --trusted-ca-file, --cert-file and --key-file."
    )
    source_url = "https://etcd.io/docs/v3.5/op-guide/security/"
    tags = ["petctl", "security", "etcd", "tls"]

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for name, resource in cfn.get_resources(["AWS::EC2::LaunchTemplate"]).items():
            data = _properties(resource).get("LaunchTemplateData")
            user_data = data.get("UserData") if isinstance(data, dict) else None
            path = ["Resources", name, "Properties", "LaunchTemplateData", "UserData"]
            for text in _strings(user_data):
                for line in text.splitlines():
                    urls = [u for m in _URL_FLAG.finditer(line) for u in m.group(2).split(",")]
                    if not urls:
                        continue
                    plain = [u for u in urls if not u.startswith("https://")]
                    if plain:
                        matches.append(
                            RuleMatch(
                                path, f"{name}: etcd serves client URLs without TLS: {', '.join(plain)}"
                            )
                        )
                    missing = [f for f in _ETCD_TLS_FLAGS if not re.search(re.escape(f) + r"(\s|=|$)", line)]
                    if missing:
                        matches.append(
                            RuleMatch(
                                path, f"{name}: etcd runs without {', '.join(missing)} (client certificates)"
                            )
                        )
        return matches


#: Object reads (identity policies) that would fetch a job's keys.
_READ_ACTIONS = ("s3:getobject", "s3:getobjectversion")
#: The job's secret keys under petctl/jobs/<job>/tls/ (petctl/tls.py).
_TLS_KEYS = ("ca.key", "client.key")


class TlsKeysReadExactly(CloudFormationLintRule):
    id = "E9110"
    shortdesc = "A job's TLS keys are readable only by name, and never both by one role"
    description = (
        "An identity policy may read petctl/jobs/${JobName}/tls/ca.key or tls/client.key only through a "
        "resource naming that object exactly (no wildcard that sweeps them in, such as "
        "petctl/jobs/${JobName}/*), and no policy reads both: the CA key signs servers, the client key "
        "is a client's, and a role holding both could pose as the job's etcd."
    )
    source_url = "https://docs.aws.amazon.com/IAM/latest/UserGuide/best-practices.html#grant-least-privilege"
    tags = ["petctl", "security", "iam", "s3", "tls"]

    @staticmethod
    def _reads(actions: Any) -> bool:
        if any(not isinstance(a, str) for a in _as_list(actions)):
            return True
        patterns = [a.lower() for a in _as_list(actions)]
        return any(fnmatch.fnmatchcase(read, p) for p in patterns for read in _READ_ACTIONS)

    @staticmethod
    def _key_pattern(resource: Any) -> str | None:
        """The object-key part of an S3 ARN (``None``: not readable as one)."""
        if isinstance(resource, dict) and list(resource) == ["Fn::Sub"]:
            resource = resource["Fn::Sub"]
        if not isinstance(resource, str):
            return None
        if resource == "*":
            return "*"
        _, sep, rest = resource.partition(":::")
        return rest.partition("/")[2] if sep else ""

    def match(self, cfn: Template) -> list[RuleMatch]:
        matches = []
        for path, document in _policy_documents(cfn):
            statements = document.get("Statement") if isinstance(document, dict) else None
            exact: set[str] = set()
            for index, statement in enumerate(_as_list(statements)):
                if not isinstance(statement, dict) or statement.get("Effect") != "Allow":
                    continue
                if not self._reads(statement.get("Action", [])) and "NotAction" not in statement:
                    continue
                where = [*path, "Statement", index, "Resource"]
                for resource in _as_list(statement.get("Resource", "*")):
                    pattern = self._key_pattern(resource)
                    for key in _TLS_KEYS:
                        probe = f"petctl/jobs/${{JobName}}/tls/{key}"
                        if pattern == probe:
                            exact.add(key)
                        elif pattern is None or fnmatch.fnmatchcase(probe, pattern):
                            matches.append(
                                RuleMatch(where, f"{path[1]} reads tls/{key} through a wildcard: {resource}")
                            )
            if len(exact) == len(_TLS_KEYS):
                matches.append(RuleMatch(path, f"{path[1]} reads both the job's CA key and its client key"))
        return matches
