"""The ``petctl`` command line: the root group, its global options, and ``main``.

The commands live in :mod:`petctl.commands` (one module per area); each parses, makes one
call into ``infra``, ``jobs``, ``logs`` or ``local``, and hands the result to
:mod:`petctl.render`. Nothing heavy (boto3, torch, moto, jinja2) is imported at module level,
so ``petctl --help`` stays fast. A new command goes into the module of its area and is added
to the group below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from petctl import __version__, config
from petctl import ui as ui_mod
from petctl.commands import base, control, observe, run
from petctl.commands.common import CONTEXT_SETTINGS
from petctl.context import Context
from petctl.errors import ConfigError, Interrupted, PetctlError
from petctl.ui import UI, AliasGroup

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

            local_group.add_command(control.demo)
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
        from petctl.gateway.session import NO_CREDENTIALS

        return ConfigError(NO_CREDENTIALS)
    if name == "NoRegionError":
        return ConfigError("no AWS region: pass --region or set AWS_REGION")
    if type(e).__module__.split(".")[0] in ("botocore", "boto3", "s3transfer", "urllib3"):
        from petctl.errors import describe_aws_error

        return PetctlError(describe_aws_error(e) + " (rerun with --debug for details)")
    return PetctlError(f"unexpected {name}: {e} (rerun with --debug for the traceback)")


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


for command in (
    base.setup,
    base.teardown,
    base.configure,
    base.profiles,
    run.run_job,
    control.scale,
    observe.status,
    observe.list_hosts,
    observe.logs,
    observe.jobs,
    control.kill_job,
    control.upload,
    observe.timeline,
):
    cli.add_command(command)
#: ``from petctl.cli import run_job`` (tests, and scripts that read its options).
run_job = run.run_job


def main() -> None:
    cli(prog_name="petctl")


if __name__ == "__main__":
    main()
