"""All user-facing output goes through here.

Progress goes to stderr so that ``--output json`` leaves stdout parseable; the
result of a command goes to stdout, either as text or as one JSON document.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import click

#: How the user invoked petctl, for the commands a hint tells them to run next: a hint under
#: ``--local`` (or an explicit ``--profile``) must carry it, or it sends the user to AWS.
_PROG = ["petctl"]


def set_prog(local: bool = False, profile: str | None = None) -> None:
    _PROG[:] = ["petctl"] + (["--local"] if local else []) + (["--profile", profile] if profile else [])


def cmd(rest: str) -> str:
    """``petctl [--local] [--profile P] <rest>``: a command line to show in a hint."""
    return " ".join(_PROG + [rest])


class AliasGroup(click.Group):
    """A group whose canonical command names use dashes (``run-job``), as aws-cli's do; the
    underscore spellings of the original petctl (``run_job``) keep working, unlisted."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or super().get_command(ctx, cmd_name.replace("_", "-"))

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        return (command.name if command else name), command, rest


class UI:
    """Writes progress and results in the chosen output format."""

    def __init__(self, output: str = "text", debug: bool = False, quiet: bool = False) -> None:
        self.output = output
        self.debug_enabled = debug
        self.quiet = quiet
        self._t0 = time.monotonic()

    @property
    def json(self) -> bool:
        return self.output == "json"

    def progress(self, message: str) -> None:
        """A progress line (stderr), timestamped relative to the command start."""
        if self.quiet:
            return
        self._clear_live()
        elapsed = time.monotonic() - self._t0
        click.echo(f"[{elapsed:6.1f}s] {message}", err=True)

    def live(self, message: str) -> None:
        """A status line redrawn in place between progress lines (elapsed time of a long wait),
        on a terminal only: piped output keeps the plain progress lines."""
        if self.quiet or not self.live_enabled:
            return
        elapsed = time.monotonic() - self._t0
        text = f"[{elapsed:6.1f}s] {message}"
        width = shutil.get_terminal_size((100, 24)).columns
        click.echo("\r" + text[: max(width - 1, 20)] + "\x1b[K", err=True, nl=False)
        self._live_shown = True

    @property
    def live_enabled(self) -> bool:
        return sys.stderr.isatty()

    def _clear_live(self) -> None:
        if getattr(self, "_live_shown", False):
            click.echo("\r\x1b[K", err=True, nl=False)
            self._live_shown = False

    def warn(self, message: str) -> None:
        self._clear_live()
        click.echo(click.style("warning: ", fg="yellow") + message, err=True)

    def debug(self, message: str) -> None:
        if self.debug_enabled:
            click.echo(f"debug: {message}", err=True)

    def result(self, data: Any, text: Callable[[Any], str] | str | None = None) -> None:
        """Print a command's result: ``data`` as JSON, or ``text`` (or a rendering of data)."""
        if self.json:
            click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
            return
        if callable(text):
            text = text(data)
        if text is None:
            text = json.dumps(data, indent=2, default=str)
        click.echo(text)


def duration(seconds: float | None) -> str:
    """``45s``, ``3m``, ``2h05m``, ``3d4h``."""
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def ago(iso: str | None, now: float | None = None) -> str:
    """``3m ago`` for an ISO timestamp; ``-`` when unknown."""
    import datetime as dt

    if not iso:
        return "-"
    try:
        then = dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return iso
    return duration((time.time() if now is None else now) - then) + " ago"


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain aligned text table; empty cells print as ``-``."""
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return "\n".join(lines)
