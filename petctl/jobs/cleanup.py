"""``kill-job --delete-checkpoints``: delete a job's directory on the shared file system, through
the job's own access point, before its stack goes.

Nothing on the CLI's side can mount EFS, and the file system policy denies every mount without an
access point: only something inside the VPC, mounting through this job's access point, can delete
the job's files, and it then sees nothing of any other job. The job stack has a one-instance group
for it (``CleanupGroup``, desired 0; ``cfn_templates/user_data/cleanup.sh.j2``): once the workers
are gone, this sets it to 1, waits for its report under ``boot/cleanup/``, and sets it back to 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from petctl import naming
from petctl.context import Context
from petctl.errors import ConfigError, PetctlError, describe_client_error
from petctl.gateway import Gateway
from petctl.ui import cmd

#: The job stack resource that deletes checkpoints; stacks made before it have none.
CLEANUP_GROUP = "CleanupGroup"
#: A fresh small instance: boot, dnf install amazon-efs-utils, mount, delete, report.
REPORT_WAIT_S = 900.0


def check_possible(gw: Gateway, job: str, wait: bool) -> None:
    """Refuse, before anything is touched, a deletion that cannot happen."""
    if not wait:
        raise ConfigError("--delete-checkpoints waits for the deletion: it cannot go with --no-wait")
    if CLEANUP_GROUP not in gw.stacks.resource_ids(naming.job_stack(job)):
        raise PetctlError(
            f"job {job} was started by an earlier petctl: its stack cannot delete checkpoints (no "
            f"{CLEANUP_GROUP}); nothing was deleted. `{cmd('kill-job ' + job)}` keeps them; delete them "
            "through an access point of your own (docs/contracts.md, Shared file system)"
        )


def _reports(gw: Gateway, job: str) -> dict[str, dict[str, Any]]:
    prefix = naming.job_prefix(job) + "boot/cleanup/"
    found = {}
    for obj in gw.objects.listing(gw.bucket, prefix):
        raw = gw.objects.read(gw.bucket, obj["Key"])
        try:
            found[obj["Key"]] = json.loads(raw or b"{}")
        except ValueError:
            continue  # half-written or foreign: not a report
    return found


def delete_checkpoints(
    ctx: Context,
    gw: Gateway,
    job: str,
    sleep: Callable[[float], None] = time.sleep,
    wait_s: float = REPORT_WAIT_S,
) -> int:
    """Run the job's one-shot deletion and wait for its report; the number of entries it deleted
    from the job's directory. Raises (the stack is kept, so kill-job can be run again) when the
    deletion failed or did not report in time."""
    group = naming.cleanup_group(job)
    before = set(_reports(gw, job))
    ctx.ui.progress(f"deleting the checkpoints of {job} (a one-shot instance mounts its access point)")
    gw.groups.set_capacity(group, 1)
    report = None
    try:
        deadline = time.monotonic() + wait_s
        t0 = time.monotonic()
        while report is None:
            new = {k: v for k, v in _reports(gw, job).items() if k not in before}
            report = next(iter(new.values()), None)
            if report is not None:
                break
            if time.monotonic() > deadline:
                break
            ctx.ui.live(f"waiting for the checkpoint deletion ({time.monotonic() - t0:.0f}s)")
            sleep(5)
    finally:
        try:
            gw.groups.set_capacity(group, 0)
        except Exception as e:  # noqa: BLE001 - the stack deletion terminates it anyway
            ctx.ui.warn(f"could not scale {group} to zero ({describe_client_error(e)})")
    again = f"the job's stack is kept: run `{cmd('kill-job ' + job + ' --delete-checkpoints')}` again"
    if report is None:
        raise PetctlError(f"the checkpoint deletion of {job} did not report within {wait_s:.0f}s; {again}")
    if report.get("state") != "deleted":
        raise PetctlError(
            f"the checkpoint deletion of {job} failed on {report.get('instance_id')}: "
            f"{report.get('error') or 'no reason given'}; {again}"
        )
    return int(report.get("entries") or 0)
