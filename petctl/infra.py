"""The base stack: ``petctl setup``, ``petctl teardown``, ``petctl configure``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from petctl import config, naming
from petctl.context import Context
from petctl.errors import ConfigError, PetctlError
from petctl.gateway import Gateway
from petctl.gateway.stacks import outputs_of, parameters_of
from petctl.ui import cmd

# Base stack output → profile field. No instance profiles: each job stack makes its own roles.
OUTPUT_FIELDS = {
    "VpcId": "vpc_id",
    "SubnetIds": "subnet_ids",
    "InstanceSecurityGroupId": "security_group_id",
    "EfsId": "efs_id",
    "BucketName": "bucket",
    "LogGroupName": "log_group",
}
#: Outputs of base stacks made before the roles moved into the job stacks.
OLD_ROLE_OUTPUTS = ("WorkerInstanceProfileArn", "RdzvInstanceProfileArn")


def setup(
    ctx: Context,
    *,
    az_count: int = 2,
    vpc_cidr: str | None = None,
    efs_id: str | None = None,
    bucket: str | None = None,
    log_retention_days: int = 30,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Create or update the base stack and record its outputs in the profile."""
    from petctl import templates

    if efs_id:
        config.validate_id("efs_id", efs_id, "--efs-id")
    if bucket:
        config.validate_id("bucket", bucket, "--s3-bucket")
    if not 1 <= az_count <= 6:
        raise ConfigError(f"--az-count {az_count} is out of range: use 1 to 6")

    def check_cidr(cidr: str) -> str:
        try:
            templates.subnet_cidrs(cidr, az_count)
        except ValueError as e:
            raise ConfigError(f"--vpc-cidr: {e}") from None
        return cidr

    if vpc_cidr:
        check_cidr(vpc_cidr)
    gw = ctx.gateway()
    profile = ctx.profile
    vpc_cidr = check_cidr(vpc_cidr or profile.vpc_cidr or "10.0.0.0/16")
    gw.check_credentials()
    if efs_id:
        _check_file_system(gw, efs_id, az_count, profile.vpc_id)
    _check_az_count(gw, az_count)
    if bucket:
        gw.objects.require_bucket(bucket)
    kms_key = bucket_kms_key(gw, bucket) if bucket else None

    kept = [f for f in profile.retained_efs_ids if f != efs_id]
    if kept and not efs_id:
        ctx.ui.warn(
            f"EFS file system {kept[-1]}, kept by the last teardown, still holds this profile's "
            f"checkpoints; to train on from them, run `{cmd('setup --efs-id ' + kept[-1])}`"
        )
    name = naming.base_stack(ctx.profile_name)
    template = templates.render_infra(az_count=az_count, create_efs=not efs_id, create_bucket=not bucket)
    params = templates.infra_parameters(
        vpc_cidr=vpc_cidr,
        az_count=az_count,
        efs_id=efs_id,
        bucket=bucket,
        log_retention_days=log_retention_days,
        profile=ctx.profile_name,
    )
    _refuse_to_pull_roles_from_jobs(ctx, gw, name)
    result = gw.stacks.deploy(
        name,
        template,
        params,
        tags={"petctl:profile": ctx.profile_name, "petctl:user": ctx.user},
        timeout=timeout,
    )
    apply_outputs(profile, result.outputs)
    # Roles come from each job stack now: ARNs recorded from an older base stack (whose roles the
    # update above removed) must not be handed to new jobs.
    profile.worker_instance_profile_arn = None
    profile.rdzv_instance_profile_arn = None
    profile.region = gw.region
    profile.managed = True
    profile.stack_name = name
    profile.vpc_cidr = vpc_cidr
    profile.bucket_created = not bucket
    profile.bucket_kms_key_arn = kms_key
    path = config.save_profile(profile)
    return {
        "profile": profile.name,
        "stack": name,
        "action": result.action,
        "status": result.status,
        "region": profile.region,
        "outputs": result.outputs,
        "profile_path": str(path),
    }


def _refuse_to_pull_roles_from_jobs(ctx: Context, gw: Gateway, name: str) -> None:
    """Updating a base stack made before the job stacks had their own roles and security groups
    removes its instance profiles and its instances' self-ingress rule, which running jobs of that
    era use: refuse while any job of the profile exists (before any change)."""
    old = gw.stacks.describe(name)
    if old is None or not set(OLD_ROLE_OUTPUTS) & set(outputs_of(old)):
        return
    live = _job_names(gw, ctx.profile_name)
    if live:
        raise PetctlError(
            f"base stack {name} still gives its instance roles and network to job(s) {', '.join(live)}; "
            f"updating it would cut them off. Let them finish or `{cmd('kill-job')}` them, then run "
            f"`{cmd('setup')}` again"
        )


