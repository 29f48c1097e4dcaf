"""What the commands share: the Context decorator, job-name completion, asking before deleting."""

from __future__ import annotations

import sys
from typing import Any

import click

from petctl import naming
from petctl.context import Context
from petctl.errors import ConfigError, PetctlError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

pass_ctx = click.make_pass_decorator(Context)


def complete_job_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion for JOB: the active profile's jobs (nothing when that needs a local
    cloud that is not running, or AWS does not answer: completion must never hang or fail)."""
    try:
        root = ctx.find_root().params
        obj = Context(
            profile_flag=root.get("profile"), region_flag=root.get("region"), local=root.get("local")
        )
        if obj.local:
            from petctl import local as local_cloud

            if not local_cloud.status().get("running"):
                return []
        names = [
            naming.job_from_stack(s["StackName"]) or ""
            for s in obj.gateway().stacks.job_stacks(obj.profile_name)
        ]
        return sorted(n for n in names if n.startswith(incomplete))
    except Exception:  # noqa: BLE001
        return []


def job_argument(f: Any) -> Any:
    return click.argument("job", shell_complete=complete_job_names)(f)


def yes_option(f: Any) -> Any:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(f)


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


def confirm(yes: bool, what: str, command: str) -> None:
    """Ask before deleting: on a terminal a [y/N] question; elsewhere only ``--yes`` proceeds."""
    if yes:
        return
    if not stdin_is_terminal():
        raise ConfigError(f"{command} would {what}; pass --yes to confirm (no terminal to ask on)")
    if not click.confirm(f"{what[0].upper()}{what[1:]}?", default=False, err=True):
        raise PetctlError("not confirmed; nothing was deleted")
