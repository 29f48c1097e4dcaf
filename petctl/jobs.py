"""Jobs: a request becomes a pure plan (``--dry-run`` prints it), then is executed.

Also the commands that observe and control a running job: scale, status,
hosts, jobs, kill_job.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from petctl import __version__, naming
from petctl.context import Context
from petctl.errors import (
    AwsError,
    ConfigError,
    NotFound,
    PetctlError,
    StackWaitTimeout,
    describe_client_error,
)
from petctl.storage import Upload, parse_s3_url
from petctl.ui import cmd

# NVIDIA GPU families the default image supports: the Deep Learning Base OSS Nvidia Driver AMI
# (Amazon Linux 2023) lists G4dn, G5, G6, Gr6, G6e, G6f, G7, G7e, P4d/P4de, P5/P5e/P5en, P6.
DLAMI_GPU_FAMILY = re.compile(r"^(g4dn|g5|g6|gr6|g6e|g6f|g7|g7e|p4d|p4de|p5|p5e|p5en|p6-b\d+)$")
# Older NVIDIA families that image does not support (its drivers dropped Kepler/Maxwell/Volta).
OLD_GPU_FAMILY = re.compile(r"^(p2|p3|p3dn|g3|g3s)$")
UNSUPPORTED_FAMILY = re.compile(r"^(a1|[a-z]+\d+g[a-z]*|g4ad|inf\d*|trn\d*|dl\d*|p6e-.*)$")
DEFAULT_INSTANCE_TYPE = "c6i.large"
DEFAULT_RDZV_INSTANCE_TYPE = "t3.small"
DEFAULT_DRAIN_TIMEOUT = 120
# A spot node gets a 2-minute interruption notice: its drain must end inside it.
DEFAULT_SPOT_DRAIN_TIMEOUT = 90
INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\d[a-z0-9-]*\.[a-z0-9]+$")
# One torch per job. The default is the version CI tests the agent with; the range is where the
# agent's torch internals were checked (the agent verifies them again at start, torch_compat).
DEFAULT_TORCH_VERSION = "2.13.0"
SUPPORTED_TORCH = ((2, 9), (2, 13))  # inclusive, major.minor
TORCH_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
DEFAULT_MAX_RESTARTS = 10
DEFAULT_JOIN_TIMEOUT = 1800
MAX_WARM_POOL = 100
STATES = ("STARTING", "RENDEZVOUS", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED", "DELETING")


@dataclass
class JobRequest:
    target: str
    args: list[str] = field(default_factory=list)
    min_nodes: int = 1
    max_nodes: int = 1
    size: int | None = None
    name: str | None = None
    instance_type: str = DEFAULT_INSTANCE_TYPE
    rdzv_instance_type: str = DEFAULT_RDZV_INSTANCE_TYPE
    nproc_per_node: str = "auto"
    spot: bool = False
    ami: str | None = None
    drain_timeout: int | None = None  # DEFAULT_(SPOT_)DRAIN_TIMEOUT, set by validate_request
    env: dict[str, str] = field(default_factory=dict)
    torch_version: str = DEFAULT_TORCH_VERSION
    max_restarts: int = DEFAULT_MAX_RESTARTS
    join_timeout: int = DEFAULT_JOIN_TIMEOUT
    rdzv_backend: str = "petctl-etcd"  # petctl_agent.spec.RDZV_BACKENDS
    root_device_name: str | None = None  # of --ami, looked up by resolve_ami()
    #: Stopped instances, pre-booted with the job's environment, that a scale-up takes first.
    warm_pool: int = 0


@dataclass
class Plan:
    """Everything ``run_job`` would do, as plain data."""

    job_name: str
    stack_name: str
    template: str
    parameters: list[dict[str, str]]
    uploads: list[Upload]
    spec: dict[str, Any]
    tags: dict[str, str]
    bucket: str
    #: The bucket's customer KMS key, which the job's roles may use: uploads encrypt with it.
    kms_key: str | None = None
    warm_pool: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "job": self.job_name,
            "stack": self.stack_name,
            "parameters": {p["ParameterKey"]: p["ParameterValue"] for p in self.parameters},
            "uploads": [
                {"s3_url": f"s3://{self.bucket}/{u.key}", "from": u.path or u.description, "bytes": u.size()}
                for u in self.uploads
            ],
            "spec": self.spec,
            "tags": self.tags,
            "warm_pool": self.warm_pool,
        }


def family(instance_type: str) -> str:
    return instance_type.split(".", 1)[0]


def is_gpu(instance_type: str) -> bool:
    """An NVIDIA GPU type (the first of a comma-separated list speaks for all of them)."""
    first = family(instance_type.split(",", 1)[0])
    return bool(DLAMI_GPU_FAMILY.match(first) or OLD_GPU_FAMILY.match(first))


def instance_types(req: JobRequest) -> list[str]:
    return [t.strip() for t in req.instance_type.split(",") if t.strip()]


def sanitize_tag_value(value: str) -> str:
    """A tag value AWS accepts everywhere (EC2, Auto Scaling, CloudFormation): letters, digits,
    spaces and ``_.:/=+-@``, at most 128 characters (other characters become '-')."""
    return (re.sub(r"[^\w .:/=+\-@]", "-", value, flags=re.ASCII).strip()[:128]) or "unknown"


def default_job_name(req: JobRequest, profile: str = "") -> str:
    """``<script stem>-<4 hex>``, the same for the same request: a dry run names the job the real
    run will make, and running the same command twice finds the first job instead of a twin."""
    target = req.target if req.target.startswith("s3://") else str(Path(req.target).resolve())
    stem = Path(req.target.rstrip("/")).stem
    stem = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-") or "job"
    if not stem[0].isalpha():
        stem = "job-" + stem
    fields = {k: v for k, v in asdict(req).items() if k not in ("name", "target", "root_device_name")}
    if not req.warm_pool:
        del fields["warm_pool"]  # jobs named before warm pools existed keep their names
    digest = hashlib.sha1(json.dumps([profile, target, fields], sort_keys=True).encode()).hexdigest()[:4]
    return f"{stem[:30].rstrip('-')}-{digest}"


def validate_request(req: JobRequest) -> JobRequest:
    """Check sizes, name and target before anything is created."""
    size = req.min_nodes if req.size is None else req.size
    if req.min_nodes < 1:
        raise ConfigError(f"--min {req.min_nodes} is invalid: a job needs at least 1 node")
    if req.max_nodes < req.min_nodes:
        raise ConfigError(f"--max {req.max_nodes} is smaller than --min {req.min_nodes}")
    if not req.min_nodes <= size <= req.max_nodes:
        raise ConfigError(f"--size {size} is outside [--min {req.min_nodes}, --max {req.max_nodes}]")
    req.size = size
    if req.name is not None and not naming.JOB_NAME_RE.match(req.name):
        raise ConfigError(
            f"job name {req.name!r} is invalid: 2-40 characters, lower-case letters, digits and '-', "
            f"starting with a letter"
        )
    types = instance_types(req)
    if not types or len(types) > 20:
        raise ConfigError(
            f"--instance-type {req.instance_type!r}: give 1 to 20 comma-separated instance types"
        )
    for t in types:
        if not INSTANCE_TYPE_RE.match(t):
            raise ConfigError(f"--instance-type {t!r} is not an EC2 instance type like c6i.large")
        if len(types) > 1 and types.count(t) > 1:
            raise ConfigError(f"--instance-type lists {t} twice")
        if req.ami is None and UNSUPPORTED_FAMILY.match(family(t)):
            raise ConfigError(
                f"--instance-type {t}: Graviton, Inferentia, Trainium and AMD GPU types need an "
                f"image petctl does not pick for you; pass --ami, or use an x86 CPU or NVIDIA GPU type"
            )
        if req.ami is None and OLD_GPU_FAMILY.match(family(t)):
            raise ConfigError(
                f"--instance-type {t}: the Deep Learning AMI does not support {family(t)}; use a G4dn, G5, "
                f"G6, G6e, P4d, P5 or newer type, or pass --ami with an image that does"
            )
    if len({is_gpu(t) for t in types}) > 1:
        raise ConfigError(
            f"--instance-type {req.instance_type}: mixes GPU and CPU types, which need different images; "
            f"list only one kind"
        )
    if not INSTANCE_TYPE_RE.match(req.rdzv_instance_type) or UNSUPPORTED_FAMILY.match(
        family(req.rdzv_instance_type)
    ):
        raise ConfigError(
            f"--rdzv-instance-type {req.rdzv_instance_type!r}: the rendezvous server runs the x86_64 "
            f"Amazon Linux 2023 image; use an x86 type like t3.small"
        )
    if req.nproc_per_node != "auto" and not (req.nproc_per_node.isdigit() and int(req.nproc_per_node) >= 1):
        raise ConfigError(
            f"--nproc-per-node {req.nproc_per_node!r} is invalid: use 'auto' or a positive integer"
        )
    if req.ami is not None and not re.match(r"^ami-[0-9a-f]{8,17}$", req.ami):
        raise ConfigError(f"--ami {req.ami!r} is not an AMI id like ami-0abc12345")
    _check_warm_pool(req, types)
    if req.drain_timeout is None:
        req.drain_timeout = DEFAULT_SPOT_DRAIN_TIMEOUT if req.spot else DEFAULT_DRAIN_TIMEOUT
    if req.drain_timeout < 30 or req.drain_timeout > 7200:
        raise ConfigError(f"--drain-timeout {req.drain_timeout} is out of range: use 30 to 7200 seconds")
    m = TORCH_VERSION_RE.match(req.torch_version)
    lo, hi = SUPPORTED_TORCH
    if not m or not lo <= (int(m.group(1)), int(m.group(2))) <= hi:
        raise ConfigError(
            f"--torch-version {req.torch_version!r} is not supported: use a release like "
            f"{DEFAULT_TORCH_VERSION} from {lo[0]}.{lo[1]}.0 to {hi[0]}.{hi[1]}.x"
        )
    if not 0 <= req.max_restarts <= 1000:
        raise ConfigError(f"--max-restarts {req.max_restarts} is out of range: use 0 to 1000")
    if not 60 <= req.join_timeout <= 7 * 86400:
        raise ConfigError(
            f"--join-timeout {req.join_timeout} is out of range: use 60 to 604800 seconds (7 days)"
        )
    if req.target.startswith("s3://"):
        parse_s3_url(req.target)
        if req.target.endswith("/"):
            raise ConfigError(f"{req.target} is a prefix: give the URL of the script itself")
    else:
        p = Path(req.target)
        if not p.exists():
            raise ConfigError(f"{req.target} does not exist: give a script, a directory or an s3:// URL")
        if p.is_dir() and not req.args:
            raise ConfigError(
                f"{req.target} is a directory: give the script inside it as the first argument after --"
            )
        if p.is_dir() and not (p / req.args[0]).is_file():
            raise ConfigError(f"{req.args[0]} is not a file inside {req.target}")
    return req


def _check_warm_pool(req: JobRequest, types: list[str]) -> None:
    if not 0 <= req.warm_pool <= MAX_WARM_POOL:
        raise ConfigError(f"--warm-pool {req.warm_pool} is out of range: use 0 to {MAX_WARM_POOL}")
    if not req.warm_pool:
        return
    if req.spot or len(types) > 1:
        raise ConfigError(
            f"--warm-pool cannot go with {'--spot' if req.spot else 'several --instance-type values'}: "
            f"AWS does not allow a warm pool on a group with Spot instances or a mixed instances policy"
        )
    if req.warm_pool > req.max_nodes:
        raise ConfigError(
            f"--warm-pool {req.warm_pool} is more than --max {req.max_nodes}: the group never runs more "
            f"than --max nodes, so the rest of the pool would only cost; use --warm-pool {req.max_nodes} or fewer"
        )


def plan(ctx: Context, req: JobRequest, dist: Path | None = None) -> Plan:
    """Build the plan for ``req``: pure apart from reading local files."""
    from petctl import storage, templates

    validate_request(req)
    profile = ctx.profile
    profile.require_ready()
    job = req.name or default_job_name(req, profile.name)
    prefix = naming.job_prefix(job)
    bucket = profile.bucket
    uploads: list[Upload] = []
    args = list(req.args)
    if req.target.startswith("s3://"):
        code_url, code_kind, script = req.target, "s3", Path(parse_s3_url(req.target)[1]).name
    elif Path(req.target).is_dir():
        key = prefix + "code/code.tar.gz"
        data = storage.tar_directory(Path(req.target))
        uploads.append(Upload(key=key, data=data, description=f"tar of {req.target}"))
        code_url, code_kind, script = f"s3://{bucket}/{key}", "dir", args.pop(0)
    else:
        name = Path(req.target).name
        key = prefix + "code/" + name
        uploads.append(Upload(key=key, path=str(Path(req.target).resolve())))
        code_url, code_kind, script = f"s3://{bucket}/{key}", "script", name
    if dist is not None:
        uploads.append(Upload(key=prefix + "dist/" + dist.name, path=str(dist)))
        dist_url = f"s3://{bucket}/{prefix}dist/{dist.name}"
    else:
        dist_url = f"s3://{bucket}/{prefix}dist/petctl-{__version__}-py3-none-any.whl"
    spec_url = f"s3://{bucket}/{prefix}job.json"
    spec = {
        "version": 1,
        "job_name": job,
        "user": ctx.user,
        "region": ctx.region,
        "min_nodes": req.min_nodes,
        "max_nodes": req.max_nodes,
        "nproc_per_node": req.nproc_per_node if req.nproc_per_node == "auto" else int(req.nproc_per_node),
        "code_url": code_url,
        "code_kind": code_kind,
        "script": script,
        "args": args,
        "env": dict(req.env),
        "checkpoint_dir": naming.checkpoint_dir(job),
        "status_url": f"s3://{bucket}/{prefix}status/",
        "log_group": profile.log_group or naming.log_group(profile.name),
        "worker_group": naming.worker_group(job),
        "rdzv_group": naming.rdzv_group(job),
        "lifecycle_hook": naming.LIFECYCLE_HOOK,
        "drain_timeout": req.drain_timeout,
        "rdzv_port": naming.RDZV_PORT,
        "petctl_version": __version__,
        "torch_version": req.torch_version,
        "max_restarts": req.max_restarts,
        "join_timeout": req.join_timeout,
        "rdzv_backend": req.rdzv_backend,
    }
    uploads.append(
        Upload(key=prefix + "job.json", data=json.dumps(spec, indent=2).encode(), description="job spec")
    )
    gpu = is_gpu(req.instance_type)
    types = instance_types(req)
    # Least privilege across jobs: the job stack makes this job's own roles, unless the profile
    # records existing instance profiles (`configure`), which the instances then use as they are.
    given_roles = [profile.worker_instance_profile_arn, profile.rdzv_instance_profile_arn]
    if any(given_roles) and not all(given_roles):
        raise ConfigError(
            f"profile {profile.name!r} records only one of worker_instance_profile_arn and "
            f"rdzv_instance_profile_arn; give both with `{cmd('configure')}`, or neither (each job then "
            f"gets its own roles)"
        )
    own_roles = not all(given_roles)
    if not profile.vpc_id:
        raise ConfigError(
            f"profile {profile.name!r} records no vpc_id (the VPC of subnet {profile.subnet_ids[0]}), "
            f"which the job's security groups need; look it up first (jobs.resolve_vpc)"
        )
    template = templates.render_job(
        gpu=gpu,
        spot=req.spot,
        ami_override=req.ami is not None,
        instance_types=len(types),
        own_roles=own_roles,
        bucket_kms=own_roles and bool(profile.bucket_kms_key_arn),
        # F's render_job(warm_pool=...) pending
        **({"warm_pool": True} if req.warm_pool else {}),
    )
    values: dict[str, Any] = {
        "JobName": job,
        "User": sanitize_tag_value(ctx.user),
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
        "SpecUrl": spec_url,
        "DistUrl": dist_url,
        "BucketName": bucket,
        "DrainTimeout": str(req.drain_timeout),
        "TorchVersion": req.torch_version,
    }
    if own_roles:
        values["LogGroupName"] = spec["log_group"]
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
    parameters = templates.job_parameters(template=template, **values)
    tags = {"petctl:job": job, "petctl:user": sanitize_tag_value(ctx.user), "petctl:profile": profile.name}
    kms_key = profile.bucket_kms_key_arn if own_roles else None
    return Plan(
        job, naming.job_stack(job), template, parameters, uploads, spec, tags, bucket, kms_key, req.warm_pool
    )


def resolve_ami(ctx: Context, req: JobRequest) -> None:
    """Check that ``--ami`` exists in the region and record its root device name."""
    if req.ami is None:
        return
    try:
        images = ctx.clients()("ec2").describe_images(ImageIds=[req.ami])["Images"]
    except Exception as e:  # noqa: BLE001 - InvalidAMIID.* and friends
        raise ConfigError(f"--ami {req.ami} is not usable in {ctx.region}: {describe_client_error(e)}") from e
    if not images:
        raise ConfigError(f"--ami {req.ami} was not found in {ctx.region}")
    req.root_device_name = images[0].get("RootDeviceName") or None


def resolve_vpc(ctx: Context) -> None:
    """Record the VPC of the profile's first subnet when the profile has none (profiles made by
    ``configure`` without ``--vpc-id``): the job's security groups are made in it. ``setup``
    profiles always have it. Saved, so the lookup happens once."""
    from petctl import config

    profile = ctx.profile
    if profile.vpc_id or not profile.subnet_ids:
        return
    subnet = profile.subnet_ids[0]
    try:
        subnets = ctx.clients()("ec2").describe_subnets(SubnetIds=[subnet])["Subnets"]
    except Exception as e:  # noqa: BLE001 - InvalidSubnetID.NotFound, no access
        raise ConfigError(
            f"cannot find the VPC of subnet {subnet} ({describe_client_error(e)}); check the profile's "
            f"subnets with `{cmd('configure --show')}`"
        ) from e
    if not subnets:
        raise ConfigError(f"subnet {subnet} of profile {profile.name!r} was not found in {ctx.region}")
    profile.vpc_id = subnets[0]["VpcId"]
    config.save_profile(profile)


def check_code_url(ctx: Context, req: JobRequest) -> None:
    """Refuse an ``s3://`` target that does not exist; warn when it lies where the worker role
    cannot read it. Runs before anything is created."""
    if not req.target.startswith("s3://"):
        return
    bucket, key = parse_s3_url(req.target)
    try:
        ctx.clients()("s3").head_object(Bucket=bucket, Key=key)
    except Exception as e:  # noqa: BLE001 - ClientError, or no access at all
        code = describe_client_error(e)
        if code.startswith(("404", "NoSuchKey", "NoSuchBucket", "NotFound")):
            raise ConfigError(
                f"{req.target} does not exist; upload it first (`{cmd('upload FILE ' + req.target)}`)"
            ) from None
        ctx.ui.warn(f"could not check {req.target} ({code}); the instances may not be able to read it")
    if bucket != ctx.profile.bucket or not key.startswith("petctl/uploads/"):
        ctx.ui.warn(
            f"{req.target} is outside s3://{ctx.profile.bucket}/petctl/uploads/, which is all a job's role "
            f"may read besides its own prefix; copy it there (`{cmd('upload FILE')}`) or grant the role access"
        )


def execute(ctx: Context, p: Plan, timeout: float = 1800) -> dict[str, Any]:
    """Upload, create the job stack, wait. On any failure (or Ctrl-C) remove what was made."""
    from petctl import storage
    from petctl.stacks import Stacks

    clients = ctx.clients()
    clients.check_credentials()
    s3 = clients("s3")
    stacks = Stacks(clients("cloudformation"), ctx.ui)
    if stacks.describe(p.stack_name) is not None:
        raise PetctlError(
            f"job {p.job_name!r} already exists (the same command without --name makes the same job); "
            f"watch it with `{cmd('status ' + p.job_name)}`, give --name for another, or "
            f"`{cmd('kill-job ' + p.job_name)}`"
        )
    prefix = naming.job_prefix(p.job_name)
    # A reused job name must not inherit the previous run's reports (kill_job keeps the prefix).
    for stale in ("status/", "boot/"):
        storage.delete_prefix(s3, p.bucket, prefix + stale)
    try:
        for u in p.uploads:
            ctx.ui.progress(f"uploading s3://{p.bucket}/{u.key} ({u.size()} bytes)")
            try:
                storage.put(s3, p.bucket, u, kms_key=p.kms_key)
            except Exception as e:  # boto3's S3 transfer raises several types
                raise AwsError(f"upload to s3://{p.bucket}/{u.key} failed: {describe_client_error(e)}") from e
        result = stacks.deploy(p.stack_name, p.template, p.parameters, p.tags, timeout=timeout)
    except StackWaitTimeout as e:
        # The stack goes on being created: keep it *and* its uploads (its instances will read
        # them), and say how to follow or remove it. Deleting only the uploads would leave
        # instances booting with nothing to run.
        raise StackWaitTimeout(
            f"{e}; the job stack and its uploads are kept: watch it with `{cmd('status ' + p.job_name)}`, "
            f"or remove it with `{cmd('kill-job ' + p.job_name)}`"
        ) from e
    except BaseException:
        # Nothing half-made: the stack is already deleted by deploy(); remove the uploads too.
        try:
            storage.delete_prefix(s3, p.bucket, prefix)
        except Exception as cleanup_error:  # noqa: BLE001 - keep the original error
            ctx.ui.warn(f"could not remove s3://{p.bucket}/{prefix}: {cleanup_error}")
        raise
    out = result.outputs
    suspend_az_rebalance(ctx, out.get("WorkerGroupName", naming.worker_group(p.job_name)))
    return {
        "job": p.job_name,
        "stack": p.stack_name,
        "min": p.spec["min_nodes"],
        "max": p.spec["max_nodes"],
        "size": int({x["ParameterKey"]: x["ParameterValue"] for x in p.parameters}["DesiredCapacity"]),
        "instance_type": {x["ParameterKey"]: x["ParameterValue"] for x in p.parameters}["InstanceType"],
        "rendezvous_endpoint": out.get("RdzvEndpoint"),
        "worker_group": out.get("WorkerGroupName", naming.worker_group(p.job_name)),
        "s3_prefix": f"s3://{p.bucket}/{prefix}",
    }


def upload_tls(s3: Any, p: Plan) -> None:
    """The job's etcd CA and client certificate, made here and readable only by its instances
    (their roles read their own job's prefix); the keys never leave this machine otherwise."""
    from petctl import storage, tls

    prefix = naming.job_prefix(p.job_name) + "tls/"
    for name, data in tls.make_job_tls(p.job_name).items():
        try:
            storage.put(s3, p.bucket, Upload(key=prefix + name, data=data), kms_key=p.kms_key)
        except Exception as e:  # noqa: BLE001 - named, then cleaned up like every other upload
            raise AwsError(
                f"upload to s3://{p.bucket}/{prefix}{name} failed: {describe_client_error(e)}"
            ) from e


def suspend_az_rebalance(ctx: Context, group: str) -> None:
    """Keep Auto Scaling from terminating training nodes only to even out zones.

    AZRebalance replaces instances to balance AZs, which costs a membership change each time;
    CloudFormation has no property for suspended processes, so it is done once here.
    """
    try:
        ctx.clients()("autoscaling").suspend_processes(
            AutoScalingGroupName=group, ScalingProcesses=["AZRebalance"]
        )
    except Exception as e:  # noqa: BLE001 - the job runs either way
        ctx.ui.warn(
            f"could not suspend AZRebalance on {group} ({describe_client_error(e)}); it may move nodes"
        )


# -- observing and controlling -------------------------------------------------


def job_stacks(ctx: Context, stacks: Any) -> list[dict[str, Any]]:
    """Live job stacks of the current profile."""
    result = []
    for s in stacks.list_stacks("petctl-job-"):
        tags = {t["Key"]: t["Value"] for t in s.get("Tags", []) or []}
        if tags.get("petctl:profile") == ctx.profile_name:
            result.append(s)
    return result


def _stacks(ctx: Context) -> Any:
    from petctl.stacks import Stacks

    return Stacks(ctx.clients()("cloudformation"), ctx.ui)


def _check_job_name(job: str) -> None:
    if not naming.JOB_NAME_RE.match(job):
        raise ConfigError(f"{job!r} is not a valid job name; `{cmd('jobs')}` lists the jobs")


def find_job(ctx: Context, job: str, stacks: Any = None) -> dict[str, Any] | None:
    """The job's stack if it exists in the active profile, else None.

    Job stacks are named per account and region, not per profile, so a stack of the same name
    may belong to another profile: that one is never touched (NotFound names its profile).
    """
    _check_job_name(job)
    stack = (stacks or _stacks(ctx)).describe(naming.job_stack(job))
    if stack is None:
        return None
    owner = {t["Key"]: t["Value"] for t in stack.get("Tags", []) or []}.get("petctl:profile")
    if owner != ctx.profile_name:
        raise NotFound(
            f"job {job!r} not found in profile {ctx.profile_name!r} (a job of that name belongs to "
            f"profile {owner!r}; use --profile {owner} to act on it)"
            if owner
            else f"job {job!r} not found in profile {ctx.profile_name!r} (its stack was not made by petctl)"
        )
    return stack


def _require_job(ctx: Context, job: str, stacks: Any = None) -> dict[str, Any]:
    stack = find_job(ctx, job, stacks)
    if stack is None:
        raise NotFound(
            f"job {job!r} not found in profile {ctx.profile_name!r}; `{cmd('jobs')}` lists the jobs"
        )
    return stack


def describe_group(asg: Any, name: str) -> dict[str, Any] | None:
    groups = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"]
    return groups[0] if groups else None


def scale(ctx: Context, job: str, size: int) -> dict[str, Any]:
    """Set the worker group's desired capacity through the Auto Scaling API."""
    _require_job(ctx, job)
    asg = ctx.clients()("autoscaling")
    group = describe_group(asg, naming.worker_group(job))
    if group is None:
        raise NotFound(f"job {job!r} has no worker group; is it being deleted? `{cmd('status ' + job)}`")
    lo, hi, before = group["MinSize"], group["MaxSize"], group["DesiredCapacity"]
    if not lo <= size <= hi:
        raise ConfigError(f"--size {size} is outside the job's range [{lo}, {hi}]")
    try:
        asg.set_desired_capacity(
            AutoScalingGroupName=group["AutoScalingGroupName"], DesiredCapacity=size, HonorCooldown=False
        )
    except Exception as e:
        raise AwsError(f"could not scale {job}: {describe_client_error(e)}") from e
    return {"job": job, "from": before, "to": size, "min": lo, "max": hi}


def hosts(ctx: Context, job: str) -> list[dict[str, Any]]:
    """The rendezvous server and the workers: id, IP, AZ, lifecycle state, SSM command."""
    _require_job(ctx, job)
    clients = ctx.clients()
    asg, ec2 = clients("autoscaling"), clients("ec2")
    rows: list[dict[str, Any]] = []
    for role, gname in (("rdzv", naming.rdzv_group(job)), ("worker", naming.worker_group(job))):
        group = describe_group(asg, gname)
        for inst in (group or {}).get("Instances", []):
            rows.append(
                {
                    "role": role,
                    "instance_id": inst["InstanceId"],
                    "availability_zone": inst.get("AvailabilityZone"),
                    "lifecycle_state": inst.get("LifecycleState"),
                    "health": inst.get("HealthStatus"),
                    "instance_type": inst.get("InstanceType"),
                }
            )
    ids = [r["instance_id"] for r in rows]
    details: dict[str, dict[str, Any]] = {}
    if ids:
        for res in ec2.describe_instances(InstanceIds=ids)["Reservations"]:
            for i in res["Instances"]:
                details[i["InstanceId"]] = i
    for r in rows:
        d = details.get(r["instance_id"], {})
        r["private_ip"] = d.get("PrivateIpAddress")
        r["spot"] = d.get("InstanceLifecycle") == "spot"
        r["ssm"] = f"aws ssm start-session --target {r['instance_id']} --region {clients.region}"
    return rows


def agent_statuses(ctx: Context, job: str) -> list[dict[str, Any]]:
    from petctl import storage

    bucket = ctx.profile.bucket
    if not bucket:
        return []
    try:
        return storage.read_json_objects(ctx.clients()("s3"), bucket, naming.job_prefix(job) + "status/")
    except Exception as e:  # noqa: BLE001 - status must still show the group
        ctx.ui.warn(f"could not read agent status from s3://{bucket}: {describe_client_error(e)}")
        return []


#: Boot logs (s3://<bucket>/petctl/jobs/<job>/boot/) after which, with no agent ever training, the
#: job counts as FAILED; the boot scripts scale the groups to zero at the same count (common.sh.j2).
BOOT_FAILURES_TO_FAIL = 3
#: How much of the newest boot log status shows.
BOOT_LOG_LINES = 15


def boot_failures(ctx: Context, job: str) -> dict[str, Any]:
    """The boot logs failing instances published: how many, and the newest one's last lines."""
    result: dict[str, Any] = {"count": 0, "instance_id": None, "at": None, "last_lines": []}
    bucket = ctx.profile.bucket
    if not bucket:
        return result
    prefix = naming.job_prefix(job) + "boot/"
    try:
        s3 = ctx.clients()("s3")
        logs = [
            o
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
            if o["Key"].endswith(".log")
        ]
        if not logs:
            return result
        newest = max(logs, key=lambda o: (o.get("LastModified") is not None, o.get("LastModified"), o["Key"]))
        # The end of the log says why: read at most its last 16 KiB.
        body = s3.get_object(Bucket=bucket, Key=newest["Key"], Range="bytes=-16384")["Body"].read()
    except Exception as e:  # noqa: BLE001 - status must still show the group
        ctx.ui.warn(f"could not read boot logs from s3://{bucket}/{prefix}: {describe_client_error(e)}")
        return result
    lines = [line for line in body.decode("utf-8", "replace").splitlines() if line.strip()]
    result.update(
        count=len(logs),
        instance_id=newest["Key"][len(prefix) : -len(".log")],
        at=_iso(newest.get("LastModified")),
        last_lines=lines[-BOOT_LOG_LINES:],
    )
    return result


def boot_events(ctx: Context, job: str) -> list[dict[str, Any]]:
    """Each boot's timestamped events (boot/events/<instance-id>.json, written by the boot scripts),
    oldest boot first, with ``phases`` (each event after the first, with the seconds since the one
    before) and ``seconds`` (first to last event)."""
    from petctl import storage

    bucket = ctx.profile.bucket
    if not bucket:
        return []
    try:
        docs = storage.read_json_objects(ctx.clients()("s3"), bucket, naming.job_prefix(job) + "boot/events/")
    except Exception as e:  # noqa: BLE001 - status must still show the group
        ctx.ui.warn(f"could not read boot events from s3://{bucket}: {describe_client_error(e)}")
        return []
    out = []
    for d in docs:
        events = [
            e for e in d.get("events") or [] if isinstance(e, dict) and isinstance(e.get("t"), (int, float))
        ]
        if not events:
            continue
        phases = [
            {"kind": b["kind"], "seconds": round(b["t"] - a["t"], 2)} for a, b in zip(events, events[1:])
        ]
        out.append(
            {
                "instance_id": d.get("instance_id"),
                "role": d.get("role"),
                "events": events,
                "phases": phases,
                "seconds": round(events[-1]["t"] - events[0]["t"], 2),
            }
        )
    return sorted(out, key=lambda d: d["events"][0]["t"])


def ever_trained(agents: list[dict[str, Any]]) -> bool:
    """Whether any agent of the job ever had its workers running (or finished)."""
    for a in agents:
        if a.get("state") in ("RUNNING", "SUCCEEDED", "DRAINING", "LEFT"):
            return True
        if any(e.get("kind") in ("workers_started", "succeeded") for e in a.get("events", []) or []):
            return True
    return False


def boot_failed(boot: dict[str, Any] | None, trained: bool, desired: int | None) -> bool:
    """Every node keeps failing its boot: boot logs exist, no agent ever trained, and there are
    BOOT_FAILURES_TO_FAIL of them (or the boot scripts already scaled the groups to zero)."""
    count = (boot or {}).get("count") or 0
    return count > 0 and not trained and (count >= BOOT_FAILURES_TO_FAIL or desired == 0)


def boot_failure_reason(boot: dict[str, Any]) -> str:
    tail = "\n".join("    " + line for line in boot.get("last_lines") or [])
    return (
        f"{boot['count']} instance boot(s) failed and no node ever trained; the newest boot log "
        f"(s3 .../boot/{boot.get('instance_id')}.log) ends:\n{tail}"
    )


def overall_state(
    stack_status: str | None,
    agents: list[dict[str, Any]],
    desired: int | None,
    boot_failure: bool = False,
) -> str:
    """The job's state from its stack, its agents' reports and its boot logs (contracts.md)."""
    if stack_status is None:
        return "GONE"
    if stack_status.startswith("DELETE"):
        return "DELETING"
    if stack_status.endswith("_FAILED") or stack_status in ("ROLLBACK_COMPLETE", "ROLLBACK_IN_PROGRESS"):
        return "FAILED"
    if stack_status.endswith("_IN_PROGRESS") and stack_status.startswith("CREATE"):
        return "STARTING"
    if boot_failure:
        return "FAILED"
    states = [a.get("state") for a in agents]
    if "FAILED" in states:
        return "FAILED"
    if "SUCCEEDED" in states and not any(s in ("RUNNING", "RENDEZVOUS", "STARTING") for s in states):
        return "SUCCEEDED"
    if "RENDEZVOUS" in states:
        return "RENDEZVOUS"
    if "RUNNING" in states:
        return "RUNNING"
    if desired == 0:
        return "STOPPED"
    return "STARTING"


#: A draining agent out of its group (the group lists it no more, while it checkpoints and
#: leaves) still counts this long after its last report: the longest drain timeout.
DRAINING_GRACE_S = 7200


def current_agents(
    agents: list[dict[str, Any]], live: set[str], now: float | None = None
) -> list[dict[str, Any]]:
    """Reports that still speak for the job: live instances, final results of gone ones, and
    nodes still draining after their group let go of them.

    A hard-killed instance leaves its last report (say RUNNING) behind; it must not count.
    """
    now = time.time() if now is None else now

    def speaks(a: dict[str, Any]) -> bool:
        if a.get("instance_id") in live or a.get("state") in ("SUCCEEDED", "FAILED"):
            return True
        return a.get("state") == "DRAINING" and now - float(a.get("updated_at") or 0) < DRAINING_GRACE_S

    return [a for a in agents if speaks(a)]


def group_instance_ids(asg: Any, job: str) -> set[str]:
    ids: set[str] = set()
    for name in (naming.worker_group(job), naming.rdzv_group(job)):
        ids |= {i["InstanceId"] for i in (describe_group(asg, name) or {}).get("Instances", [])}
    return ids


def status(ctx: Context, job: str) -> dict[str, Any]:
    stacks = _stacks(ctx)
    stack = _require_job(ctx, job, stacks)
    asg = ctx.clients()("autoscaling")
    group = describe_group(asg, naming.worker_group(job)) or {}
    host_rows = hosts(ctx, job)
    agents = agent_statuses(ctx, job)
    by_id = {a.get("instance_id"): a for a in agents}
    live = {h["instance_id"] for h in host_rows}
    for h in host_rows:
        a = by_id.get(h["instance_id"], {})
        for k in ("state", "world_size", "round", "restarts", "last_step", "last_checkpoint_step", "reason"):
            h[f"agent_{k}" if k == "state" else k] = a.get(k)
    current = current_agents(agents, live)
    for a in current:
        if a.get("instance_id") not in live and a.get("state") == "DRAINING":
            # Out of the group's list, not gone yet: it is checkpointing and leaving.
            host_rows.append(
                {
                    "role": "worker",
                    "instance_id": a.get("instance_id"),
                    "private_ip": a.get("private_ip"),
                    "lifecycle_state": "Terminating",
                    "agent_state": "DRAINING",
                    **{k: a.get(k) for k in ("world_size", "round", "restarts", "last_step", "reason")},
                }
            )
    steps = [a.get("last_step") for a in agents if a.get("last_step") is not None]
    ckpts = [a.get("last_checkpoint_step") for a in agents if a.get("last_checkpoint_step") is not None]
    worlds = [a.get("world_size") for a in current if a.get("state") == "RUNNING" and a.get("world_size")]
    events = sorted(
        ({**e, "instance_id": a.get("instance_id")} for a in agents for e in a.get("events", []) or []),
        key=lambda e: e.get("t", 0),
    )
    boot = boot_failures(ctx, job)
    failed_boot = boot_failed(boot, ever_trained(agents), group.get("DesiredCapacity"))
    state = overall_state(stack["StackStatus"], current, group.get("DesiredCapacity"), failed_boot)
    return {
        "job": job,
        "state": state,
        # Why a job failed, when petctl knows it (for now: every boot keeps failing).
        "reason": boot_failure_reason(boot) if failed_boot and state == "FAILED" else None,
        "boot_failures": boot,
        "boot_events": boot_events(ctx, job),
        "stack_status": stack["StackStatus"],
        "min": group.get("MinSize"),
        "max": group.get("MaxSize"),
        "desired": group.get("DesiredCapacity"),
        "in_service": sum(1 for i in group.get("Instances", []) if i.get("LifecycleState") == "InService"),
        "world_size": max(worlds) if worlds else None,
        "last_step": max(steps) if steps else None,
        "last_checkpoint_step": max(ckpts) if ckpts else None,
        "restarts": max((a.get("restarts") or 0 for a in agents), default=0),
        "rounds": max((a.get("round") or 0 for a in agents), default=0),
        # A script that does not use the checkpoint helper reports no step: say so, not '-'.
        "reports_progress": bool(steps),
        "uptime_s": _uptime(stack, agents),
        "hosts": host_rows,
        "agents": agents,
        "events": events,
    }


def _iso(value: Any) -> str | None:
    """An ISO 8601 UTC timestamp (JSON keeps these; text shows ages)."""
    if hasattr(value, "isoformat"):
        import datetime as dt

        return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")
    return str(value) if value else None


def _uptime(stack: dict[str, Any], agents: list[dict[str, Any]]) -> float | None:
    """Seconds since the job's stack was created (else since its first agent event)."""
    created = stack.get("CreationTime")
    if hasattr(created, "timestamp"):
        return round(time.time() - created.timestamp(), 1)
    starts = [e.get("t") for a in agents for e in a.get("events", []) or [] if e.get("t")]
    return round(time.time() - min(starts), 1) if starts else None


def list_jobs(ctx: Context) -> list[dict[str, Any]]:
    stacks = _stacks(ctx)
    asg = ctx.clients()("autoscaling")
    rows = []
    for s in job_stacks(ctx, stacks):
        job = naming.job_from_stack(s["StackName"])
        group = describe_group(asg, naming.worker_group(job)) or {}
        reports = agent_statuses(ctx, job)
        agents = current_agents(reports, group_instance_ids(asg, job))
        # Only a job that never trained can have failed at boot: skip the S3 list otherwise.
        failed_boot = not ever_trained(reports) and boot_failed(
            boot_failures(ctx, job), False, group.get("DesiredCapacity")
        )
        rows.append(
            {
                "job": job,
                "state": overall_state(s["StackStatus"], agents, group.get("DesiredCapacity"), failed_boot),
                "min": group.get("MinSize"),
                "max": group.get("MaxSize"),
                "desired": group.get("DesiredCapacity"),
                "in_service": sum(
                    1 for i in group.get("Instances", []) if i.get("LifecycleState") == "InService"
                ),
                "created": _iso(s.get("CreationTime")),
            }
        )
    return rows


def kill_job(
    ctx: Context,
    job: str,
    stacks: Any = None,
    timeout: float = 1800,
    wait: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Stop the workers, then delete the job stack (the rendezvous server goes last), and wait
    until every instance is really gone. Killing a job that is gone is not an error; killing
    another profile's job is (``find_job``).

    Workers first: scaled to zero they drain (checkpoint, leave) while etcd still answers, so
    they neither log connection errors nor lose steps. ``wait=False`` only starts the deletion.
    """
    stacks = stacks or _stacks(ctx)
    stack = find_job(ctx, job, stacks)
    result = {
        "job": job,
        "deleted": False,
        "seconds": 0.0,
        "waited": wait,
        "checkpoints_kept": f"{ctx.profile.efs_id or '<efs>'}:/{naming.checkpoint_dir(job)}",
    }
    if stack is None:
        delete_tls(ctx, job)  # left by a `kill-job --no-wait`
        return result
    t0 = time.monotonic()
    if not wait:
        ctx.clients()("cloudformation").delete_stack(StackName=naming.job_stack(job))
        # No instance of a deleting stack may start any more: its keys can go now.
        delete_tls(ctx, job)
        result["deleted"] = True
        return result
    asg = ctx.clients()("autoscaling")
    workers = naming.worker_group(job)
    if describe_group(asg, workers) is not None:
        ctx.ui.progress(f"stopping the workers of {job} (they checkpoint and leave)")
        try:
            asg.update_auto_scaling_group(AutoScalingGroupName=workers, MinSize=0, DesiredCapacity=0)
        except Exception as e:  # noqa: BLE001 - the stack deletion below stops them anyway
            ctx.ui.warn(f"could not scale {workers} to zero ({describe_client_error(e)}); deleting the stack")
        drain = int(_stack_parameter(stack, "DrainTimeout") or DEFAULT_DRAIN_TIMEOUT)
        _wait_until(
            ctx,
            lambda: (
                not (describe_group(asg, workers) or {}).get("Instances")
                and not job_instances(ctx, job, "worker")
            ),
            drain + 120,
            "workers gone",
            sleep,
        )
    stacks.delete(naming.job_stack(job), timeout=timeout)
    _wait_until(ctx, lambda: not job_instances(ctx, job), 600, "instances terminated", sleep)
    delete_tls(ctx, job)
    result["deleted"] = True
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def delete_tls(ctx: Context, job: str) -> None:
    """The job's etcd keys are secrets nothing needs once its instances are gone."""
    from petctl import storage

    if not ctx.profile.bucket:
        return
    try:
        storage.delete_prefix(ctx.clients()("s3"), ctx.profile.bucket, naming.job_prefix(job) + "tls/")
    except Exception as e:  # noqa: BLE001 - the job is gone either way; say what is left
        ctx.ui.warn(
            f"could not delete s3://{ctx.profile.bucket}/{naming.job_prefix(job)}tls/ "
            f"({describe_client_error(e)}); delete it by hand"
        )


def job_instances(ctx: Context, job: str, role: str | None = None) -> list[str]:
    """EC2 instances of the job (of one ``petctl:role``, if given) that are not terminated yet."""
    ec2 = ctx.clients()("ec2")
    filters = [
        {"Name": "tag:petctl:job", "Values": [job]},
        *([{"Name": "tag:petctl:role", "Values": [role]}] if role else []),
        {
            "Name": "instance-state-name",
            "Values": ["pending", "running", "stopping", "stopped", "shutting-down"],
        },
    ]
    ids = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        ids += [i["InstanceId"] for r in page["Reservations"] for i in r["Instances"]]
    return ids


def _wait_until(
    ctx: Context, done: Callable[[], bool], timeout: float, what: str, sleep: Callable[[float], None]
) -> bool:
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    while not done():
        ctx.ui.live(f"waiting for {what} ({time.monotonic() - t0:.0f}s)")
        if time.monotonic() > deadline:
            ctx.ui.warn(f"still waiting for {what} after {timeout:.0f}s; going on")
            return False
        sleep(2)
    ctx.ui.progress(f"{what} ({time.monotonic() - t0:.0f}s)")
    return True


def _stack_parameter(stack: dict[str, Any], key: str) -> str | None:
    return {p["ParameterKey"]: p.get("ParameterValue") for p in stack.get("Parameters", []) or []}.get(key)


FINAL_STATES = ("SUCCEEDED", "FAILED", "GONE", "DELETING")


def wait_for_end(
    ctx: Context,
    job: str,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
    interval: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the job's status until it has ended (SUCCEEDED, FAILED, or its stack is gone)."""
    while True:
        try:
            st = status(ctx, job)
        except NotFound:
            return {"job": job, "state": "GONE"}
        if on_poll is not None:
            on_poll(st)
        if st["state"] in FINAL_STATES:
            return st
        sleep(interval)


def upload(ctx: Context, path: str, s3_url: str | None) -> dict[str, Any]:
    """Upload a file or directory (as-is, file by file) to S3, like the original tool."""
    from petctl import storage

    src = Path(path)
    if not src.exists():
        raise ConfigError(f"{path} does not exist")
    if s3_url is None:
        ctx.profile.require_ready()
        s3_url = f"s3://{ctx.profile.bucket}/petctl/uploads/{src.resolve().name}"
    bucket, key = parse_s3_url(s3_url)
    s3 = ctx.clients()("s3")
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    uploaded = []
    for f in files:
        k = (
            key
            if src.is_file() and not key.endswith("/")
            else f"{key.rstrip('/')}/{f.relative_to(src) if src.is_dir() else f.name}"
        )
        try:
            storage.put(s3, bucket, Upload(key=k, path=str(f)))
        except Exception as e:
            raise AwsError(f"upload of {f} to s3://{bucket}/{k} failed: {describe_client_error(e)}") from e
        uploaded.append(f"s3://{bucket}/{k}")
    return {"uploaded": uploaded, "count": len(uploaded)}


def plan_as_dict(p: Plan) -> dict[str, Any]:
    return {**p.summary(), "template": p.template}


def _warm_pool_text(size: int) -> str:
    if not size:
        return "none (a scale-up boots and installs from scratch)"
    return f"{size} stopped instance(s), pre-booted with the job's environment, taken first by a scale-up"


def plan_text(p: dict[str, Any], show_template: bool = False) -> str:
    """The short plan a dry run prints: what would be made, its sizes, image and costs."""
    par, spec = p["parameters"], p["spec"]
    gpu = is_gpu(par["InstanceType"])
    types = par.get("InstanceTypes", par["InstanceType"])
    workers = f"{spec['min_nodes']}-{spec['max_nodes']} x {types} (start {par['DesiredCapacity']})"
    if "OnDemandBaseCapacity" in par:
        workers += f"; spot above {par['OnDemandBaseCapacity']} on-demand (price-capacity-optimized)"
    else:
        workers += "; on-demand"
    image = (
        f"{par['ImageId']} (--ami)"
        if "ImageId" in par
        else "Deep Learning Base OSS Nvidia Driver AMI, Amazon Linux 2023 (from SSM at deploy)"
        if gpu
        else "Amazon Linux 2023 (from SSM at deploy)"
    )
    uploads = [f"  {u['s3_url']}  ({u['bytes']:,} bytes, from {u['from']})" for u in p["uploads"]]
    lines = [
        f"plan for job {p['job']} (stack {p['stack']}) -- nothing will be created",
        f"  workers:      {workers}",
        f"  image:        {image}; {'CUDA' if gpu else 'CPU'} torch {spec.get('torch_version')} on every node",
        f"  rendezvous:   etcd on 1 x {par.get('RdzvInstanceType', DEFAULT_RDZV_INSTANCE_TYPE)}",
        f"  elasticity:   drain timeout {spec['drain_timeout']} s, {spec.get('max_restarts')} restarts for "
        f"failures, {spec.get('join_timeout')} s to reach --min",
        f"  checkpoints:  EFS {par['EfsId']}:/{spec['checkpoint_dir']}",
        f"  warm pool:    {_warm_pool_text(int(par.get('WarmPoolSize', 0)))}",
        "  uploads:",
        *uploads,
    ]
    if show_template:
        lines += ["", "template:", p["template"]]
    else:
        lines.append("(--show-template prints the CloudFormation template)")
    return "\n".join(lines)
