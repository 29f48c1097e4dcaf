"""A validated request becomes a :class:`Plan`: plain data, made without any AWS call.

What the plan needs from AWS or the disk is gathered before and handed in: the code (read,
tarred and checked by :func:`prepare_code`), the profile (its VPC looked up by
``lookups.resolve_vpc``), the AMI's root device (``lookups.resolve_ami``), and what EC2 says
about the instance types (``lookups.instance_facts``: GPU or CPU, architecture). ``--dry-run``
prints the plan; ``apply`` carries it out.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl import __version__, naming, storage, templates
from petctl.config import Profile
from petctl.errors import ConfigError
from petctl.instance_types import InstanceTypeInfo
from petctl.jobs.request import (
    JobRequest,
    check_instance_types,
    default_job_name,
    efa_env,
    efa_interfaces,
    instance_types,
    rdzv_architecture,
    sanitize_tag_value,
)
from petctl.jobs.requirements import Requirements, lines_for_plan
from petctl.storage import Upload, parse_s3_url
from petctl.templates import etcd
from petctl.ui import cmd
from petctl_agent.spec import JobSpec, SpecError


@dataclass
class Code:
    """The training code as it will reach the instances, read and checked before planning.

    ``kind`` is ``script`` (a local file), ``dir`` (a local directory, tarred into ``data``) or
    ``s3`` (a script already in S3 at ``url``); ``script`` and ``args`` are what every node runs.
    """

    kind: str
    script: str
    args: list[str]
    path: str | None = None
    data: bytes | None = None
    url: str | None = None
    source: str = ""
    #: petctl's own wheel, which every instance installs (None: the released one is named).
    dist: Path | None = None


def prepare_code(req: JobRequest, dist: Path | None = None) -> Code:
    """Read the request's target (a directory is tarred here, and refused when too large)."""
    args = list(req.args)
    if req.target.startswith("s3://"):
        return Code("s3", Path(parse_s3_url(req.target)[1]).name, args, url=req.target, dist=dist)
    target = Path(req.target)
    if target.is_dir():
        data = storage.tar_directory(target)
        return Code("dir", args[0], args[1:], data=data, source=f"tar of {req.target}", dist=dist)
    return Code("script", target.name, args, path=str(target.resolve()), dist=dist)


