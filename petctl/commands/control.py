"""Acting on jobs: scale, kill-job, upload, and the local cloud's demo."""

from __future__ import annotations

import click

from petctl import naming, render
from petctl.commands import common
from petctl.commands.common import job_argument, pass_ctx, yes_option
from petctl.context import Context
from petctl.errors import PetctlError


@click.command()
@job_argument
@click.option("--size", type=int, required=True, help="New number of worker nodes.")
@pass_ctx
def scale(obj: Context, job: str, size: int) -> None:
    """Set the number of worker nodes of JOB."""
    from petctl import jobs

    obj.ui.result(jobs.scale(obj.gateway(), obj.profile_name, job, size).to_dict(), render.scaled_text)


@click.command("kill-job")
@job_argument
@yes_option
@click.option("--no-wait", is_flag=True, help="Start the deletion and return at once.")
@click.option(
    "--delete-checkpoints",
    is_flag=True,
    help="Also delete the job's directory on EFS (checkpoints, work files), through its own access point.",
)
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for the deletion.")
@pass_ctx
def kill_job(
    obj: Context, job: str, yes: bool, no_wait: bool, delete_checkpoints: bool, timeout: int
) -> None:
    """Stop JOB's workers, then delete its stack (rendezvous server, groups) and its S3 files.
    Checkpoints (EFS) and worker logs (CloudWatch Logs) are kept unless --delete-checkpoints."""
    from petctl import jobs

    if jobs.find_job(obj.gateway(), obj.profile_name, job) is not None:
        efs = obj.profile.efs_id or "the profile's EFS"
        if delete_checkpoints:
            data = f"everything in /petctl/jobs/{job} on {efs} (checkpoints, work files; no other job's); "
            kept = "its worker logs are kept"
        else:
            data = ""
            kept = f"its checkpoints on {efs} at /{naming.checkpoint_dir(job)} and its worker logs are kept"
        common.confirm(
            yes,
            f"delete job {job} (stack {naming.job_stack(job)}, its instances and rendezvous server, "
            f"s3://{obj.profile.bucket}/{naming.job_prefix(job)}: code, status, boot logs); {data}{kept}",
            "kill-job",
        )
    killed = jobs.kill_job(obj, job, timeout=timeout, wait=not no_wait, delete_checkpoints=delete_checkpoints)
    obj.ui.result(killed.to_dict(), render.killed_text)


@click.command()
@click.argument("path")
@click.argument("s3_url", required=False)
@pass_ctx
def upload(obj: Context, path: str, s3_url: str | None) -> None:
    """Upload PATH (file or directory) to S3_URL [default: the profile bucket]."""
    from petctl import jobs

    uploaded = jobs.upload(obj, path, s3_url)
    obj.ui.result({"uploaded": uploaded, "count": len(uploaded)}, render.uploaded_text)


@click.command("demo")
@click.option("--total-steps", default=800, show_default=True, help="Training steps of the example job.")
@click.option(
    "--step-time", default=0.1, show_default=True, help="Extra seconds per step (pace it to watch)."
)
@click.option("--timeout", default=300, show_default=True, help="Seconds allowed for each stage.")
@click.option("--keep", is_flag=True, help="Leave the job and the local cloud running afterwards.")
def demo(total_steps: int, step_time: float, timeout: int, keep: bool) -> None:
    """Run the example elastic job: train, scale up, drain, lose a node, finish."""
    from petctl import local as local_cloud
    from petctl.local.demo import Demo

    d = Demo(total_steps=total_steps, step_time=step_time, timeout=timeout)
    st = d.run(keep=keep)
    if not keep:
        local_cloud.stop()
        d.say("local cloud stopped")
    if st["state"] != "SUCCEEDED":
        raise PetctlError(f"the demo job ended {st['state']}")
