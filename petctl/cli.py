"""The ``petctl`` command line.

Commands parse, build objects and delegate; the work lives in ``infra``,
``jobs``, ``logs`` and ``local``. Nothing heavy (boto3, torch, moto) is
imported at module level, so ``petctl --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click

from petctl import __version__, config, naming
from petctl import ui as ui_mod
from petctl.context import Context
from petctl.errors import ConfigError, Interrupted, PetctlError
from petctl.ui import UI, AliasGroup, table

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


#: Global options also accepted after the command, as aws-cli does (``petctl jobs -o json``):
#: name -> takes a value.
GLOBAL_OPTIONS = {
    "--profile": True,
    "--region": True,
    "--output": True,
    "-o": True,
    "--local": False,
    "--debug": False,
    "--no-color": False,
}


def hoist_global_options(args: list[str], command_options: Callable[[str], set[str]]) -> list[str]:
    """Move global options written after the command name to before it.

    Stops at ``--`` (the training script's own arguments follow it) and leaves alone an option
    the command itself defines (``configure --region``).
    """
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        i += 2 if GLOBAL_OPTIONS.get(args[i]) else 1
    if i >= len(args) or args[i] == "--":
        return args
    head, name, tail = args[:i], args[i], args[i + 1 :]
    own = command_options(name)
    moved: list[str] = []
    rest: list[str] = []
    j = 0
    while j < len(tail):
        a = tail[j]
        if a == "--":
            rest += tail[j:]
            break
        key = a.split("=", 1)[0]
        if key in GLOBAL_OPTIONS and key not in own:
            if GLOBAL_OPTIONS[key] and "=" not in a and j + 1 < len(tail):
                moved += tail[j : j + 2]
                j += 2
                continue
            moved.append(a)
        else:
            rest.append(a)
        j += 1
    return head + moved + [name] + rest


class PetctlGroup(AliasGroup):
    """The top-level group: dash command names with underscore aliases (``AliasGroup``), global
    options after the command, lazy subgroups, and surprises turned into one-line errors."""

    # Subgroups imported only when used, so `petctl --help` stays light: name -> short help.
    LAZY = {"local": "The embedded local cloud: start, stop, faults, demo."}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "local" and "local" not in self.commands:
            from petctl.local.cli import local_group

            local_group.add_command(demo_cmd)
            self.add_command(local_group)
        return super().get_command(ctx, cmd_name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        def own_options(name: str) -> set[str]:
            command = self.commands.get(name) or self.commands.get(name.replace("_", "-"))
            return {o for p in (command.params if command else []) for o in getattr(p, "opts", [])}

        return super().parse_args(ctx, hoist_global_options(list(args), own_options))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.LAZY and name not in self.commands:
                rows.append((name, self.LAZY[name]))
                continue
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append(
                    (name, cmd.get_short_help_str(formatter.width - 6 - max(len(n) for n in self.commands)))
                )
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt:
            raise Interrupted("interrupted") from None
        except Exception as e:
            obj = ctx.obj if isinstance(ctx.obj, Context) else None
            if (obj and obj.ui.debug_enabled) or os.environ.get("PETCTL_DEBUG"):
                raise
            raise _as_petctl_error(e) from e


def _as_petctl_error(e: Exception) -> PetctlError:
    name = type(e).__name__
    if name == "NoCredentialsError":
        return ConfigError(
            "no AWS credentials found: run `aws configure`, set AWS_PROFILE, or try `petctl --local`"
        )
    if name == "NoRegionError":
        return ConfigError("no AWS region: pass --region or set AWS_REGION")
    if name in ("EndpointConnectionError", "ConnectTimeoutError"):
        return PetctlError(f"cannot reach the AWS endpoint ({e}); check the network or AWS_ENDPOINT_URL")
    if name == "ClientError":
        from petctl.errors import describe_client_error

        return PetctlError(f"AWS request failed: {describe_client_error(e)} (rerun with --debug for details)")
    return PetctlError(f"unexpected {name}: {e} (rerun with --debug for the traceback)")


pass_ctx = click.make_pass_decorator(Context)


def _complete_job_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion for JOB: the active profile's jobs (nothing when that needs a local
    cloud that is not running, or AWS does not answer: completion must never hang or fail)."""
    try:
        from petctl import jobs
        from petctl.stacks import Stacks

        root = ctx.find_root().params
        obj = Context(
            profile_flag=root.get("profile"), region_flag=root.get("region"), local=root.get("local")
        )
        if obj.local:
            from petctl import local as local_cloud

            if not local_cloud.status().get("running"):
                return []
        stacks = Stacks(obj.clients()("cloudformation"), obj.ui)
        names = [naming.job_from_stack(s["StackName"]) or "" for s in jobs.job_stacks(obj, stacks)]
        return sorted(n for n in names if n.startswith(incomplete))
    except Exception:  # noqa: BLE001
        return []


#: Commands that may name a profile that does not exist yet; every other command refuses an
#: unknown one (exit 2), so a typo never acts on another profile's jobs.
PROFILE_MAKERS = {"setup", "configure", "profiles", "local", "demo"}


@click.group(cls=PetctlGroup, context_settings=CONTEXT_SETTINGS)
@click.option(
    "--profile",
    "profile",
    metavar="NAME",
    help="petctl profile (also the AWS profile). Env: PETCTL_PROFILE, AWS_PROFILE.",
)
@click.option("--region", metavar="REGION", help="AWS region. Env: AWS_REGION, AWS_DEFAULT_REGION.")
@click.option(
    "--local", is_flag=True, help="Run against the embedded local cloud on this machine (no AWS account)."
)
@click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Result format.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks and log every AWS call made.")
@click.option("--no-color", is_flag=True, help="No colour in the output (also: NO_COLOR set).")
@click.version_option(__version__, prog_name="petctl")
@click.pass_context
def cli(
    ctx: click.Context,
    profile: str | None,
    region: str | None,
    local: bool,
    output: str,
    debug: bool,
    no_color: bool,
) -> None:
    """Elastic PyTorch training on AWS (or on this machine with --local).

    \b
      petctl setup                                 # base infrastructure, once
      petctl run-job --min 2 --max 8 train.py -- --epochs 10
      petctl scale JOB --size 6
      petctl status JOB
      petctl kill-job JOB
      petctl teardown

    Global options may also follow the command (petctl jobs -o json). The
    underscore names of the original petctl (run_job, kill_job, list_hosts) work too.
    """
    if profile is not None:
        config.validate_profile_name(profile)
    obj = Context(profile_flag=profile, region_flag=region, local=local, ui=UI(output=output, debug=debug))
    obj.profile_must_exist = ctx.invoked_subcommand not in PROFILE_MAKERS
    ctx.obj = obj
    ui_mod.set_prog(local=local, profile=profile)
    if no_color or os.environ.get("NO_COLOR"):  # https://no-color.org: any non-empty value
        ctx.color = False


# -- base infrastructure ------------------------------------------------------


@cli.command()
@click.option(
    "--az-count", default=2, show_default=True, help="Number of availability zones (one public subnet each)."
)
@click.option("--vpc-cidr", default=None, help="VPC CIDR block [default: profile, else 10.0.0.0/16].")
@click.option("--efs-id", default=None, help="Use this existing EFS file system instead of creating one.")
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
    )

    def text(r: dict[str, Any]) -> str:
        lines = [f"base stack {r['stack']} {r['action']} ({r['status']}) in {r['region']}"]
        lines += [f"  {k}: {v}" for k, v in sorted(r["outputs"].items())]
        lines.append(f"profile {r['profile']!r} saved to {r['profile_path']}")
        lines.append(f"next: {ui_mod.cmd('run-job --min 1 --max 2 train.py')}")
        return "\n".join(lines)

    obj.ui.result(result, text)