def apply_outputs(profile: config.Profile, outputs: dict[str, str]) -> None:
    for key, attr in OUTPUT_FIELDS.items():
        if key in outputs:
            value: Any = outputs[key]
            if attr == "subnet_ids":
                value = [s for s in value.split(",") if s]
            setattr(profile, attr, value)


def _check_file_system(gw: Gateway, efs_id: str, az_count: int, own_vpc: str | None) -> None:
    """Refuse, before any change, a file system the base stack could not mount (AWS would fail
    the stack half-way: ``MountTargetConflict``, or a One Zone file system outside its zone)."""
    zone = gw.file_systems.describe(efs_id).get("AvailabilityZoneName")
    if zone and az_count > 1:
        raise ConfigError(
            f"EFS file system {efs_id} is One Zone ({zone}) and cannot serve --az-count {az_count}: "
            f"use --az-count 1, or a Regional file system"
        )
    foreign = sorted(gw.file_systems.mount_target_vpcs(efs_id) - {own_vpc})
    if foreign:
        raise ConfigError(
            f"EFS file system {efs_id} has mount targets in {foreign[0]}, and a file system serves one VPC "
            f"at a time (MountTargetConflict): record that VPC's resources with `{cmd('configure')}`, "
            f"delete those mount targets, or use another file system"
        )


def _check_az_count(gw: Gateway, az_count: int) -> None:
    zones = gw.compute.zones()
    if az_count > len(zones):
        raise ConfigError(
            f"--az-count {az_count} is more than the {len(zones)} zones of {gw.region} "
            f"({', '.join(zones)}); use --az-count {len(zones)} or fewer"
        )


def bucket_kms_key(gw: Gateway, bucket: str) -> str | None:
    """The ARN of the customer KMS key an existing bucket encrypts with by default, else None.

    The job roles then get kms:Decrypt/GenerateDataKey on it (through S3 only); without that,
    every read of the code and write of a status fails on AWS with AccessDenied. AWS-managed
    keys (aws/s3) need no grant. A key petctl cannot even describe cannot work: refused.
    """
    key = gw.objects.default_kms_key(bucket)
    return gw.keys.customer_key_arn(key, bucket) if key else None


def _job_names(gw: Gateway, profile: str) -> list[str]:
    return [naming.job_from_stack(s["StackName"]) or s["StackName"] for s in gw.stacks.job_stacks(profile)]


@dataclass
class TeardownPlan:
    """What ``teardown`` would delete and keep, computed before anything is touched (so the
    confirmation can say it)."""

    profile: str
    stack: str
    stack_exists: bool
    jobs: list[str] = field(default_factory=list)
    bucket: str | None = None  # petctl's own bucket, emptied and deleted with the stack
    efs_id: str | None = None  # the stack's file system (created by petctl or given by the user)
    efs_created: bool = False  # petctl made it, so --delete-data may delete it
    retained: list[str] = field(default_factory=list)  # kept by earlier teardowns
    delete_data: bool = False

    @property
    def ours(self) -> list[str]:
        """File systems petctl made for this profile: what --delete-data deletes."""
        mine = [self.efs_id] if self.efs_id and self.efs_created else []
        return mine + [f for f in self.retained if f not in mine]

    @property
    def efs_to_delete(self) -> list[str]:
        return self.ours if self.delete_data else []

    def describe(self) -> str:
        parts = []
        if self.jobs:
            parts.append(f"job(s) {', '.join(self.jobs)} with their instances")
        if self.stack_exists:
            parts.append(f"base stack {self.stack} (VPC, subnets, security groups, IAM roles, log group)")
        if self.bucket:
            parts.append(f"bucket {self.bucket} and every object in it")
        for fs in self.efs_to_delete:
            parts.append(f"EFS file system {fs} with every checkpoint on it")
        return "delete " + "; ".join(parts) if parts else "nothing to delete"

    def kept(self) -> str | None:
        keep = [
            f for f in ([self.efs_id] if self.efs_id else []) + self.retained if f not in self.efs_to_delete
        ]
        if not keep:
            return None
        why = "it was given with --efs-id" if self.efs_id in keep and not self.efs_created else None
        why = why or "pass --delete-data to delete it"
        return (
            f"kept: EFS file system {', '.join(keep)} with your checkpoints ({why}); reuse it with "
            f"`{cmd('setup --efs-id ' + keep[0])}`"
        )


