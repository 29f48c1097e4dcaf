"""cfn-lint rules for the instances: IMDSv2 launch templates only, no ingress from the internet,
and etcd started with TLS and client certificates.

A value hidden behind Fn::If, a parameter without a safe default or any other intrinsic counts as a
violation (see :mod:`petctl.lint_rules`). cfn-lint loads this file by path: keep it free of relative
imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from cfnlint.template import Template

from petctl.lint_rules._common import Finding, each_property, get_in, properties, rule, strings

OPEN_CIDRS = {"0.0.0.0/0", "::/0"}
#: etcd flags a TLS-only server needs: https client URLs and client certificates signed by the job's CA.
ETCD_TLS_FLAGS = ("--client-cert-auth", "--trusted-ca-file", "--cert-file", "--key-file")
URL_FLAG = re.compile(r"--(listen|advertise)-client-urls[ =]+(\S+)")


@rule(
    "E9101",
    "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-IMDS-new-instances.html",
    "ec2",
    "imds",
)
def LaunchTemplateRequiresImdsV2(cfn: Template) -> Iterator[Finding]:
    """Launch templates require IMDSv2

    Every AWS::EC2::LaunchTemplate sets MetadataOptions.HttpTokens to 'required'.
    """
    for name, data in each_property(cfn, ["AWS::EC2::LaunchTemplate"], "LaunchTemplateData"):
        if get_in(data, "MetadataOptions", "HttpTokens") != "required":
            yield (
                ["Resources", name, "Properties", "LaunchTemplateData", "MetadataOptions"],
                f"Launch template {name} must require IMDSv2 (MetadataOptions.HttpTokens: required)",
            )


def _resolve(cfn: Template, value: Any) -> Any:
    """A Ref to a template parameter -> its Default (what a stack gets when nobody overrides it)."""
    if isinstance(value, dict) and list(value) == ["Ref"]:
        parameter = cfn.template.get("Parameters", {}).get(value["Ref"])
        if isinstance(parameter, dict):
            return parameter.get("Default")
    return value


def _open_ingress(cfn: Template, ingress: Any, path: list) -> Iterator[Finding]:
    if not isinstance(ingress, dict):
        return
    for key in ("CidrIp", "CidrIpv6"):
        if key in ingress and _resolve(cfn, ingress[key]) in OPEN_CIDRS:
            yield [*path, key], f"Ingress open to the internet ({key}) at {path[1]}"


@rule("E9102", "https://docs.aws.amazon.com/vpc/latest/userguide/security-group-rules.html", "ec2", "network")
def NoOpenIngress(cfn: Template) -> Iterator[Finding]:
    """No ingress from the whole internet

    No security group ingress rule allows 0.0.0.0/0 or ::/0.
    """
    for name, ingresses in each_property(cfn, ["AWS::EC2::SecurityGroup"], "SecurityGroupIngress"):
        for index, ingress in enumerate(ingresses if isinstance(ingresses, list) else []):
            yield from _open_ingress(
                cfn, ingress, ["Resources", name, "Properties", "SecurityGroupIngress", index]
            )
    for name, resource in cfn.get_resources(["AWS::EC2::SecurityGroupIngress"]).items():
        yield from _open_ingress(cfn, properties(resource), ["Resources", name, "Properties"])


@rule(
    "E9105", "https://docs.aws.amazon.com/autoscaling/ec2/userguide/launch-configurations.html", "autoscaling"
)
def NoLaunchConfiguration(cfn: Template) -> Iterator[Finding]:
    """No launch configurations

    Launch configurations cannot require IMDSv2 everywhere and are deprecated: use launch templates.
    """
    for name in cfn.get_resources(["AWS::AutoScaling::LaunchConfiguration"]):
        yield ["Resources", name], f"{name} is a launch configuration; use AWS::EC2::LaunchTemplate"


def _etcd_line(name: str, path: list, line: str) -> Iterator[Finding]:
    urls = [u for m in URL_FLAG.finditer(line) for u in m.group(2).split(",")]
    if not urls:
        return
    plain = [u for u in urls if not u.startswith("https://")]
    if plain:
        yield path, f"{name}: etcd serves client URLs without TLS: {', '.join(plain)}"
    missing = [f for f in ETCD_TLS_FLAGS if not re.search(re.escape(f) + r"(\s|=|$)", line)]
    if missing:
        yield path, f"{name}: etcd runs without {', '.join(missing)} (client certificates)"


@rule("E9109", "https://etcd.io/docs/v3.5/op-guide/security/", "etcd", "tls")
def EtcdServesTlsOnly(cfn: Template) -> Iterator[Finding]:
    """etcd serves its clients over TLS with client certificates

    Every launch template whose user data starts etcd (--listen-client-urls) serves and advertises
    https:// client URLs only, with --client-cert-auth, --trusted-ca-file, --cert-file and --key-file.
    """
    for name, data in each_property(cfn, ["AWS::EC2::LaunchTemplate"], "LaunchTemplateData"):
        path = ["Resources", name, "Properties", "LaunchTemplateData", "UserData"]
        for text in strings(get_in(data, "UserData")):
            for line in text.splitlines():
                yield from _etcd_line(name, path, line)