def _yes_option(f: Any) -> Any:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(f)


def _confirm(yes: bool, what: str, command: str) -> None:
    """Ask before deleting: on a terminal a [y/N] question; elsewhere only ``--yes`` proceeds."""
    if yes:
        return
    if not _stdin_is_terminal():
        raise ConfigError(f"{command} would {what}; pass --yes to confirm (no terminal to ask on)")
    if not click.confirm(f"{what[0].upper()}{what[1:]}?", default=False, err=True):
        raise PetctlError("not confirmed; nothing was deleted")


@cli.command()
@click.option("--force", is_flag=True, help="Delete the profile's jobs first instead of refusing.")
@click.option(
    "--delete-data",
    is_flag=True,
    help="Also delete the EFS file system petctl created, with every checkpoint (kept by default).",
)
@_yes_option
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for each stack.")
@pass_ctx
def teardown(obj: Context, force: bool, delete_data: bool, yes: bool, timeout: int) -> None:
    """Delete the base stack (refuses while jobs exist, unless --force). Checkpoints are kept."""
    from petctl import infra

    config.load_profile(obj.profile_name, must_exist=True)
    plan = infra.plan_teardown(obj, force=force, delete_data=delete_data)
    if plan.stack_exists or plan.jobs or plan.efs_to_delete:
        kept = plan.kept()
        _confirm(yes, plan.describe() + (f" ({kept})" if kept else ""), "teardown")
    result = infra.teardown(obj, plan, timeout=timeout)

    def text(r: dict[str, Any]) -> str:
        if not r["removed_stacks"] and not r["efs_deleted"]:
            lines = [f"nothing to remove for profile {r['profile']!r}"]
        else:
            lines = [
                f"removed: {', '.join(r['removed_stacks'] + ([r['efs_deleted']] if r['efs_deleted'] else []))}"
            ]
            lines[0] += f" (emptied {r['objects_deleted']} S3 objects)"
        if r["kept"]:
            lines.append(r["kept"])
        if r.get("left_behind"):
            lines.append(f"left behind (delete by hand): {', '.join(r['left_behind'])}")
        elif r["removed_stacks"]:
            lines.append("left behind: nothing")
        return "\n".join(lines)

    obj.ui.result(result, text)


