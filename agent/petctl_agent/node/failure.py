"""A terminal agent failure counts like a failed boot (docs/contracts.md, "Agent exit statuses").

An agent that exits with a status of ``TERMINAL_EXITS`` is not restarted by systemd (the unit's
``RestartPreventExitStatus=``). Left at that, its instance would idle and bill until ``kill-job``;
so before exiting it does what a failed boot script does (``boot_failed`` in
``cfn_templates/user_data/common.sh.j2``):

1. records the failure where failed boots are counted: ``boot/<instance-id>.log`` next to the
   job's ``status/`` (one line: ``petctl agent: FAILED (exit N): <reason>``, which ``petctl
   status`` reads as the error line and ``petctl logs JOB --boot ID`` prints);
2. when ``boot/`` then holds ``GIVE_UP_AFTER`` records and no node of this run ever started its
   workers (no ``WORKERS_MARKER``/``SUCCESS_MARKER`` of the spec's ``run_id`` in the job's
   checkpoint dir, ``node/markers.py``: the dir and its markers outlive a run, ``boot/`` does
   not), or ``max_node_failures`` records newer than the job's last training progress
   (``node/churn.py``), scales the job's groups to zero and deletes the warm pool, and says why in
   this node's record: every node keeps failing;
3. abandons a pending launch action (the group replaces the instance);
4. marks the instance ``Unhealthy``, so its group replaces it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlparse

from petctl_agent import EXIT_JOIN_TIMEOUT, EXIT_TERMINAL, TERMINAL_EXITS
from petctl_agent.cloud import aws
from petctl_agent.cloud.status import make_writer
from petctl_agent.node import churn, markers
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.spec import JobSpec

log = logging.getLogger("petctl_agent")

#: As the boot scripts' GIVE_UP_AFTER: this many failed boots (or terminal agent failures) of a
#: job whose workers never started, and the job's groups scale to zero.
GIVE_UP_AFTER = 3
#: In the job's checkpoint dir once any node of a run started its workers, holding the run's id:
#: failures of that run after that are not "every node keeps failing" (a late node's join
#: timeout while the others train).
WORKERS_MARKER = markers.WORKERS_MARKER


def exit_status(kind: str) -> int:
    """The exit status of a failure ``kind``: ``spec`` (a bad spec or setting), ``torch`` (the
    wrong torch), ``requirements`` (the job's packages did not install), ``workers`` (the job's
    workers failed for good), ``agent_failures`` (the agent ended unclean too often on this
    instance, node/crashes.py), ``join_timeout`` (terminal);
    anything else (a crash) is 1, which systemd restarts."""
    if kind == "join_timeout":
        return EXIT_JOIN_TIMEOUT
    if kind in ("spec", "torch", "requirements", "workers", "agent_failures"):
        return EXIT_TERMINAL
    return 1


def is_terminal(rc: int) -> bool:
    """Whether systemd must not restart an agent that exited with ``rc``."""
    return rc in TERMINAL_EXITS


def boot_url(status_url: str) -> str:
    """``boot/``, the sibling of the spec's ``status/`` (``s3://b/petctl/jobs/j/status/`` ->
    ``s3://b/petctl/jobs/j/boot/``); empty without a status URL."""
    if not status_url:
        return ""
    return status_url.rstrip("/").rsplit("/", 1)[0] + "/boot/"


def count_failures(url: str, region: str | None = None) -> int:
    """Failed boots and terminal agent failures of the job: the objects directly under ``boot/``
    (not ``boot/events/``), as the boot scripts count them."""
    u = urlparse(url)
    if u.scheme == "s3":
        prefix = u.path.lstrip("/")
        pages = aws.client("s3", region).get_paginator("list_objects_v2")
        return sum(
            len(page.get("Contents", []))
            for page in pages.paginate(Bucket=u.netloc, Prefix=prefix, Delimiter="/")
        )
    d = Path(u.path if u.scheme == "file" else url)
    return sum(1 for p in d.iterdir() if p.is_file() and not p.name.startswith(".")) if d.is_dir() else 0


def workers_ever_started(ckpt_dir: Path | None, run_id: str) -> bool:
    """Whether a node of the run ``run_id`` started its workers (or saw them succeed). A marker
    of another run of the same job name does not count, nor any for an unknown (empty) run id:
    then the failure counts, as the boot scripts count failed boots of this run."""
    if ckpt_dir is None:
        return False
    return any(markers.of_run(ckpt_dir / m, run_id) for m in (WORKERS_MARKER, markers.SUCCESS_MARKER))


def failed_for_good(rc: int, reason: str, spec: JobSpec, lifecycle: Lifecycle, ckpt_dir: Path | None) -> None:
    """Steps 1-4 above, each best effort: a step that fails must not hide the failure."""
    url = boot_url(spec.status_url)
    first = reason.splitlines()[0] if reason else "unknown"
    line = f"petctl agent: FAILED (exit {rc}): {first}\n"
    if url:
        try:
            writer = make_writer(url)
            writer.write(f"{lifecycle.instance_id}.log", line.encode())
            failures = count_failures(url, spec.region or None)
            since, mark = churn.failures_since_progress(url, spec.region or None)
            log.info("%d failed boots or agents in %s, %d since the job last trained", failures, url, since)
            why = ""
            if failures >= GIVE_UP_AFTER and not workers_ever_started(ckpt_dir, spec.run_id):
                log.error(
                    "%d nodes of job %s failed and none ever started its workers: stopping the job",
                    failures,
                    spec.job_name,
                )
                lifecycle.scale_groups_to_zero()  # status says why: every boot failed (its records)
            elif since >= spec.max_node_failures:
                why = (
                    f"{since} node failures since it last trained at {mark:%Y-%m-%d %H:%M:%S} UTC "
                    f"(the cap, --max-node-failures, is {spec.max_node_failures})"
                )
            if why:
                log.error("%s: stopping the job", why)
                # the job's reason in `petctl status`: this record is the newest one
                writer.write(
                    f"{lifecycle.instance_id}.log",
                    f"petctl agent: FAILED (exit {rc}): stopping the job: {why}; this node: {first}\n".encode(),
                )
                lifecycle.scale_groups_to_zero()
        except Exception as e:  # noqa: BLE001
            log.warning("could not record the failure in %s (ignored): %s", url, e)
    if not lifecycle.launch_done.is_set():
        lifecycle.complete_launch("ABANDON")
    lifecycle.set_unhealthy()