@dataclass
class Plan:
    """Everything ``run-job`` would do, as plain data."""

    job_name: str
    stack_name: str
    template: str
    parameters: list[dict[str, str]]
    uploads: list[Upload]
    spec: JobSpec
    tags: dict[str, str]
    bucket: str
    #: The bucket's customer KMS key, which the job's roles may use: uploads encrypt with it.
    kms_key: str | None = None
    warm_pool: int = 0
    #: Where ``template`` is uploaded (one of ``uploads``): the stack is created from it by
    #: TemplateURL, whose cap is 1 MB instead of the 51,200 bytes of an inline body.
    template_key: str = ""
    #: The workers are GPU types (EC2's GpuInfo): the Deep Learning AMI and CUDA torch.
    gpu: bool = False
    #: What every node installs after torch (``--dry-run`` lists it); None: nothing.
    requirements: dict[str, Any] | None = None
    #: EFA interfaces per worker (0: no EFA), and whether the workers share a cluster placement group.
    efa_interfaces: int = 0
    placement_group: bool = False

    @property
    def parameter_values(self) -> dict[str, str]:
        return {p["ParameterKey"]: p["ParameterValue"] for p in self.parameters}

    def summary(self) -> dict[str, Any]:
        return {
            "job": self.job_name,
            "stack": self.stack_name,
            "parameters": self.parameter_values,
            "uploads": [
                {"s3_url": f"s3://{self.bucket}/{u.key}", "from": u.path or u.description, "bytes": u.size()}
                for u in self.uploads
            ],
            "spec": self.spec.to_dict(),
            "tags": self.tags,
            "warm_pool": self.warm_pool,
            "gpu": self.gpu,
            "requirements": self.requirements,
            "efa_interfaces": self.efa_interfaces,
            "placement_group": self.placement_group,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``--dry-run --output json`` document."""
        return {**self.summary(), "template": self.template}


def plan(
    req: JobRequest,
    profile: Profile,
    code: Code,
    facts: dict[str, InstanceTypeInfo],
    *,
    user: str,
    region: str | None,
    run_id: str = "",
    reqs: Requirements | None = None,
    public_subnets: Collection[str] | None = None,
) -> Plan:
    """The plan for a validated ``req`` (``validate_request``) in a ready ``profile``; ``facts``
    is what EC2 says about each of its instance types (``lookups.instance_facts``); ``run_id``
    tells this run from other runs of the same job name (``prepare`` draws one per run-job);
    ``reqs``: the job's checked requirements (``requirements.check``); ``public_subnets``: those of
    the profile's subnets that map a public IPv4 on launch (``lookups.public_subnets``, looked up
    for a type with several EFA network cards only; None: not looked up)."""
    reqs = reqs or Requirements()
    gpu = check_instance_types(req, facts)
    efa = efa_interfaces(req, facts)
    placement_group = efa > 0 and not req.no_placement_group
    worker_subnets = _worker_subnets(req, profile, efa, placement_group, public_subnets)
    job = req.name or default_job_name(req, profile.name)
    prefix = naming.job_prefix(job)
    bucket = profile.bucket
    uploads: list[Upload] = []
    if code.kind == "s3":
        code_url = code.url
    else:
        key = prefix + ("code/code.tar.gz" if code.kind == "dir" else "code/" + code.script)
        uploads.append(Upload(key=key, path=code.path, data=code.data, description=code.source))
        code_url = f"s3://{bucket}/{key}"
    dist_name = code.dist.name if code.dist is not None else f"petctl-{__version__}-py3-none-any.whl"
    if code.dist is not None:
        uploads.append(Upload(key=prefix + "dist/" + dist_name, path=str(code.dist)))
    spec = JobSpec(
        job_name=job,
        user=user,
        region=region or "",
        min_nodes=req.min_nodes,
        max_nodes=req.max_nodes,
        nproc_per_node=req.nproc_per_node if req.nproc_per_node == "auto" else int(req.nproc_per_node),
        code_url=code_url,
        code_kind=code.kind,
        script=code.script,
        args=tuple(code.args),
        env={**efa_env(req, efa), **req.env},
        checkpoint_dir=naming.checkpoint_dir(job),
        status_url=f"s3://{bucket}/{prefix}status/",
        log_group=profile.log_group or naming.log_group(profile.name),
        worker_group=naming.worker_group(job),
        rdzv_group=naming.rdzv_group(job),
        lifecycle_hook=naming.LIFECYCLE_HOOK,
        drain_timeout=req.drain_timeout,
        rdzv_port=naming.RDZV_PORT,
        petctl_version=__version__,
        torch_version=req.torch_version,
        max_restarts=req.max_restarts,
        max_node_failures=req.max_node_failures,
        join_timeout=req.join_timeout,
        rdzv_backend=req.rdzv_backend,
        run_id=run_id,
        requirements=reqs.text if reqs else "",
        requirements_path=reqs.project_path if reqs and code.kind == "dir" else "",
        requirements_sha256=reqs.digest(code.data) if reqs else "",
        live=req.live,
    )
    try:
        JobSpec.from_dict(spec.to_dict())  # what every agent will parse: refuse it here, not there
    except SpecError as e:
        raise ConfigError(f"the job spec would not be accepted by the agent: {e}") from None
    uploads.append(Upload(key=prefix + "job.json", data=spec.to_json().encode(), description="job spec"))
    own_roles = _own_roles(profile)
    types = instance_types(req)
    template = templates.render_job(
        gpu=gpu,
        spot=req.spot,
        ami_override=req.ami is not None,
        instance_types=len(types),
        own_roles=own_roles,
        bucket_kms=own_roles and bool(profile.bucket_kms_key_arn),
        warm_pool=req.warm_pool > 0,
        etcd_v2=req.rdzv_backend in etcd.ETCD_V2_BACKENDS,
        live=req.live,
        efa_interfaces=efa,
        placement_group=placement_group,
    )
    values = _parameters(req, profile, job, types, own_roles, spec_url=f"s3://{bucket}/{prefix}job.json")
    values.update(_rdzv_parameters(req, profile, facts, own_roles))
    values["SubnetIds"] = ",".join(worker_subnets)
    values["DistUrl"] = f"s3://{bucket}/{prefix}dist/{dist_name}"
    values["User"] = sanitize_tag_value(user)
    if own_roles:
        values["LogGroupName"] = spec.log_group
    parameters = templates.job_parameters(template=template, **values)
    tags = {"petctl:job": job, "petctl:user": sanitize_tag_value(user), "petctl:profile": profile.name}
    kms_key = profile.bucket_kms_key_arn if own_roles else None
    template_key = prefix + "template.yaml"
    uploads.append(Upload(key=template_key, data=template.encode(), description="job stack template"))
    return Plan(
        job,
        naming.job_stack(job),
        template,
        parameters,
        uploads,
        spec,
        tags,
        bucket,
        kms_key,
        req.warm_pool,
        template_key,
        gpu,
        lines_for_plan(reqs, req.torch_version) if reqs else None,
        efa,
        placement_group,
    )


def _worker_subnets(
    req: JobRequest,
    profile: Profile,
    efa: int,
    placement_group: bool,
    public_subnets: Collection[str] | None,
) -> list[str]:
    """The worker group's subnets: the profile's, or only its first (the rendezvous server's) with a
    cluster placement group, which lives in one zone (AWS refuses a group spread over several).
    Refuses a type with several EFA network cards in subnets that map a public IPv4: EC2 gives no
    public address to an instance launched with several network interfaces, so its workers could
    reach neither PyPI nor S3 there without a NAT gateway."""
    subnets = list(profile.subnet_ids[:1] if placement_group else profile.subnet_ids)
    public = [s for s in subnets if s in (public_subnets or ())]
    if efa > 1 and public:
        types = instance_types(req)
        raise ConfigError(
            f"--instance-type {types[0]}: {efa} EFA network cards, and EC2 gives no public IPv4 to an "
            f"instance launched with several network interfaces, but subnet {public[0]} of profile "
            f"{profile.name!r} relies on one (it maps public addresses on launch); run the job in private "
            f"subnets with a NAT gateway (`{cmd('configure --subnet-ids subnet-a,subnet-b')}`, docs/contracts.md "
            f'"Private subnets, for an account with NAT"), or use a type with one network card'
        )
    return subnets


def _rdzv_parameters(
    req: JobRequest, profile: Profile, facts: dict[str, InstanceTypeInfo], own_roles: bool
) -> dict[str, str]:
    """The rendezvous server's image (Amazon Linux 2023 of its type's architecture) and the job's
    own etcd copy, if any. An s3:// copy must lie where the job's rendezvous role may read it."""
    values: dict[str, str] = {}
    arch = rdzv_architecture(req, facts)
    if arch != "x86_64":  # the template's default is the x86_64 image
        values["RdzvImageId"] = etcd.AL2023_AMI_PARAMETERS[arch]
    if req.rdzv_etcd_url is not None and req.rdzv_etcd_sha256 is not None:
        uploads = f"s3://{profile.bucket}/petctl/uploads/"
        if own_roles and req.rdzv_etcd_url.startswith("s3://") and not req.rdzv_etcd_url.startswith(uploads):
            raise ConfigError(
                f"--rdzv-etcd-url {req.rdzv_etcd_url} is outside {uploads}, the only place the job's "
                f"rendezvous role may read; copy it there (`{cmd('upload FILE')}`) and give that URL"
            )
        values["EtcdUrl"] = req.rdzv_etcd_url
        values["EtcdSha256"] = req.rdzv_etcd_sha256
    return values


