"""CloudFormation templates: render them (Jinja2 -> YAML text) and build their parameter lists.

The templates live in the package ``petctl.cfn_templates`` (the ``cfn_templates/`` directory) and are
read through :mod:`importlib.resources`, so an installed petctl finds them outside the source tree.

Division of labour:

* Jinja carries *structure* only: how many subnets, whether petctl owns the file system and the
  bucket, CPU or GPU image, spot or on-demand. ``StrictUndefined`` turns a missing variable into an
  error instead of an empty string.
* Every runtime value (sizes, names, ids, URLs) is a CloudFormation *parameter*, built by
  :func:`infra_parameters` / :func:`job_parameters`, so the same rendered text can be diffed, linted
  and shown by ``--dry-run``.

Nothing here talks to AWS (no boto3 import): rendering is pure and fast.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

import jinja2
import yaml

from petctl import naming

TEMPLATE_PACKAGE = "petctl.cfn_templates"
INFRA_TEMPLATE = "infra.yaml.j2"
JOB_TEMPLATE = "job.yaml.j2"

MIN_AZ_COUNT = 1  # the issue asks for >= 2 by default; one AZ is allowed for cheap trials
MAX_AZ_COUNT = 6
SUBNET_PREFIX = 24  # every subnet is a /24 of the VPC block (Fn::Cidr with 8 host bits)

#: CloudWatch Logs accepts only these retention periods (days).
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731,
    1096, 1827, 2192, 2557, 2922, 3288, 3653,
)  # fmt: skip

#: AWS public SSM parameters the job stack resolves the worker AMI from at deploy time.
CPU_AMI_PARAMETER = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
#: Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023): same OS family (dnf, systemd)
#: as the CPU image, so one boot script serves both.
GPU_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
)

#: Outputs of the base stack (``SubnetIds`` is comma-joined).
INFRA_OUTPUTS: tuple[str, ...] = (
    "VpcId",
    "SubnetIds",
    "InstanceSecurityGroupId",
    "EfsId",
    "BucketName",
    "LogGroupName",
)

#: Outputs of a job stack.
JOB_OUTPUTS: tuple[str, ...] = ("WorkerGroupName", "RdzvGroupName", "RdzvAddress", "RdzvEndpoint")

_EFS_ID_RE = re.compile(r"^fs-[0-9a-f]{8,40}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


# --------------------------------------------------------------------------- rendering


def _load_from_package(name: str) -> tuple[str, str, Callable[[], bool]] | None:
    resource = resources.files(TEMPLATE_PACKAGE).joinpath(*name.split("/"))
    if not resource.is_file():
        return None
    # Package data never changes under a running process: always up to date.
    return resource.read_text(encoding="utf-8"), f"{TEMPLATE_PACKAGE}/{name}", lambda: True


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_from_package),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # YAML and shell, not HTML
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _render(name: str, **context: Any) -> str:
    return _environment().get_template(name).render(**context)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_az_count(az_count: object) -> None:
    if not isinstance(az_count, int) or isinstance(az_count, bool):
        raise TypeError(f"az_count must be an int, got {az_count!r}")
    if not MIN_AZ_COUNT <= az_count <= MAX_AZ_COUNT:
        raise ValueError(
            f"az_count={az_count} is out of range: petctl spreads instances over "
            f"{MIN_AZ_COUNT} to {MAX_AZ_COUNT} availability zones"
        )


def render_infra(*, az_count: int = 2, create_efs: bool = True, create_bucket: bool = True) -> str:
    """Render the base stack template (``petctl setup``).

    Args:
        az_count: number of availability zones, one public subnet (and EFS mount target) in each.
        create_efs: create an encrypted EFS file system; ``False`` adds the ``ExistingEfsId`` parameter.
        create_bucket: create a private S3 bucket; ``False`` adds the ``ExistingBucketName`` parameter.

    Returns:
        The CloudFormation template as YAML text. Pair it with :func:`infra_parameters` called with
        the same ``az_count`` and ``efs_id`` / ``bucket`` given exactly when the resource is not created.
    """
    _check_az_count(az_count)
    _check_bool("create_efs", create_efs)
    _check_bool("create_bucket", create_bucket)
    return _render(INFRA_TEMPLATE, az_count=az_count, create_efs=create_efs, create_bucket=create_bucket)


def render_job(
    *,
    gpu: bool = False,
    spot: bool = False,
    ami_override: bool = False,
    instance_types: int = 1,
    own_roles: bool = True,
    bucket_kms: bool = False,
    warm_pool: bool = False,
) -> str:
    """Render the job stack template (``petctl run_job``).

    Args:
        gpu: GPU instances: Deep Learning AMI by default, CUDA torch, a larger root volume.
        spot: a mixed instances policy (on-demand base = ``OnDemandBaseCapacity``, spot above it,
            capacity-optimized); adds the ``OnDemandBaseCapacity`` parameter.
        ami_override: ``ImageId`` is a plain AMI id (``--ami``) instead of an SSM public parameter.
        instance_types: how many worker instance types the group may launch; above 1, a mixed
            instances policy with one launch template override each, from the ``InstanceTypes``
            parameter (a comma-separated list).
        own_roles: the stack makes the job's own IAM roles (scoped to this job's S3 prefix, log
            streams and groups; adds ``LogGroupName``). ``False``: the instances use existing
            instance profiles given as ``WorkerInstanceProfileArn`` / ``RdzvInstanceProfileArn``
            (profiles recorded with ``petctl configure``).
        bucket_kms: the bucket encrypts with a customer KMS key (``BucketKmsKeyArn``): the job's
            roles get kms:Decrypt/GenerateDataKey on it, through S3 only (with ``own_roles``).
        warm_pool: an Auto Scaling warm pool of ``WarmPoolSize`` stopped, pre-booted workers (adds
            that parameter), with the launch hook ``petctl-launch`` that holds each instance until
            its boot is done. AWS refuses a warm pool on a group with a mixed instances policy, so
            neither ``spot`` nor ``instance_types`` > 1 go with it.

    Returns:
        The CloudFormation template as YAML text; see :func:`job_parameters` for its parameters.
    """
    _check_bool("gpu", gpu)
    _check_bool("spot", spot)
    _check_bool("ami_override", ami_override)
    _check_bool("own_roles", own_roles)
    _check_bool("bucket_kms", bucket_kms)
    _check_bool("warm_pool", warm_pool)
    if bucket_kms and not own_roles:
        raise ValueError("bucket_kms needs own_roles: existing instance profiles are the user's to grant")
    if (
        not isinstance(instance_types, int)
        or isinstance(instance_types, bool)
        or not 1 <= instance_types <= 20
    ):
        raise ValueError(
            f"instance_types={instance_types!r}: use 1 to 20 (the Auto Scaling limit on overrides)"
        )
    if warm_pool and (spot or instance_types > 1):
        raise ValueError(
            "a warm pool cannot go with spot or several instance types: AWS accepts no warm pool on an "
            "Auto Scaling group with a mixed instances policy; drop --warm-pool, or use one on-demand type"
        )
    return _render(
        JOB_TEMPLATE,
        gpu=gpu,
        spot=spot,
        ami_override=ami_override,
        instance_types=instance_types,
        own_roles=own_roles,
        bucket_kms=bucket_kms,
        warm_pool=warm_pool,
        cpu_ami_parameter=CPU_AMI_PARAMETER,
        gpu_ami_parameter=GPU_AMI_PARAMETER,
    )


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
    _check_az_count(az_count)
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
) -> list[dict[str, str]]:
    """CloudFormation parameters of the base stack, validated.

    Args:
        vpc_cidr: IPv4 block of the VPC (/16 to /24 - log2(az_count)).
        az_count: must equal the ``az_count`` the template was rendered with.
        efs_id: an existing file system; give it exactly when rendering with ``create_efs=False``.
        bucket: an existing bucket; give it exactly when rendering with ``create_bucket=False``.
        log_retention_days: one of :data:`LOG_RETENTION_DAYS`.
        profile: petctl profile name (tags, log group ``/petctl/<profile>``).

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
        values["ExistingEfsId"] = efs_id
    if bucket:  # None or "": petctl creates the bucket
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ValueError(f"bucket {bucket!r} is not a valid S3 bucket name")
        values["ExistingBucketName"] = bucket
    return _parameter_list(values)


def template_parameters(template: str) -> tuple[set[str], set[str]]:
    """``(all parameter names, names without a Default)`` of a rendered template."""
    declared = load_template(template).get("Parameters") or {}
    return set(declared), {name for name, spec in declared.items() if "Default" not in spec}


@functools.lru_cache(maxsize=1)
def _job_parameter_names() -> tuple[frozenset[str], frozenset[str]]:
    """Known parameter names over every job template variant, and those required by all of them."""
    known: set[str] = set()
    required: set[str] | None = None
    for gpu, spot, ami_override, types, own_roles, kms, warm in itertools.product(
        (False, True), (False, True), (False, True), (1, 2), (True, False), (False, True), (False, True)
    ):
        if (kms and not own_roles) or (warm and (spot or types > 1)):
            continue
        names, needed = template_parameters(
            render_job(
                gpu=gpu,
                spot=spot,
                ami_override=ami_override,
                instance_types=types,
                own_roles=own_roles,
                bucket_kms=kms,
                warm_pool=warm,
            )
        )
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
