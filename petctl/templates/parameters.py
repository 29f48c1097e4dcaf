"""Read rendered templates back, and build and check the parameter lists of their stacks.

Every runtime value (sizes, names, ids, URLs) is a CloudFormation parameter, built here by
:func:`infra_parameters` / :func:`job_parameters` and checked against the rendered template, so a
value CloudFormation would reject fails before anything is created.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from petctl import naming
from petctl.templates.rendering import check_az_count, render_job

SUBNET_PREFIX = 24  # every subnet is a /24 of the VPC block (Fn::Cidr with 8 host bits)

#: CloudWatch Logs accepts only these retention periods (days).
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731,
    1096, 1827, 2192, 2557, 2922, 3288, 3653,
)  # fmt: skip


_EFS_ID_RE = re.compile(r"^fs-[0-9a-f]{8,40}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


# --------------------------------------------------------------------------- reading templates back


# libyaml's loader when PyYAML was built with it: job_parameters() parses every job variant once.
_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _CfnLoader(_SafeLoader):  # type: ignore[misc,valid-type]
    """A SafeLoader that turns CloudFormation short tags (``!Ref``, ``!Sub``, ...) into long form."""


def _construct_short_tag(loader: Any, tag_suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    if tag_suffix == "Ref":
        return {"Ref": value}
    if tag_suffix == "Condition":
        return {"Condition": value}
    if tag_suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{tag_suffix}": value}


_CfnLoader.add_multi_constructor("!", _construct_short_tag)


def load_template(text: str) -> dict[str, Any]:
    """Parse rendered template text (with CloudFormation short tags) into plain Python data."""
    data = yaml.load(text, Loader=_CfnLoader)  # noqa: S506 - a SafeLoader subclass
    if not isinstance(data, dict):
        raise ValueError("not a CloudFormation template: the document is not a mapping")
    return data


# --------------------------------------------------------------------------- parameters


def _parameter_list(values: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"ParameterKey": key, "ParameterValue": value} for key, value in values.items()]


def subnet_cidrs(vpc_cidr: str, az_count: int) -> list[str]:
    """The /24 subnets the base stack creates: the first ``az_count`` /24 blocks of ``vpc_cidr``.

    This is exactly what ``Fn::Cidr [VpcCidr, az_count, 8]`` yields; petctl computes it here so the
    value is validated before anything is created (and because moto has no ``Fn::Cidr``).
    """
    check_az_count(az_count)
    try:
        network = ipaddress.ip_network(vpc_cidr, strict=True)
    except ValueError as exc:
        raise ValueError(f"vpc_cidr {vpc_cidr!r} is not a valid network CIDR: {exc}") from None
    if network.version != 4:
        raise ValueError(f"vpc_cidr {vpc_cidr!r} must be an IPv4 block")
    needed = SUBNET_PREFIX - math.ceil(math.log2(az_count))
    if not 16 <= network.prefixlen <= needed:
        raise ValueError(
            f"vpc_cidr {vpc_cidr!r} must be between /16 (the VPC maximum) and /{needed} "
            f"to hold {az_count} /{SUBNET_PREFIX} subnets"
        )
    blocks = itertools.islice(network.subnets(new_prefix=SUBNET_PREFIX), az_count)
    return [str(block) for block in blocks]


def infra_parameters(
    *,
    vpc_cidr: str = "10.0.0.0/16",
    az_count: int = 2,
    efs_id: str | None = None,
    bucket: str | None = None,
    log_retention_days: int = 30,
    profile: str = "default",
    efs_backup: bool = False,
) -> list[dict[str, str]]:
    """CloudFormation parameters of the base stack, validated.

    Args:
        vpc_cidr: IPv4 block of the VPC (/16 to /24 - log2(az_count)).
        az_count: must equal the ``az_count`` the template was rendered with.
        efs_id: an existing file system; give it exactly when rendering with ``create_efs=False``.
        bucket: an existing bucket; give it exactly when rendering with ``create_bucket=False``.
        log_retention_days: one of :data:`LOG_RETENTION_DAYS`.
        profile: petctl profile name (tags, log group ``/petctl/<profile>``).
        efs_backup: AWS Backup's automatic backups of the file system petctl creates (refused
            with ``efs_id``: a given file system's backups are its owner's setting).

    Returns:
        ``[{"ParameterKey": ..., "ParameterValue": ...}, ...]`` for ``create_stack``/``update_stack``.

    Raises:
        ValueError: a value CloudFormation would reject, with the offending value in the message.
    """
    cidrs = subnet_cidrs(vpc_cidr, az_count)
    if not naming.PROFILE_RE.match(profile):
        raise ValueError(
            f"profile {profile!r} is invalid: use letters, digits, '-' and '_' (max 32, starting alnum)"
        )
    if isinstance(log_retention_days, bool) or log_retention_days not in LOG_RETENTION_DAYS:
        raise ValueError(
            f"log_retention_days={log_retention_days!r} is not a CloudWatch Logs retention period; "
            f"choose one of {', '.join(map(str, LOG_RETENTION_DAYS))}"
        )
    values = {
        "VpcCidr": vpc_cidr,
        "SubnetCidrs": ",".join(cidrs),
        "Profile": profile,
        "LogRetentionDays": str(log_retention_days),
    }
    if efs_id:  # None or "": petctl creates the file system
        if not _EFS_ID_RE.match(efs_id):
            raise ValueError(f"efs_id {efs_id!r} is not an EFS file system id (fs-0123456789abcdef0)")
        if efs_backup:
            raise ValueError("efs_backup applies to the file system petctl creates, not to an efs_id")
        values["ExistingEfsId"] = efs_id
    else:
        values["EfsBackup"] = "ENABLED" if efs_backup else "DISABLED"
    if bucket:  # None or "": petctl creates the bucket
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ValueError(f"bucket {bucket!r} is not a valid S3 bucket name")
        values["ExistingBucketName"] = bucket
    return _parameter_list(values)


def template_parameters(template: str) -> tuple[set[str], set[str]]:
    """``(all parameter names, names without a Default)`` of a rendered template."""
    declared = load_template(template).get("Parameters") or {}
    return set(declared), {name for name, spec in declared.items() if "Default" not in spec}


#: Every value of each render_job flag: job_parameters() without a template checks against them all.
_JOB_VARIANTS: dict[str, tuple[Any, ...]] = {
    "gpu": (False, True),
    "spot": (False, True),
    "ami_override": (False, True),
    "instance_types": (1, 2),
    "own_roles": (True, False),
    "bucket_kms": (False, True),
    "warm_pool": (False, True),
}


@functools.lru_cache(maxsize=1)
def _job_parameter_names() -> tuple[frozenset[str], frozenset[str]]:
    """Known parameter names over every job template variant, and those required by all of them."""
    known: set[str] = set()
    required: set[str] | None = None
    for values in itertools.product(*_JOB_VARIANTS.values()):
        try:
            template = render_job(**dict(zip(_JOB_VARIANTS, values)))
        except ValueError:  # a combination render_job refuses, such as a warm pool with spot
            continue
        names, needed = template_parameters(template)
        known |= names
        required = needed if required is None else required & needed
    return frozenset(known), frozenset(required or ())


def _parameter_value(name: str, value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(f"job parameter {name}={value!r}: booleans are not CloudFormation values")
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def _as_int(values: Mapping[str, str], name: str) -> int | None:
    try:
        return int(values[name])
    except (KeyError, ValueError):
        return None


def job_parameters(*, template: str | None = None, **values: Any) -> list[dict[str, str]]:
    """CloudFormation parameters of a job stack, validated against the job template.

    Keyword names are the template's parameter names (``JobName=..., MinSize=2, SubnetIds=[...]``).
    Lists and tuples are comma-joined, numbers stringified; ``None`` means "leave it to the
    template's default" and is dropped.

    Args:
        template: the rendered job template the parameters are for. When given, validation is exact
            for that variant (e.g. ``OnDemandBaseCapacity`` required with ``spot=True``, ``ImageId``
            with ``ami_override=True``); otherwise the parameters every variant requires are checked
            and names unknown to all variants are rejected.
        **values: parameter values.

    Raises:
        ValueError: a required parameter is missing or empty, a name is unknown, or the sizes are
            inconsistent (``MinSize <= DesiredCapacity <= MaxSize``).
    """
    given = {name: _parameter_value(name, value) for name, value in values.items() if value is not None}
    if template is None:
        known, required = _job_parameter_names()
    else:
        known, required = template_parameters(template)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"unknown job stack parameter(s): {', '.join(unknown)}; the job template takes "
            f"{', '.join(sorted(known))}"
        )
    missing = sorted(name for name in required if not given.get(name))
    if missing:
        raise ValueError(f"job stack parameter(s) missing or empty: {', '.join(missing)}")
    low, desired, high = (_as_int(given, n) for n in ("MinSize", "DesiredCapacity", "MaxSize"))
    if None not in (low, desired, high) and not low <= desired <= high:  # type: ignore[operator]
        raise ValueError(
            f"sizes must satisfy MinSize <= DesiredCapacity <= MaxSize, got "
            f"MinSize={low}, DesiredCapacity={desired}, MaxSize={high}"
        )
    return _parameter_list(given)


def parameters_dict(parameters: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """``[{"ParameterKey": k, "ParameterValue": v}]`` -> ``{k: v}`` (for display and tests)."""
    return {item["ParameterKey"]: item["ParameterValue"] for item in parameters}
