"""Render the CloudFormation templates: Jinja2 -> YAML text, with the flags checked first.

The templates live in the package ``petctl.cfn_templates`` (the ``cfn_templates/`` directory) and are
read through :mod:`importlib.resources`, so an installed petctl finds them outside the source tree.
Jinja carries *structure* only (see :mod:`petctl.templates`); ``StrictUndefined`` turns a missing
variable into an error instead of an empty string.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

import jinja2

from petctl.templates import etcd
from petctl_agent.spec import LIGHTHOUSE_PORT, TORCHFT_VERSION

TEMPLATE_PACKAGE = "petctl.cfn_templates"
INFRA_TEMPLATE = "infra.yaml.j2"
JOB_TEMPLATE = "job.yaml.j2"

#: CloudFormation's caps on a template (CreateStack/UpdateStack, API reference): an inline
#: ``TemplateBody`` of at most 51,200 bytes; a ``TemplateURL`` object of at most "1 MB", read here
#: as 1,000,000 bytes, the smaller of its two readings. docs/contracts.md, "Caps and limits".
TEMPLATE_BODY_MAX_BYTES = 51_200
TEMPLATE_URL_MAX_BYTES = 1_000_000

#: A bound on EFA interfaces per worker: the most network cards of any EC2 type today is 32
#: (p5.48xlarge), with room for larger ones.
MAX_EFA_INTERFACES = 64

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
    return strip_comments(_environment().get_template(name).render(**context))


#: A line that opens a YAML block scalar (``key: |``, ``- >-``, ``Fn::Base64: !Sub |``).
_BLOCK_OPENER = re.compile(r"(^|[\s:])[|>][-+]?[0-9]?$")
#: A here-document in a boot script (``cat > f <<UNIT``, ``<<-'EOF'``): its lines are data.
_HEREDOC = re.compile(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")


def strip_comments(text: str) -> str:
    """The template as deployed: without its comments, which are a third of the sources' bytes
    and count against CloudFormation's template size caps (docs/contracts.md).

    Drops YAML comments (whole lines, and ``  # ...`` after a value outside quotes) and blank
    lines outside block scalars. Inside a block scalar that is a bash script (first line
    ``#!``), drops whole-line bash comments except the shebang and except inside
    here-documents (whose lines are file contents); the script's commands are left byte for
    byte. Other block scalars (folded descriptions) are kept as they are. The sources keep
    their comments; tests check that the parsed template, and each boot script as bash parses
    it (``bash --pretty-print``), are the same with and without them.
    """
    out: list[str] = []
    block_indent: int | None = None  # indent of the line that opened the block scalar we are in
    first_in_block = False
    bash = False
    heredoc: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if block_indent is not None and (not stripped or indent > block_indent):
            if first_in_block and stripped:
                first_in_block = False
                bash = stripped.startswith("#!")
            elif bash and heredoc is not None:
                if stripped.strip() == heredoc:
                    heredoc = None
            elif bash and stripped.startswith("#"):
                continue
            elif bash:
                m = _HEREDOC.search(stripped)
                heredoc = m.group(1) if m else None
            out.append(line)
            continue
        block_indent, heredoc = None, None
        if not stripped or stripped.startswith("#"):
            continue
        code = _without_trailing_comment(line)
        out.append(code)
        if _BLOCK_OPENER.search(code):
            block_indent, first_in_block, bash = indent, True, False
    return "\n".join(out) + "\n"


def _without_trailing_comment(line: str) -> str:
    """``line`` up to a YAML comment (`` #`` outside quotes), right-stripped."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and line[i - 1] in " \t":
            return line[:i].rstrip()
    return line.rstrip()


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
    etcd_v2: bool = False,
    live: bool = False,
    efa_interfaces: int = 0,
    placement_group: bool = False,
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
        etcd_v2: the rendezvous etcd also serves the v2 API (``--enable-v2``): only for torch's
            fallback backends (``etcd.ETCD_V2_BACKENDS``), which speak v2 through python-etcd.
        live: live membership (``run-job --live``): the rendezvous server also runs the job's
            torchft lighthouse (port ``LIGHTHOUSE_PORT``, from the job's workers only), installed
            from the job's petctl wheel and torchft without torch.
        efa_interfaces: EFA interfaces per worker, one per network card (0: no EFA; at most
            :data:`MAX_EFA_INTERFACES`): the worker launch template names them, cards 0 to N-1,
            and the worker group allows all traffic out to itself as well as in.
        placement_group: the workers go in a cluster placement group (one zone: give
            ``SubnetIds`` one subnet).

    Returns:
        The CloudFormation template as YAML text; see :func:`job_parameters` for its parameters.
    """
    _check_bool("gpu", gpu)
    _check_bool("spot", spot)
    _check_bool("ami_override", ami_override)
    _check_bool("own_roles", own_roles)
    _check_bool("bucket_kms", bucket_kms)
    _check_bool("warm_pool", warm_pool)
    _check_bool("etcd_v2", etcd_v2)
    _check_bool("live", live)
    _check_bool("placement_group", placement_group)
    if (
        not isinstance(efa_interfaces, int)
        or isinstance(efa_interfaces, bool)
        or not 0 <= efa_interfaces <= MAX_EFA_INTERFACES
    ):
        raise ValueError(
            f"efa_interfaces={efa_interfaces!r}: use 0 (no EFA) to {MAX_EFA_INTERFACES} (one per network card)"
        )
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
        etcd_v2=etcd_v2,
        live=live,
        efa_interfaces=efa_interfaces,
        placement_group=placement_group,
        lighthouse_port=LIGHTHOUSE_PORT,
        torchft_version=TORCHFT_VERSION,
        etcd_version=etcd.ETCD_VERSION,
        etcd_sha256=etcd.ETCD_SHA256,
        etcd_release_base=etcd.RELEASE_BASE,
        etcd_server_flags=" ".join(etcd.SERVER_FLAGS),
        cpu_ami_parameter=CPU_AMI_PARAMETER,
        gpu_ami_parameter=GPU_AMI_PARAMETER,
    )
