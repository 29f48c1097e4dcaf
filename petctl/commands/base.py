"""The base infrastructure and the profiles: setup, teardown, configure, profiles."""

from __future__ import annotations

from typing import Any

import click

from petctl import config, render
from petctl.commands import common
from petctl.commands.common import pass_ctx, yes_option
from petctl.context import Context
from petctl.errors import ConfigError


@click.command()
@click.option(
    "--az-count", default=2, show_default=True, help="Number of availability zones (one public subnet each)."
)
@click.option("--vpc-cidr", default=None, help="VPC CIDR block [default: profile, else 10.0.0.0/16].")
@click.option("--efs-id", default=None, help="Use this existing EFS file system instead of creating one.")
@click.option(
    "--efs-apply-policy",
    is_flag=True,
    help="With --efs-id: add petctl's Deny statements to a file system policy that allows mounts "
    "without an access point (refused otherwise).",
)
@click.option(
    "--efs-backup/--no-efs-backup",
    default=None,
    help="AWS Backup's daily backups of the file system petctl creates [default: as before, else off].",
)
@click.option("--s3-bucket", default=None, help="Use this existing S3 bucket instead of creating one.")
@click.option(
    "--log-retention-days",
    default=30,
    show_default=True,
    type=click.Choice([str(d) for d in (1, 3, 5, 7, 14, 30, 60, 90, 180, 365)]),
    help="CloudWatch Logs retention.",
)
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for the stack.")
@pass_ctx
def setup(
    obj: Context,
    az_count: int,
    vpc_cidr: str | None,
    efs_id: str | None,
    efs_apply_policy: bool,
    efs_backup: bool | None,
    s3_bucket: str | None,
    log_retention_days: str,
    timeout: int,
) -> None:
    """Create or update the base stack: VPC, subnets, security groups, EFS, S3, IAM, logs."""
    from petctl import infra

    result = infra.setup(
        obj,
        az_count=az_count,
        vpc_cidr=vpc_cidr,
        efs_id=efs_id,
        bucket=s3_bucket,
        log_retention_days=int(log_retention_days),
        timeout=timeout,
        efs_apply_policy=efs_apply_policy,
        efs_backup=efs_backup,
    )
    obj.ui.result(result, render.setup_text)


@click.command()
@click.option("--force", is_flag=True, help="Delete the profile's jobs first instead of refusing.")
@click.option(
    "--delete-data",
    is_flag=True,
    help="Also delete the EFS file system petctl created, with every checkpoint (kept by default).",
)
@yes_option
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for each stack.")
@pass_ctx
def teardown(obj: Context, force: bool, delete_data: bool, yes: bool, timeout: int) -> None:
    """Delete the base stack (refuses while jobs exist, unless --force). Checkpoints are kept."""
    from petctl import infra

    config.load_profile(obj.profile_name, must_exist=True)
    plan = infra.plan_teardown(obj, force=force, delete_data=delete_data)
    if plan.stack_exists or plan.jobs or plan.efs_to_delete:
        kept = plan.kept()
        common.confirm(yes, plan.describe() + (f" ({kept})" if kept else ""), "teardown")
    result = infra.teardown(obj, plan, timeout=timeout)
    obj.ui.result(result, render.teardown_text)


@click.command()
@click.option("--region", "region_opt", default=None, help="AWS region of the resources.")
@click.option("--vpc-id", default=None, help="VPC of the subnets (looked up from them when not given).")
@click.option("--subnet-ids", default=None, help="Comma-separated subnet ids.")
@click.option("--security-group-id", default=None, help="Security group of the instances.")
@click.option("--efs-id", default=None, help="EFS file system id.")
@click.option("--s3-bucket", "bucket", default=None, help="S3 bucket.")
@click.option("--worker-instance-profile-arn", default=None, help="Instance profile of the workers.")
@click.option("--rdzv-instance-profile-arn", default=None, help="Instance profile of the rendezvous server.")
@click.option("--show", is_flag=True, help="Only print the profile.")
@pass_ctx
def configure(obj: Context, region_opt: str | None, show: bool, **values: Any) -> None:
    """Record existing resources in the profile (flags, or prompts on a terminal)."""
    from petctl import infra

    values["region"] = region_opt or obj.region_flag
    if show:
        obj.ui.result(config.load_profile(obj.profile_name, must_exist=True).to_dict())
        return
    if not any(values.values()):
        if not common.stdin_is_terminal():
            raise ConfigError(
                "no values given: pass flags like --subnet-ids, or run on a terminal to be prompted"
            )
        current = obj.profile
        for key in config.Profile.REQUIRED_FOR_JOBS:
            default = getattr(current, key)
            if key == "region":  # as aws-cli: AWS_REGION, AWS_DEFAULT_REGION, then ~/.aws/config
                default = config.resolve_region(None, current) or _aws_config_region()
            if isinstance(default, list):
                default = ",".join(default)
            values[key] = click.prompt(
                key.replace("_", " "),
                default=default or "",
                show_default=bool(default),
                value_proc=lambda v, k=key: _checked_answer(k, v),
            )
    result = infra.configure(obj, values)
    obj.ui.result(result, render.configure_text)


@click.command()
@pass_ctx
def profiles(obj: Context) -> None:
    """List the profiles on this machine."""
    rows = []
    for name in config.list_profiles():
        p = config.load_profile(name)
        rows.append(
            {"profile": name, "region": p.region, "stack": p.stack_name, "ready": not p.missing_for_jobs()}
        )
    obj.ui.result(rows, render.profiles_table)


def _checked_answer(key: str, value: str) -> Any:
    """A prompt answer validated as it is typed: click asks again on a bad one."""
    if not value:
        return None
    try:
        return config.validate_field(key, value)
    except ConfigError as e:
        raise click.UsageError(e.format_message()) from None


def _aws_config_region() -> str | None:
    from petctl.gateway.session import default_region

    return default_region()
