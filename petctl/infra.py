"""The base stack: ``petctl setup``, ``petctl teardown``, ``petctl configure``."""

from __future__ import annotations

from typing import Any

from petctl import config, naming
from petctl.aws import ClientError
from petctl.context import Context
from petctl.errors import AwsError, ConfigError, PetctlError, describe_client_error

# Base stack output → profile field.
OUTPUT_FIELDS = {
    "VpcId": "vpc_id",
    "SubnetIds": "subnet_ids",
    "InstanceSecurityGroupId": "security_group_id",
    "EfsId": "efs_id",
    "BucketName": "bucket",
    "WorkerInstanceProfileArn": "worker_instance_profile_arn",
    "RdzvInstanceProfileArn": "rdzv_instance_profile_arn",
    "LogGroupName": "log_group",
}


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
    from petctl.stacks import Stacks

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
    clients = ctx.clients()
    profile = ctx.profile
    vpc_cidr = check_cidr(vpc_cidr or profile.vpc_cidr or "10.0.0.0/16")
    clients.check_credentials()
    if efs_id:
        _check_exists(
            lambda: clients("efs").describe_file_systems(FileSystemId=efs_id), f"EFS file system {efs_id}"
        )
    if bucket:
        _check_exists(lambda: clients("s3").head_bucket(Bucket=bucket), f"S3 bucket {bucket}")

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
    stacks = Stacks(clients("cloudformation"), ctx.ui)
    result = stacks.deploy(
        name,
        template,
        params,
        tags={"petctl:profile": ctx.profile_name, "petctl:user": ctx.user},
        timeout=timeout,
    )
    apply_outputs(profile, result.outputs)
    profile.region = clients.region
    profile.managed = True
    profile.stack_name = name
    profile.vpc_cidr = vpc_cidr
    profile.bucket_created = not bucket
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


def apply_outputs(profile: config.Profile, outputs: dict[str, str]) -> None:
    for key, attr in OUTPUT_FIELDS.items():
        if key in outputs:
            value: Any = outputs[key]
            if attr == "subnet_ids":
                value = [s for s in value.split(",") if s]
            setattr(profile, attr, value)


def _check_exists(call: Any, what: str) -> None:
    try:
        call()
    except ClientError as e:
        raise PetctlError(f"{what} was not found or is not accessible ({describe_client_error(e)})") from e


def teardown(ctx: Context, *, force: bool = False, timeout: float = 1800) -> dict[str, Any]:
    """Delete the base stack (and, with ``force``, the profile's job stacks first)."""
    from petctl import jobs
    from petctl.stacks import Stacks

    profile = ctx.profile
    clients = ctx.clients()
    stacks = Stacks(clients("cloudformation"), ctx.ui)
    live_jobs = jobs.job_stacks(ctx, stacks)
    removed: list[str] = []
    if live_jobs:
        names = ", ".join(naming.job_from_stack(s["StackName"]) or s["StackName"] for s in live_jobs)
        if not force:
            raise PetctlError(
                f"profile {profile.name!r} still has jobs ({names}); kill them with `petctl kill_job` "
                f"or pass --force to delete them first"
            )
        for s in live_jobs:
            job = naming.job_from_stack(s["StackName"]) or s["StackName"]
            jobs.kill_job(ctx, job, stacks=stacks, timeout=timeout)
            removed.append(s["StackName"])
    name = profile.stack_name or naming.base_stack(ctx.profile_name)
    stack = stacks.describe(name)
    emptied = 0
    if stack is None:
        ctx.ui.progress(f"base stack {name} does not exist; nothing to delete")
    else:
        bucket = _stack_outputs(stack).get("BucketName")
        if bucket and profile.bucket_created is not False:
            emptied = empty_bucket(clients("s3"), bucket, ctx)
        stacks.delete(name, timeout=timeout)
        removed.append(name)
    for attr in list(OUTPUT_FIELDS.values()):
        setattr(profile, attr, [] if attr == "subnet_ids" else None)
    profile.managed = False
    profile.stack_name = None
    config.save_profile(profile)
    return {"profile": profile.name, "removed_stacks": removed, "objects_deleted": emptied}


def _stack_outputs(stack: dict[str, Any]) -> dict[str, str]:
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", []) or []}


def empty_bucket(s3: Any, bucket: str, ctx: Context) -> int:
    """Delete every object (and version) so CloudFormation can delete the bucket."""
    count = 0
    try:
        paginator = s3.get_paginator("list_object_versions")
        for page in paginator.paginate(Bucket=bucket):
            batch = [
                {"Key": o["Key"], "VersionId": o["VersionId"]}
                for o in page.get("Versions", []) + page.get("DeleteMarkers", [])
            ]
            for i in range(0, len(batch), 1000):
                s3.delete_objects(Bucket=bucket, Delete={"Objects": batch[i : i + 1000], "Quiet": True})
                count += len(batch[i : i + 1000])
    except ClientError as e:
        if "NoSuchBucket" in describe_client_error(e):
            return count
        raise AwsError(f"cannot empty bucket {bucket} ({describe_client_error(e)})") from e
    if count:
        ctx.ui.progress(f"emptied bucket {bucket} ({count} objects)")
    return count


def configure(ctx: Context, values: dict[str, Any]) -> dict[str, Any]:
    """Record existing resources in the profile after validating each value."""
    profile = ctx.profile
    checks = {
        "region": "region",
        "vpc_id": "vpc_id",
        "security_group_id": "security_group_id",
        "efs_id": "efs_id",
        "bucket": "bucket",
        "worker_instance_profile_arn": "instance_profile_arn",
        "rdzv_instance_profile_arn": "instance_profile_arn",
    }
    for key, value in values.items():
        if value in (None, "", []):
            continue
        if key == "subnet_ids":
            ids = [s.strip() for s in (value if isinstance(value, list) else value.split(",")) if s.strip()]
            for s in ids:
                config.validate_id("subnet_id", s, "--subnet-ids")
            value = ids
        elif key in checks:
            config.validate_id(checks[key], value, "--" + key.replace("_", "-"))
        setattr(profile, key, value)
    if not profile.log_group:
        profile.log_group = naming.log_group(profile.name)
    path = config.save_profile(profile)
    data = profile.to_dict()
    data["profile_path"] = str(path)
    data["missing_for_jobs"] = profile.missing_for_jobs()
    return data