@cli.command()
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
        if not _stdin_is_terminal():
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

    def text(r: dict[str, Any]) -> str:
        missing = r["missing_for_jobs"]
        state = "ready for jobs" if not missing else f"still missing: {', '.join(missing)}"
        return f"profile {r['name']!r} saved to {r['profile_path']} ({state})"

    obj.ui.result(result, text)


# -- jobs -----------------------------------------------------------------------


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
                f"{ui_mod.cmd('run-job [OPTIONS] TARGET -- ' + e.option_name + ' ...')}",
                ctx,
            ) from None
        except click.UsageError as e:
            if "unexpected extra argument" not in e.format_message():
                raise
            raise click.UsageError(
                f"{e.format_message().rstrip('.')}; the training script's arguments go after --: "
                f"{ui_mod.cmd('run-job [OPTIONS] TARGET -- ARGS...')}",
                ctx,
            ) from None
        ctx.params["args"] = tuple(script_args)
        return rest


@cli.command("run-job", cls=RunJobCommand)
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
    default="t3.small",
    show_default=True,
    help="Instance type of the etcd rendezvous server (x86_64).",
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
    from petctl import jobs, storage

    env_map = {}
    for item in env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        env_map[k] = v
    # None = the JobRequest default (defined once, in jobs.py)
    req = jobs.JobRequest(
        target=target, args=list(args), env=env_map, **{k: v for k, v in opts.items() if v is not None}
    )
    jobs.validate_request(req)
    obj.profile.require_ready()
    jobs.check_code_url(obj, req)
    if req.ami is not None:
        jobs.resolve_ami(obj, req)
    jobs.resolve_vpc(obj)
    plan = jobs.plan(obj, req, dist=storage.dist_wheel())
    if dry_run:
        obj.ui.result(jobs.plan_as_dict(plan), lambda p: jobs.plan_text(p, show_template))
        return
    result = jobs.execute(obj, plan, timeout=timeout)

    def text(r: dict[str, Any]) -> str:
        return "\n".join(
            [
                f"job {r['job']} started: {r['size']} x {r['instance_type']} (min {r['min']}, max {r['max']})",
                f"  rendezvous: {r['rendezvous_endpoint']}",
                f"  code and status: {r['s3_prefix']}",
                f"  watch it:  {ui_mod.cmd('status ' + r['job'])}   |   {ui_mod.cmd('logs ' + r['job'] + ' --follow')}",
                f"  scale it:  {ui_mod.cmd('scale ' + r['job'] + ' --size N')}",
                f"  stop it:   {ui_mod.cmd('kill-job ' + r['job'])}",
            ]
        )

    obj.ui.result(result, text)
    if wait or follow:
        _wait_for_job(obj, result["job"], follow)


