"""``petctl teardown``: a :class:`TeardownPlan` says what would be deleted and kept (the
confirmation shows it), then :func:`teardown` carries it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from petctl import config, naming
from petctl.context import Context
from petctl.errors import PetctlError
from petctl.gateway import Gateway
from petctl.gateway.stacks import outputs_of, parameters_of
from petctl.infra.setup import OUTPUT_FIELDS, job_names
from petctl.ui import cmd


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
    live_jobs = job_names(gw, ctx.profile_name)
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
