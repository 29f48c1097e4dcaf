"""``petctl setup``: check what the user gives, then create or update the base stack and record
its outputs in the profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from petctl import config, naming
from petctl.context import Context
from petctl.errors import ConfigError, PetctlError
from petctl.gateway import Gateway
from petctl.gateway.stacks import outputs_of, parameters_of
from petctl.infra import etcd_copy
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
#: The job stack resource (cfn_templates/job.yaml.j2) through which a job's workers mount the file
#: system; job stacks made before it mount the root.
JOB_ACCESS_POINT = "JobAccessPoint"


@dataclass
class SetupPlan:
    """The base stack ``setup`` would create or update, as plain data."""

    stack: str
    template: str
    parameters: list[dict[str, str]]
    tags: dict[str, str]
    vpc_cidr: str
    bucket_given: bool


def validate(
    *,
    az_count: int,
    vpc_cidr: str | None,
    efs_id: str | None,
    bucket: str | None,
    efs_apply_policy: bool = False,
    efs_backup: bool | None = None,
) -> None:
    """Check the flags before anything is read from AWS."""
    if efs_id:
        config.validate_id("efs_id", efs_id, "--efs-id")
        if efs_backup is not None:
            raise ConfigError(
                f"--efs-backup/--no-efs-backup apply to the file system petctl creates; {efs_id}'s backups "
                f"are its owner's setting (aws efs put-backup-policy --file-system-id {efs_id} "
                "--backup-policy Status=ENABLED)"
            )
    elif efs_apply_policy:
        raise ConfigError(
            "--efs-apply-policy goes with --efs-id: the file system petctl creates has petctl's policy already"
        )
    if bucket:
        config.validate_id("bucket", bucket, "--s3-bucket")
    if not 1 <= az_count <= 6:
        raise ConfigError(f"--az-count {az_count} is out of range: use 1 to 6")
    if vpc_cidr:
        _check_cidr(vpc_cidr, az_count)


def _check_cidr(cidr: str, az_count: int) -> str:
    from petctl import templates

    try:
        templates.subnet_cidrs(cidr, az_count)
    except ValueError as e:
        raise ConfigError(f"--vpc-cidr: {e}") from None
    return cidr


def plan_setup(
    profile: config.Profile,
    user: str,
    *,
    az_count: int,
    vpc_cidr: str | None,
    efs_id: str | None,
    bucket: str | None,
    log_retention_days: int,
    efs_backup: bool = False,
) -> SetupPlan:
    """The base stack of ``profile``: pure (no AWS call)."""
    from petctl import templates

    cidr = _check_cidr(vpc_cidr or profile.vpc_cidr or "10.0.0.0/16", az_count)
    template = templates.render_infra(az_count=az_count, create_efs=not efs_id, create_bucket=not bucket)
    params = templates.infra_parameters(
        vpc_cidr=cidr,
        az_count=az_count,
        efs_id=efs_id,
        bucket=bucket,
        log_retention_days=log_retention_days,
        profile=profile.name,
        efs_backup=efs_backup,
    )
    tags = {"petctl:profile": profile.name, "petctl:user": user}
    return SetupPlan(naming.base_stack(profile.name), template, params, tags, cidr, bool(bucket))


def setup(
    ctx: Context,
    *,
    az_count: int = 2,
    vpc_cidr: str | None = None,
    efs_id: str | None = None,
    bucket: str | None = None,
    log_retention_days: int = 30,
    timeout: float = 1800,
    efs_apply_policy: bool = False,
    efs_backup: bool | None = None,
) -> dict[str, Any]:
    """Create or update the base stack and record its outputs in the profile.

    ``efs_apply_policy``: a given file system (``efs_id``) open to mounts without an access point
    gets petctl's Deny statements added to its policy; without it, such a file system is refused.
    ``efs_backup``: AWS Backup for the file system petctl creates; None keeps the stack's setting.
    """
    validate(
        az_count=az_count,
        vpc_cidr=vpc_cidr,
        efs_id=efs_id,
        bucket=bucket,
        efs_apply_policy=efs_apply_policy,
        efs_backup=efs_backup,
    )
    gw = ctx.gateway()
    profile = ctx.profile
    gw.check_credentials()
    if efs_backup is None and not efs_id:
        old = gw.stacks.describe(naming.base_stack(profile.name))
        efs_backup = bool(old) and parameters_of(old).get("EfsBackup") == "ENABLED"
    plan = plan_setup(
        profile,
        ctx.user,
        az_count=az_count,
        vpc_cidr=vpc_cidr,
        efs_id=efs_id,
        bucket=bucket,
        log_retention_days=log_retention_days,
        efs_backup=bool(efs_backup),
    )
    fix = None
    if efs_id:
        fs = _check_file_system(gw, efs_id, az_count, profile.vpc_id)
        fix = _refuse_an_open_file_system(gw, efs_id, fs["FileSystemArn"], efs_apply_policy)
    _check_az_count(gw, az_count)
    if bucket:
        gw.objects.require_bucket(bucket, gw.region)
    kms_key = bucket_kms_key(gw, bucket) if bucket else None
    kept = [f for f in profile.retained_efs_ids if f != efs_id]
    if kept and not efs_id:
        ctx.ui.warn(
            f"EFS file system {kept[-1]}, kept by the last teardown, still holds this profile's "
            f"checkpoints; to train on from them, run `{cmd('setup --efs-id ' + kept[-1])}`"
        )
    _refuse_to_pull_roles_from_jobs(ctx, gw, plan.stack)
    if not efs_id or fix:
        _refuse_to_lock_out_root_mounts(ctx, gw)
    if fix:
        # The last check passed: only now change the user's file system, then the stack.
        gw.file_systems.put_policy(efs_id, fix)
        ctx.ui.progress(f"EFS file system {efs_id}: petctl's statements added to its file system policy")
    result = apply_setup(ctx, plan, kms_key, timeout)
    result["efs_policy"] = "applied" if fix else ("checked" if efs_id else "petctl")
    if profile.bucket:
        result["etcd_copies"] = etcd_copy.copy_release(ctx, profile.bucket, kms_key)
    return result


def _refuse_an_open_file_system(
    gw: Gateway, efs_id: str, fs_arn: str, apply_policy: bool
) -> dict[str, Any] | None:
    """None when ``efs_id``'s policy keeps each job in its own directory; the policy to put when it
    does not and ``apply_policy`` asks for it; else refused (before any change)."""
    from petctl.infra import efs_policy

    current = gw.file_systems.policy(efs_id)
    why = efs_policy.open_to_root_mounts(current, fs_arn)
    if why is None:
        return None
    if not apply_policy:
        raise ConfigError(
            f"EFS file system {efs_id} {why}, and every job could read and rewrite every other job's "
            f"checkpoints: add petctl's Deny statements with `{cmd('setup --efs-id ' + efs_id + ' --efs-apply-policy')}`, "
            "or set such a policy yourself (docs/contracts.md, Shared file system)"
        )
    merged = efs_policy.merged_policy(current)
    still = efs_policy.open_to_root_mounts(merged, fs_arn)
    if still:
        raise ConfigError(
            f"EFS file system {efs_id} {still}; petctl adds Deny statements but never removes yours: "
            "remove that statement, then run setup again"
        )
    return merged


def apply_setup(ctx: Context, plan: SetupPlan, kms_key: str | None, timeout: float) -> dict[str, Any]:
    """Deploy the base stack and record its outputs (and the bucket's key) in the profile."""
    gw = ctx.gateway()
    profile = ctx.profile
    result = gw.stacks.deploy(plan.stack, plan.template, plan.parameters, tags=plan.tags, timeout=timeout)
    apply_outputs(profile, result.outputs)
    # Roles come from each job stack now: ARNs recorded from an older base stack (whose roles the
    # update above removed) must not be handed to new jobs.
    profile.worker_instance_profile_arn = None
    profile.rdzv_instance_profile_arn = None
    profile.region = gw.region
    profile.managed = True
    profile.stack_name = plan.stack
    profile.vpc_cidr = plan.vpc_cidr
    profile.bucket_created = not plan.bucket_given
    profile.bucket_kms_key_arn = kms_key
    path = config.save_profile(profile)
    return {
        "profile": profile.name,
        "stack": plan.stack,
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
    live = job_names(gw, ctx.profile_name)
    if live:
        raise PetctlError(
            f"base stack {name} still gives its instance roles and network to job(s) {', '.join(live)}; "
            f"updating it would cut them off. Let them finish or `{cmd('kill-job')}` them, then run "
            f"`{cmd('setup')}` again"
        )


def _refuse_to_lock_out_root_mounts(ctx: Context, gw: Gateway) -> None:
    """Jobs started by a petctl before the per-job access points mount the file system's root
    (``fs:/``, no access point, no ``iam``). The file system policy the base stack now sets denies
    such mounts, so every replacement, reboot and warm-pool start of those jobs would fail to
    mount (three failed boots stop a job): refuse while any of them exists (before any change)."""
    old = [
        naming.job_from_stack(s["StackName"]) or s["StackName"]
        for s in gw.stacks.job_stacks(ctx.profile_name)
        if JOB_ACCESS_POINT not in gw.stacks.resource_ids(s["StackName"])
    ]
    if old:
        raise PetctlError(
            f"job(s) {', '.join(old)} mount the file system without an access point (started by an "
            f"earlier petctl), and the file system policy this setup adds would refuse their remounts "
            f"and replacements. Let them finish or `{cmd('kill-job')}` them, then run "
            f"`{cmd('setup')}` again"
        )


def apply_outputs(profile: config.Profile, outputs: dict[str, str]) -> None:
    for key, attr in OUTPUT_FIELDS.items():
        if key in outputs:
            value: Any = outputs[key]
            if attr == "subnet_ids":
                value = [s for s in value.split(",") if s]
            setattr(profile, attr, value)


def _check_file_system(gw: Gateway, efs_id: str, az_count: int, own_vpc: str | None) -> dict[str, Any]:
    """Refuse, before any change, a file system the base stack could not mount (AWS would fail
    the stack half-way: ``MountTargetConflict``, or a One Zone file system outside its zone).
    Returns its description."""
    fs = gw.file_systems.describe(efs_id)
    zone = fs.get("AvailabilityZoneName")
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
    return fs


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


def job_names(gw: Gateway, profile: str) -> list[str]:
    return [naming.job_from_stack(s["StackName"]) or s["StackName"] for s in gw.stacks.job_stacks(profile)]