def _wait_for_job(obj: Context, job: str, follow: bool) -> None:
    """run-job --wait/--follow: poll until the job ends; exit 0 on SUCCEEDED, 1 otherwise."""
    import time

    from petctl import jobs, naming
    from petctl import logs as logs_mod

    follower = None
    if follow:
        group = obj.profile.log_group or naming.log_group(obj.profile_name)
        follower = logs_mod.LogFollower(obj.clients()("logs"), group, job, since_seconds=600)
    seen = {"state": None}

    def on_poll(st: dict[str, Any]) -> None:
        if follower is not None:
            for ev in follower.poll():
                click.echo(_log_line(ev, obj.ui.json))
        if st["state"] != seen["state"]:
            seen["state"] = st["state"]
            step = f", step {st['last_step']}" if st.get("last_step") is not None else ""
            obj.ui.progress(f"job {job}: {st['state']} (world size {st.get('world_size') or '-'}{step})")

    try:
        final = jobs.wait_for_end(obj, job, on_poll, interval=2.0 if follow else 5.0, sleep=time.sleep)
    except KeyboardInterrupt:
        raise Interrupted(
            f"stopped waiting; job {job} goes on (`{ui_mod.cmd('kill-job ' + job)}` stops it)"
        ) from None
    if follower is not None:
        for ev in follower.poll():
            click.echo(_log_line(ev, obj.ui.json))
    if final["state"] != "SUCCEEDED":
        reason = final.get("reason") or "; ".join(
            sorted({a.get("reason") for a in final.get("agents", []) if a.get("reason")})
        )
        raise PetctlError(f"job {job} ended {final['state']}" + (f": {reason}" if reason else ""))
    obj.ui.progress(f"job {job} SUCCEEDED at step {final.get('last_step')}")


def _log_line(ev: dict[str, Any], as_json: bool) -> str:
    import datetime as dt
    import json

    if as_json:
        return json.dumps(
            {"stream": ev["logStreamName"], "timestamp": ev["timestamp"], "message": ev["message"]}
        )
    ts = dt.datetime.fromtimestamp(ev["timestamp"] / 1000, dt.timezone.utc).strftime("%H:%M:%S")
    return f"{ts} {ev['logStreamName'].split('/', 1)[-1]} {ev['message'].rstrip()}"


def _checked_answer(key: str, value: str) -> Any:
    """A prompt answer validated as it is typed: click asks again on a bad one."""
    if not value:
        return None
    try:
        return config.validate_field(key, value)
    except ConfigError as e:
        raise click.UsageError(e.format_message()) from None


def _aws_config_region() -> str | None:
    import boto3

    try:
        return boto3.session.Session().region_name
    except Exception:  # noqa: BLE001 - a broken ~/.aws/config only loses the default
        return None


def _stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


@cli.command()
@click.argument("job", shell_complete=_complete_job_names)
@click.option("--size", type=int, required=True, help="New number of worker nodes.")
@pass_ctx
def scale(obj: Context, job: str, size: int) -> None:
    """Set the number of worker nodes of JOB."""
    from petctl import jobs

    r = jobs.scale(obj, job, size)
    obj.ui.result(r, f"{r['job']}: desired workers {r['from']} -> {r['to']} (range {r['min']}-{r['max']})")


@cli.command()
@click.argument("job", shell_complete=_complete_job_names)
@click.option("--watch", "-w", is_flag=True, help="Refresh until Ctrl-C (which leaves the job alone).")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between refreshes with --watch.")
@pass_ctx
def status(obj: Context, job: str, watch: bool, interval: float) -> None:
    """The job's state, group sizes, hosts and what the agents report."""
    from petctl import jobs

    if not watch:
        obj.ui.result(jobs.status(obj, job), _status_text)
        return
    _watch_status(obj, job, max(interval, 1.0))


def _watch_status(obj: Context, job: str, interval: float) -> None:
    """status --watch: redraw in place on a terminal, one snapshot after another when piped."""
    import json
    import time

    from petctl import jobs

    tty = sys.stdout.isatty()
    last: tuple[float, int] | None = None
    try:
        while True:
            st = jobs.status(obj, job)
            now = time.monotonic()
            rate = None
            if st.get("last_step") is not None:
                if last is not None and now > last[0] and st["last_step"] >= last[1]:
                    rate = (st["last_step"] - last[1]) / (now - last[0])
                last = (now, st["last_step"])
            st["steps_per_s"] = None if rate is None else round(rate, 2)
            if obj.ui.json:
                click.echo(json.dumps(st, sort_keys=True, default=str))
            else:
                body = _status_text(st) + (f"\n  steps/s {rate:.2f}" if rate is not None else "")
                stamp = time.strftime("%H:%M:%S")
                if tty:
                    click.echo("\x1b[H\x1b[2J", nl=False)  # home + clear: redraw in place
                click.echo(f"[{stamp}] every {interval:g}s, Ctrl-C to leave (the job goes on)\n{body}")
                if not tty:
                    click.echo("")
            if st["state"] in jobs.FINAL_STATES:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        raise Interrupted("stopped watching; the job goes on") from None


