"""Render the CloudFormation templates: Jinja2 -> YAML text, with the flags checked first.

The templates live in the package ``petctl.cfn_templates`` (the ``cfn_templates/`` directory) and are
read through :mod:`importlib.resources`, so an installed petctl finds them outside the source tree.
Jinja carries *structure* only (see :mod:`petctl.templates`); ``StrictUndefined`` turns a missing
variable into an error instead of an empty string.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import resources
from typing import Any

import jinja2

TEMPLATE_PACKAGE = "petctl.cfn_templates"
INFRA_TEMPLATE = "infra.yaml.j2"
JOB_TEMPLATE = "job.yaml.j2"

MIN_AZ_COUNT = 1  # the issue asks for >= 2 by default; one AZ is allowed for cheap trials
MAX_AZ_COUNT = 6

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


def check_az_count(az_count: object) -> None:
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
    check_az_count(az_count)
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
