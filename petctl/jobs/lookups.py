"""What a plan needs from AWS, looked up before it is made (the plan itself makes no call)."""

from __future__ import annotations

from petctl import config
from petctl.context import Context
from petctl.errors import ConfigError, PetctlError, describe_client_error
from petctl.jobs.request import JobRequest
from petctl.storage import parse_s3_url
from petctl.ui import cmd


def resolve_ami(ctx: Context, req: JobRequest) -> None:
    """Check that ``--ami`` exists in the region and record its root device name."""
    if req.ami is not None:
        req.root_device_name = ctx.gateway().compute.image(req.ami).get("RootDeviceName") or None


def resolve_vpc(ctx: Context) -> None:
    """Record the VPC of the profile's first subnet when the profile has none (profiles made by
    ``configure`` without ``--vpc-id``): the job's security groups are made in it. ``setup``
    profiles always have it. Saved, so the lookup happens once."""
    profile = ctx.profile
    if profile.vpc_id or not profile.subnet_ids:
        return
    subnet = profile.subnet_ids[0]
    try:
        vpc = ctx.gateway().compute.subnet_vpc(subnet)
    except Exception as e:  # noqa: BLE001 - InvalidSubnetID.NotFound, no access
        raise ConfigError(
            f"cannot find the VPC of subnet {subnet} ({describe_client_error(e)}); check the profile's "
            f"subnets with `{cmd('configure --show')}`"
        ) from e
    if vpc is None:
        raise ConfigError(f"subnet {subnet} of profile {profile.name!r} was not found in {ctx.region}")
    profile.vpc_id = vpc
    config.save_profile(profile)


def check_code_url(ctx: Context, req: JobRequest) -> None:
    """Refuse an ``s3://`` target that does not exist; warn when it lies where the worker role
    cannot read it. Runs before anything is created."""
    if not req.target.startswith("s3://"):
        return
    bucket, key = parse_s3_url(req.target)
    try:
        found = ctx.gateway().objects.exists(bucket, key)
    except PetctlError as e:
        ctx.ui.warn(
            f"could not check {req.target} ({e.format_message()}); the instances may not be able to read it"
        )
        found = True
    if not found:
        raise ConfigError(
            f"{req.target} does not exist; upload it first (`{cmd('upload FILE ' + req.target)}`)"
        )
    if bucket != ctx.profile.bucket or not key.startswith("petctl/uploads/"):
        ctx.ui.warn(
            f"{req.target} is outside s3://{ctx.profile.bucket}/petctl/uploads/, which is all a job's role "
            f"may read besides its own prefix; copy it there (`{cmd('upload FILE')}`) or grant the role access"
        )