def _own_roles(profile: Profile) -> bool:
    """Least privilege across jobs: the job stack makes this job's own roles, unless the profile
    records existing instance profiles (``configure``), which the instances then use as they are."""
    given_roles = [profile.worker_instance_profile_arn, profile.rdzv_instance_profile_arn]
    if any(given_roles) and not all(given_roles):
        raise ConfigError(
            f"profile {profile.name!r} records only one of worker_instance_profile_arn and "
            f"rdzv_instance_profile_arn; give both with `{cmd('configure')}`, or neither (each job then "
            f"gets its own roles)"
        )
    if not profile.vpc_id:
        raise ConfigError(
            f"profile {profile.name!r} records no vpc_id (the VPC of subnet {profile.subnet_ids[0]}), "
            f"which the job's security groups need; look it up first (jobs.resolve_vpc)"
        )
    return not all(given_roles)


def _parameters(
    req: JobRequest, profile: Profile, job: str, types: list[str], own_roles: bool, spec_url: str
) -> dict[str, Any]:
    values: dict[str, Any] = {
        "JobName": job,
        "InstanceType": types[0],
        "RdzvInstanceType": req.rdzv_instance_type,
        "MinSize": str(req.min_nodes),
        "MaxSize": str(req.max_nodes),
        "DesiredCapacity": str(req.size),
        "SubnetIds": ",".join(profile.subnet_ids),
        "RdzvSubnetId": profile.subnet_ids[0],
        "VpcId": profile.vpc_id,
        "SecurityGroupId": profile.security_group_id,
        "EfsId": profile.efs_id,
        "EfsPosixId": str(naming.efs_posix_id(job)),
        "SpecUrl": spec_url,
        "BucketName": profile.bucket,
        "DrainTimeout": str(req.drain_timeout),
        "TorchVersion": req.torch_version,
    }
    if own_roles:
        if profile.bucket_kms_key_arn:
            values["BucketKmsKeyArn"] = profile.bucket_kms_key_arn
    else:
        values["WorkerInstanceProfileArn"] = profile.worker_instance_profile_arn
        values["RdzvInstanceProfileArn"] = profile.rdzv_instance_profile_arn
    if req.ami is not None:
        values["ImageId"] = req.ami
        # An AMI's root device name differs by distribution (/dev/xvda, /dev/sda1): the encrypted
        # root volume must be mapped onto it, not added as a second disk.
        values["RootDeviceName"] = req.root_device_name
    if len(types) > 1:
        values["InstanceTypes"] = ",".join(types)
    if req.spot:
        values["OnDemandBaseCapacity"] = str(req.min_nodes)
    if req.warm_pool:
        values["WarmPoolSize"] = str(req.warm_pool)
    return values
