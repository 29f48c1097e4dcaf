"""``run-job``: plan a job (``--dry-run`` prints the plan), apply it, and with ``--wait`` or
``--follow`` stay with it until it ends."""

from __future__ import annotations

import time
from typing import Any

import click

from petctl import naming, render
from petctl.commands.common import pass_ctx
from petctl.context import Context
from petctl.errors import ConfigError, Interrupted, PetctlError
from petctl.ui import cmd


class RunJobCommand(click.Command):
    """``run-job [OPTIONS] TARGET -- [SCRIPT ARGS]``: everything after ``--`` belongs to the
    training script, so an option of the script can never be taken for one of petctl's."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return super().collect_usage_pieces(ctx) + ["[-- ARGS...]"]

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        script_args: list[str] = []
        if "--" in args:
            cut = args.index("--")
            args, script_args = args[:cut], args[cut + 1 :]
        try:
            rest = super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            raise click.UsageError(
                f"{e.format_message().rstrip('.')}; the training script's arguments go after --: "
                f"{cmd('run-job [OPTIONS] TARGET -- ' + e.option_name + ' ...')}",
                ctx,
            ) from None
        except click.UsageError as e:
            if "unexpected extra argument" not in e.format_message():
                raise
            raise click.UsageError(
                f"{e.format_message().rstrip('.')}; the training script's arguments go after --: "
                f"{cmd('run-job [OPTIONS] TARGET -- ARGS...')}",
                ctx,
            ) from None
        ctx.params["args"] = tuple(script_args)
        return rest


@click.command("run-job", cls=RunJobCommand)
@click.option("--name", default=None, help="Job name [default: script name + short suffix].")
@click.option("--min", "min_nodes", type=int, required=True, help="Minimum number of nodes.")
@click.option("--max", "max_nodes", type=int, required=True, help="Maximum number of nodes.")
@click.option("--size", type=int, default=None, help="Initial number of nodes [default: MIN].")
@click.option(
    "--instance-type",
    default="c6i.large",
    show_default=True,
    help="Worker instance type, or several in order of preference (c5.xlarge,c6i.xlarge,m5.xlarge); "
    "GPU types get the Deep Learning AMI.",
)
@click.option(
    "--rdzv-instance-type",
    default=None,
    help="Instance type of the etcd rendezvous server (x86_64, or arm64/Graviton like t4g.small) "
    "[default: by --max: t3.small up to 200 nodes, then non-burstable c6i.large, c6i.xlarge above "
    "2000, c6i.2xlarge above 4000].",
)
@click.option(
    "--rdzv-etcd-url",
    default=None,
    metavar="URL",
    help="Your copy (s3:// under the bucket's petctl/uploads/, or https://) of the official etcd release "
    "tarball for the rendezvous server, for a subnet without internet access [default: the pinned release].",
)
@click.option(
    "--rdzv-etcd-sha256",
    default=None,
    metavar="HEX",
    help="SHA-256 of --rdzv-etcd-url's file; the server refuses to boot a tarball that does not match.",
)
@click.option(
    "--nproc-per-node", default="auto", show_default=True, help="'auto' (GPUs, or 1 on CPU) or a number."
)
@click.option("--spot", is_flag=True, help="Spot above MIN on-demand nodes (price-capacity-optimized).")
@click.option(
    "--warm-pool",
    default=None,
    type=int,
    metavar="N",
    help="Stopped instances, pre-booted with the job's environment, that a scale-up takes first "
    "(0-100, at most --max; not with --spot or several instance types) [default: 0].",
)
@click.option(
    "--no-placement-group",
    is_flag=True,
    default=None,
    help="EFA types (p4d, p5, ...): no cluster placement group [default: one, in the first subnet's zone].",
)
@click.option("--ami", default=None, help="AMI id instead of the public SSM parameter.")
@click.option(
    "--drain-timeout",
    default=None,
    type=int,
    help="Seconds a leaving node has to checkpoint [default: 120; 90 with --spot, inside the 2-minute notice].",
)
@click.option(
    "--env", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable for the training script."
)
@click.option(
    "--torch-version",
    default=None,
    metavar="X.Y.Z",
    help="torch every node installs (CUDA build on GPU types) [default: the version petctl is tested with].",
)
@click.option(
    "--requirements",
    default=None,
    metavar="FILE",
    help="pip requirements every node installs after torch [default: the project's top requirements.txt].",
)
@click.option(
    "--no-requirements",
    is_flag=True,
    default=None,
    help="Install no requirements, not even the project's requirements.txt.",
)
@click.option(
    "--live",
    is_flag=True,
    default=None,
    help="Live membership: survivors never restart on a join, drain or loss (a torchft training loop, "
    "data-parallel only, x86_64; docs/agent.md 'Live vs restart').",
)
@click.option(
    "--rdzv-backend",
    type=click.Choice(["petctl-etcd", "etcd-v2", "etcd"]),
    default=None,
    help="Rendezvous: petctl's own handler on etcd (default), or torch's etcd-v2 / etcd as a fallback.",
)
@click.option(
    "--max-restarts",
    default=None,
    type=int,
    help="Worker failures (not membership changes) tolerated before the job fails [default: 10].",
)
@click.option(
    "--max-node-failures",
    default=None,
    type=int,
    help="Failed boots or node agents since the job last trained that stop it (groups to zero) [default: 10].",
)
@click.option(
    "--join-timeout",
    default=None,
    type=int,
    help="Seconds the job may stay below --min while nodes are on their way [default: 1800].",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the plan (resources, sizes, image, uploads) and create nothing."
)
@click.option("--show-template", is_flag=True, help="With --dry-run: also print the CloudFormation template.")
@click.option("--wait", is_flag=True, help="Block until the job ends: exit 0 on SUCCEEDED, 1 on FAILED.")
@click.option("--follow", "-f", is_flag=True, help="Like --wait, and stream the job's log lines meanwhile.")
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for the job stack.")
@click.argument("target")
@pass_ctx
def run_job(
    obj: Context,
    target: str,
    args: tuple[str, ...],
    dry_run: bool,
    show_template: bool,
    wait: bool,
    follow: bool,
    timeout: int,
    env: tuple[str, ...],
    **opts: Any,
) -> None:
    """Start an elastic job running TARGET [-- ARGS...].

    \b
    TARGET is one of:
      train.py            a script: uploaded, run on every node as `python train.py ARGS`
      ./project -- pkg/main.py --lr 0.1
                          a directory: uploaded as a tar; the first argument after --
                          is the script inside it, the rest are its arguments
      s3://bucket/petctl/code/train.py
                          a script already in S3 (must exist)

    Everything after -- goes to the training script unchanged.
    """
    from petctl import jobs

    env_map = {}
    for item in env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        env_map[k] = v
    # None = the JobRequest default (defined once, in jobs/request.py)
    req = jobs.JobRequest(
        target=target, args=list(args), env=env_map, **{k: v for k, v in opts.items() if v is not None}
    )
    plan = jobs.prepare(obj, req)
    if dry_run:
        obj.ui.result(plan.to_dict(), lambda p: render.plan_text(p, show_template))
        return
    started = jobs.apply(plan, obj.gateway(), timeout=timeout)
    obj.ui.result(started.to_dict(), render.started_text)
    if wait or follow:
        _wait_for_job(obj, started.job, follow)


def _wait_for_job(obj: Context, job: str, follow: bool) -> None:
    """run-job --wait/--follow: poll until the job ends; exit 0 on SUCCEEDED, 1 otherwise."""
    from petctl import jobs
    from petctl import logs as logs_mod

    follower = None
    gw = obj.gateway()
    if follow:
        group = obj.profile.log_group or naming.log_group(obj.profile_name)
        follower = logs_mod.LogFollower(gw.logs, group, job, since_seconds=600)
    seen = {"state": None}

    def print_new_lines() -> None:
        for ev in follower.poll() if follower is not None else []:
            click.echo(render.log_line(ev, obj.ui.json))

    def on_poll(st: jobs.JobStatus) -> None:
        print_new_lines()
        if st.state != seen["state"]:
            seen["state"] = st.state
            step = f", step {st.last_step}" if st.last_step is not None else ""
            obj.ui.progress(f"job {job}: {st.state} (world size {st.world_size or '-'}{step})")

    try:
        final = jobs.wait_for_end(
            gw, obj.profile_name, job, on_poll, interval=2.0 if follow else 5.0, sleep=time.sleep
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"stopped waiting; job {job} goes on (`{cmd('kill-job ' + job)}` stops it)"
        ) from None
    print_new_lines()
    if final is None:
        raise PetctlError(f"job {job} ended GONE")
    if final.state != "SUCCEEDED":
        reason = final.reason or "; ".join(sorted({a.get("reason") for a in final.agents if a.get("reason")}))
        raise PetctlError(
            f"job {job} ended {final.state}: "
            + (
                reason
                or ("its stack is being deleted (kill-job)" if final.state == "DELETING" else "")
                or f"no reason recorded; `{cmd('status ' + job)}` shows the hosts"
            )
        )
    obj.ui.progress(f"job {job} SUCCEEDED at step {final.last_step}")