def _status_text(r: dict[str, Any]) -> str:
    lines = [
        f"job {r['job']}: {r['state']}  (stack {r['stack_status']})",
        f"  workers: desired {r['desired']}, in service {r['in_service']}, min {r['min']}, max {r['max']}",
        (
            f"  world size {r['world_size'] or '-'}, step {r['last_step'] if r['last_step'] is not None else '-'}, "
            f"checkpoint step {r['last_checkpoint_step'] if r['last_checkpoint_step'] is not None else '-'}, "
            f"rendezvous rounds {r['rounds']}, restarts {r['restarts']}, up {ui_mod.duration(r.get('uptime_s'))}"
            if r.get("reports_progress", True)
            else f"  world size {r['world_size'] or '-'}, up {ui_mod.duration(r.get('uptime_s'))}, "
            f"rendezvous rounds {r['rounds']}, restarts {r['restarts']}; the script reports no progress "
            f"(it does not use petctl_agent.checkpoint, so steps and checkpoints are not known)"
        ),
        "",
        table(
            r["hosts"],
            [
                "role",
                "instance_id",
                "private_ip",
                "lifecycle_state",
                "agent_state",
                "world_size",
                "last_step",
            ],
        ),
    ]
    worker_boots = [b for b in r.get("boot_events") or [] if b.get("role") == "worker"]
    if worker_boots:  # the newest worker boot, phase by phase (docs/contracts.md, Boot events)
        b = worker_boots[-1]
        phases = ", ".join(f"{p['kind']} +{p['seconds']:.1f}s" for p in b["phases"])
        lines.insert(
            2,
            f"  boot of {b['instance_id']} ({len(worker_boots)} worker boots): {phases}; {b['seconds']:.1f}s",
        )
    if r["events"]:
        lines += ["", "recent events:"]
        t0 = r["events"][0].get("t", 0)
        for e in r["events"][-12:]:
            extra = ", ".join(
                f"{k}={e[k]}" for k in ("round", "world_size", "reason") if e.get(k) is not None
            )
            lines.append(
                f"  +{e.get('t', 0) - t0:7.1f}s  {e.get('instance_id', '?'):<20} {e.get('kind', '?'):<18} {extra}"
            )
    if r.get("reason"):
        lines.insert(1, f"  reason: {r['reason']}")
    return "\n".join(lines)


@cli.command("list-hosts")
@click.argument("job", shell_complete=_complete_job_names)
@pass_ctx
def list_hosts(obj: Context, job: str) -> None:
    """Instances of JOB: id, private IP, AZ, lifecycle state, and how to open a shell."""
    from petctl import jobs

    rows = jobs.hosts(obj, job)
    obj.ui.result(
        rows,
        lambda r: table(
            r, ["role", "instance_id", "private_ip", "availability_zone", "lifecycle_state", "ssm"]
        ),
    )


@cli.command()
@click.argument("job", shell_complete=_complete_job_names)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines.")
@click.option(
    "--since", default=None, help="Only lines newer than this (30s, 10m, 2h, 1d) [default: the last hour]."
)
@click.option("--instance", default=None, help="Only this instance's stream.")
@pass_ctx
def logs(obj: Context, job: str, follow: bool, since: str | None, instance: str | None) -> None:
    """Print the job's log lines from CloudWatch Logs."""

    from petctl import jobs as jobs_mod
    from petctl import logs as logs_mod
    from petctl import naming
    from petctl.errors import NotFound

    since_s = logs_mod.parse_duration(since) if since else None
    group = obj.profile.log_group or naming.log_group(obj.profile_name)
    client = obj.clients()("logs")
    # A killed job's lines stay readable; a job that never was is an error, like `status`.
    if jobs_mod.find_job(obj, job) is None and not logs_mod.has_streams(client, group, job):
        raise NotFound(
            f"job {job!r} not found in profile {obj.profile_name!r}; `{ui_mod.cmd('jobs')}` lists the jobs"
        )
    printed = 0
    try:
        for ev in logs_mod.iter_events(
            client, group, job, since_seconds=since_s, instance=instance, follow=follow
        ):
            printed += 1
            click.echo(_log_line(ev, obj.ui.json))
    except KeyboardInterrupt:
        raise Interrupted("interrupted") from None
    if not printed:
        click.echo(
            f"job {job} has no log lines "
            + (f"since {since}" if since else "in the last hour (--since 1d for more)"),
            err=True,
        )