def plan_teardown(ctx: Context, *, force: bool = False, delete_data: bool = False) -> TeardownPlan:
    """Find what teardown would remove; refuse (before any change) while jobs exist, unless ``force``."""
    profile = ctx.profile
    gw = ctx.gateway()
    live_jobs = _job_names(gw, ctx.profile_name)
    if live_jobs and not force:
        raise PetctlError(
            f"profile {profile.name!r} still has jobs ({', '.join(live_jobs)}); kill them with "
            f"`{cmd('kill-job')}` or pass --force to delete them first"
        )
    name = profile.stack_name or naming.base_stack(ctx.profile_name)
    stack = gw.stacks.describe(name)
    plan = TeardownPlan(profile=profile.name, stack=name, stack_exists=stack is not None, jobs=live_jobs)
    plan.delete_data = delete_data
    plan.retained = list(profile.retained_efs_ids)
    if stack is not None:
        out = outputs_of(stack)
        if profile.bucket_created is not False:
            plan.bucket = out.get("BucketName")
        plan.efs_id = out.get("EfsId") or profile.efs_id
        plan.efs_created = not parameters_of(stack).get("ExistingEfsId")
    return plan


def teardown(ctx: Context, plan: TeardownPlan, *, timeout: float = 1800) -> dict[str, Any]:
    """Carry out a :class:`TeardownPlan`: jobs first, then the base stack, then (only with
    ``delete_data``) the file system, which the stack itself always retains."""
    from petctl import jobs

    profile = ctx.profile
    gw = ctx.gateway()
    removed: list[str] = []
    for job in plan.jobs:
        jobs.kill_job(ctx, job, timeout=timeout)
        removed.append(naming.job_stack(job))
    emptied = 0
    if plan.stack_exists:
        if plan.bucket:
            emptied = gw.objects.empty_bucket(plan.bucket)
            if emptied:
                ctx.ui.progress(f"emptied bucket {plan.bucket} ({emptied} objects)")
        gw.stacks.delete(plan.stack, timeout=timeout)
        removed.append(plan.stack)
        left = sweep_stack_leftovers(gw, plan.stack, ctx)
    else:
        left = []
        ctx.ui.progress(f"base stack {plan.stack} does not exist; nothing to delete")
    deleted_efs = []
    for fs in plan.efs_to_delete:
        delete_file_system(ctx, fs)
        deleted_efs.append(fs)
    for attr in list(OUTPUT_FIELDS.values()):
        setattr(profile, attr, [] if attr == "subnet_ids" else None)
    profile.managed = False
    profile.stack_name = None
    profile.worker_instance_profile_arn = profile.rdzv_instance_profile_arn = None
    profile.retained_efs_ids = [f for f in plan.ours if f not in deleted_efs]
    config.save_profile(profile)
    return {
        "profile": profile.name,
        "removed_stacks": removed,
        "objects_deleted": emptied,
        "efs_deleted": deleted_efs,
        "efs_kept": [
            f for f in ([plan.efs_id] if plan.efs_id else []) + plan.retained if f not in deleted_efs
        ],
        "kept": plan.kept(),
        "left_behind": left,
    }


def sweep_stack_leftovers(gw: Gateway, stack: str, ctx: Context) -> list[str]:
    """Network resources the deleted base stack left behind, removed; what still remains, listed.

    CloudFormation on AWS leaves nothing. An emulator can (moto fails to delete a VPC that
    still has its route table and reports DependencyViolation after dropping the stack). Only
    resources tagged as this stack's (``aws:cloudformation:stack-name``) are touched.
    """
    left = gw.compute.sweep_stack_leftovers(stack)
    if left:
        ctx.ui.warn(f"left behind after deleting {stack}: {', '.join(left)}; delete them in the EC2 console")
    else:
        ctx.ui.progress(f"nothing of {stack} is left behind")
    return left


def delete_file_system(ctx: Context, efs_id: str) -> None:
    ctx.ui.progress(f"deleting EFS file system {efs_id} and every checkpoint on it")
    ctx.gateway().file_systems.delete(efs_id)
    if ctx.local:
        import shutil

        from petctl import local as local_cloud

        shutil.rmtree(local_cloud.state_dir() / "efs" / efs_id, ignore_errors=True)


def configure(ctx: Context, values: dict[str, Any]) -> dict[str, Any]:
    """Record existing resources in the profile after validating each value."""
    profile = ctx.profile
    for key, value in values.items():
        if value in (None, "", []):
            continue
        setattr(profile, key, config.validate_field(key, value))
    if not profile.log_group:
        profile.log_group = naming.log_group(profile.name)
    path = config.save_profile(profile)
    data = profile.to_dict()
    data["profile_path"] = str(path)
    data["missing_for_jobs"] = profile.missing_for_jobs()
    return data
