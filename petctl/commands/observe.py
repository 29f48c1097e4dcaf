"""Reading jobs: status, list-hosts, logs, jobs, timeline."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

import click

from petctl import naming, render
from petctl.commands.common import job_argument, pass_ctx
from petctl.context import Context
from petctl.errors import Interrupted, NotFound
from petctl.ui import cmd


@click.command()
@job_argument
@click.option("--watch", "-w", is_flag=True, help="Refresh until Ctrl-C (which leaves the job alone).")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between refreshes with --watch.")
@pass_ctx
def status(obj: Context, job: str, watch: bool, interval: float) -> None:
    """The job's state, group sizes, hosts and what the agents report."""
    from petctl import jobs

    if not watch:
        obj.ui.result(jobs.observe(job, obj.gateway(), obj.profile_name).to_dict(), render.status_text)
        return
    _watch_status(obj, job, max(interval, 1.0))


def _watch_status(obj: Context, job: str, interval: float) -> None:
    """status --watch: redraw in place on a terminal, one snapshot after another when piped."""
    from petctl import jobs

    tty = sys.stdout.isatty()
    last: tuple[float, int] | None = None
    try:
        while True:
            st = jobs.observe(job, obj.gateway(), obj.profile_name).to_dict()
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
                body = render.status_text(st) + (f"\n  steps/s {rate:.2f}" if rate is not None else "")
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


@click.command("list-hosts")
@job_argument
@pass_ctx
def list_hosts(obj: Context, job: str) -> None:
    """Instances of JOB: id, private IP, AZ, lifecycle state, and how to open a shell."""
    from petctl import jobs

    rows = [h.to_dict() for h in jobs.hosts(obj.gateway(), obj.profile_name, job)]
    obj.ui.result(rows, render.hosts_table)


@click.command()
@job_argument
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines.")
@click.option(
    "--since", default=None, help="Only lines newer than this (30s, 10m, 2h, 1d) [default: the last hour]."
)
@click.option("--instance", default=None, help="Only this instance's stream.")
@click.option(
    "--boot",
    "boot_instance",
    metavar="INSTANCE_ID",
    default=None,
    help="Print the whole boot log this instance published when its boot failed (from S3).",
)
@pass_ctx
def logs(
    obj: Context, job: str, follow: bool, since: str | None, instance: str | None, boot_instance: str | None
) -> None:
    """Print the job's log lines from CloudWatch Logs (or, with --boot, a failed boot's log)."""
    from petctl import jobs
    from petctl import logs as logs_mod

    if boot_instance is not None:
        text = jobs.boot_log(obj.gateway(), job, boot_instance)
        click.echo(text.decode("utf-8", "replace"), nl=False)
        return

    since_s = logs_mod.parse_duration(since) if since else None
    group = obj.profile.log_group or naming.log_group(obj.profile_name)
    gw = obj.gateway()
    # A killed job's lines stay readable; a job that never was is an error, like `status`.
    if jobs.find_job(gw, obj.profile_name, job) is None and not gw.logs.has_streams(group, f"{job}/"):
        raise NotFound(
            f"job {job!r} not found in profile {obj.profile_name!r}; `{cmd('jobs')}` lists the jobs"
        )
    printed = 0
    try:
        for ev in logs_mod.iter_events(
            gw.logs, group, job, since_seconds=since_s, instance=instance, follow=follow
        ):
            printed += 1
            click.echo(render.log_line(ev, obj.ui.json))
    except KeyboardInterrupt:
        raise Interrupted("interrupted") from None
    if not printed:
        click.echo(
            f"job {job} has no log lines "
            + (f"since {since}" if since else "in the last hour (--since 1d for more)"),
            err=True,
        )


@click.command()
@pass_ctx
def jobs(obj: Context) -> None:
    """The profile's jobs with their state and sizes."""
    from petctl import jobs as jobs_mod

    rows = [r.to_dict() for r in jobs_mod.list_jobs(obj.gateway(), obj.profile_name)]
    obj.ui.result(rows, render.jobs_table)


@click.command()
@job_argument
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
    from petctl import jobs
    from petctl import timeline as tl

    data = tl.build(jobs.observe(job, obj.gateway(), obj.profile_name).to_dict())
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