@cli.command()
@pass_ctx
def jobs(obj: Context) -> None:
    """The profile's jobs with their state and sizes."""
    from petctl import jobs as jobs_mod

    rows = jobs_mod.list_jobs(obj)
    obj.ui.result(
        rows,
        lambda r: (
            table(
                [{**j, "age": ui_mod.ago(j["created"])} for j in r],
                ["job", "state", "min", "max", "desired", "in_service", "age"],
            )
            if r
            else "no jobs"
        ),
    )


@cli.command("kill-job")
@click.argument("job", shell_complete=_complete_job_names)
@_yes_option
@click.option("--no-wait", is_flag=True, help="Start the deletion and return at once.")
@click.option("--timeout", default=1800, show_default=True, help="Seconds to wait for the deletion.")
@pass_ctx
def kill_job(obj: Context, job: str, yes: bool, no_wait: bool, timeout: int) -> None:
    """Stop JOB's workers, then delete its stack (rendezvous server, groups). Checkpoints are kept."""
    from petctl import jobs, naming

    if jobs.find_job(obj, job) is not None:
        efs = obj.profile.efs_id or "the profile's EFS"
        _confirm(
            yes,
            f"delete job {job} (stack {naming.job_stack(job)}, its instances and rendezvous server); "
            f"its checkpoints on {efs} at /{naming.checkpoint_dir(job)} are kept",
            "kill-job",
        )
    r = jobs.kill_job(obj, job, timeout=timeout, wait=not no_wait)
    if r["deleted"] and not r["waited"]:
        msg = f"job {job}: deletion started; `{ui_mod.cmd('jobs')}` shows it until it is gone"
    elif r["deleted"]:
        msg = f"job {job} deleted, every instance gone, in {r['seconds']}s; checkpoints kept at {r['checkpoints_kept']}"
    else:
        msg = f"job {job} does not exist (already deleted?); nothing to do"
    obj.ui.result(r, msg)


@cli.command()
@click.argument("path")
@click.argument("s3_url", required=False)
@pass_ctx
def upload(obj: Context, path: str, s3_url: str | None) -> None:
    """Upload PATH (file or directory) to S3_URL [default: the profile bucket]."""
    from petctl import jobs

    r = jobs.upload(obj, path, s3_url)
    obj.ui.result(r, lambda r: "\n".join(r["uploaded"]) + f"\n{r['count']} file(s) uploaded")


@cli.command()
@pass_ctx
def profiles(obj: Context) -> None:
    """List the profiles on this machine."""
    rows = []
    for name in config.list_profiles():
        p = config.load_profile(name)
        rows.append(
            {"profile": name, "region": p.region, "stack": p.stack_name, "ready": not p.missing_for_jobs()}
        )
    obj.ui.result(rows, lambda r: table(r, ["profile", "region", "stack", "ready"]) if r else "no profiles")


@click.command("demo")
@click.option("--total-steps", default=1500, show_default=True, help="Training steps of the example job.")
@click.option(
    "--step-time", default=0.1, show_default=True, help="Extra seconds per step (pace it to watch)."
)
@click.option("--timeout", default=300, show_default=True, help="Seconds allowed for each stage.")
@click.option("--keep", is_flag=True, help="Leave the job and the local cloud running afterwards.")
def demo_cmd(total_steps: int, step_time: float, timeout: int, keep: bool) -> None:
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


@cli.command()
@click.argument("job", shell_complete=_complete_job_names)
@click.option(
    "--html",
    "html_path",
    metavar="FILE",
    default=None,
    help="Also write a self-contained page (inline SVG chart, table of rounds).",
)
@pass_ctx
def timeline(obj: Context, job: str, html_path: str | None) -> None:
    """Chart JOB: world size, steps/s, membership events and their cost."""
    import shutil

    from petctl import jobs
    from petctl import timeline as tl

    data = tl.build(jobs.status(obj, job))
    result = tl.to_json(data)
    if html_path:
        path = os.path.abspath(html_path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(tl.render_html(data))
        result["html"] = path
    width = max(40, min(120, shutil.get_terminal_size((100, 24)).columns - 8))
    try:
        "█│".encode(sys.stdout.encoding or "ascii")
        ascii_only = False
    except (UnicodeEncodeError, LookupError):
        ascii_only = True

    def text(_: dict[str, Any]) -> str:
        out = tl.render_text(data, width=width, ascii_only=ascii_only)
        return out + (f"\npage: {result['html']}" if html_path else "")

    obj.ui.result(result, text)


def main() -> None:
    cli(prog_name="petctl")


if __name__ == "__main__":
    main()
