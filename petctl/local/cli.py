"""``petctl local …``: start, stop and inspect the embedded local cloud, and inject faults.

The main CLI adds :data:`local_group` with ``cli.add_command(local_group)``.
Output is text by default; ``--json`` (or the global ``--output json``) prints
one JSON document on stdout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

import petctl.local as local
from petctl.ui import AliasGroup

_JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def _want_json(as_json: bool) -> bool:
    if as_json:
        return True
    ctx = click.get_current_context(silent=True)
    ui = getattr(ctx.find_root().obj, "ui", None) if ctx else None
    return bool(getattr(ui, "json", False))


def _emit(data: Any, as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if _want_json(as_json) else text)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [["-" if r.get(c) is None else str(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _public(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != "control_token"}


@click.group("local", cls=AliasGroup)
def local_group() -> None:
    """The embedded local cloud: AWS APIs (moto), instances as local processes, etcd, EFS as a directory.

    `petctl --local <command>` starts it on first use. Its state, and logs, live in
    $PETCTL_LOCAL_DIR (default ~/.petctl/local). Nothing here talks to real AWS.
    """


@local_group.command("start")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for it to answer.")
@_JSON
def start_cmd(timeout: float, as_json: bool) -> None:
    """Start the local cloud in the background (no-op if it runs)."""
    info = _public(local.ensure_started(timeout=timeout))
    text = (
        f"local cloud running (pid {info['pid']})\n"
        f"  AWS endpoint  {info['endpoint_url']}   (region {info['region']}, fake credentials)\n"
        f"  IMDS          {info['imds_url']}/<instance-id>/latest/...\n"
        f"  state dir     {info['state_dir']}\n"
        f"  log           {info['log_file']}"
    )
    _emit(info, as_json, text)


@local_group.command("stop")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for it to exit.")
@_JSON
def stop_cmd(timeout: float, as_json: bool) -> None:
    """Stop the local cloud and every process it started. Its AWS state is lost."""
    res = local.stop(timeout=timeout)
    if not res["was_running"]:
        text = "local cloud was not running"
    else:
        text = f"local cloud stopped (pid {res['pid']}); killed {len(res['instances'])} instance(s)"
    if res["leftovers_killed"]:
        text += f"; cleaned up {len(res['leftovers_killed'])} leftover process group(s)"
    _emit(res, as_json, text)


@local_group.command("status")
@_JSON
def status_cmd(as_json: bool) -> None:
    """Whether it runs, its endpoints, and each instance's process tree."""
    st = local.status()
    if not st["running"]:
        _emit(st, as_json, f"local cloud is not running (state dir {st['state_dir']})")
        return
    lines = [
        f"local cloud running (pid {st['pid']}) since {time.strftime('%H:%M:%S', time.localtime(st['started_at']))}",
        f"  AWS endpoint {st['endpoint_url']}  IMDS {st['imds_url']}  log {st['log_file']}",
    ]
    if st["instances"]:
        lines += [
            "",
            _table(st["instances"], ["instance_id", "role", "job", "ip", "state", "lifecycle_state", "pid"]),
        ]
    else:
        lines.append("  no instances")
    _emit(st, as_json, "\n".join(lines))


@local_group.command("kill-instance")
@click.argument("instance_id")
@_JSON
def kill_instance_cmd(instance_id: str, as_json: bool) -> None:
    """Hard-kill an instance (SIGKILL its whole process tree, no drain); its group replaces it."""
    res = local.kill_instance(instance_id)
    replaced = "its group launches a replacement" if res.get("replaced_by_group") else "not in a group"
    _emit(res, as_json, f"killed {instance_id} (process group {res.get('pgid')}); {replaced}")


@local_group.command("spot-interrupt")
@click.argument("instance_id")
@click.option("--seconds", default=120.0, show_default=True, help="Notice period before termination.")
@_JSON
def spot_interrupt_cmd(instance_id: str, seconds: float, as_json: bool) -> None:
    """Send a spot interruption notice; the instance is terminated and replaced after the notice."""
    res = local.spot_interrupt(instance_id, seconds)
    _emit(
        res, as_json, f"spot interruption notice for {instance_id}: terminate at {res['spot_action']['time']}"
    )


@local_group.command("restart-rdzv")
@click.argument("job")
@_JSON
def restart_rdzv_cmd(job: str, as_json: bool) -> None:
    """Reboot a job's rendezvous server (etcd is killed and restarted on the same data)."""
    res = local.restart_rdzv(job)
    _emit(res, as_json, f"restarted etcd of {job} on {res['ip']} (pid {res['old_pid']} -> {res['pid']})")


@local_group.command("logs")
@click.argument("instance_id", required=False)
@click.option("--path", "path_only", is_flag=True, help="Print the log file's path only.")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
def logs_cmd(instance_id: str | None, path_only: bool, lines: int, follow: bool) -> None:
    """Show the local cloud's log, or an instance's (agent or etcd) output."""
    path: Path = local.log_path(instance_id)
    if path_only:
        click.echo(str(path))
        return
    if not path.exists():
        what = f"instance {instance_id}" if instance_id else "the local cloud"
        raise local.LocalCloudError(
            f"no log for {what} at {path}; see `petctl local status` for instance ids"
        )
    with open(path, errors="replace") as f:
        for line in f.readlines()[-lines:] if lines > 0 else []:
            click.echo(line, nl=False)
        while follow:
            line = f.readline()
            if line:
                click.echo(line, nl=False)
            else:
                time.sleep(0.2)
