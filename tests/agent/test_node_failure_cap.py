"""A job that trained and then keeps losing nodes to failures stops itself (node/churn.py).

Against a moto server, as the terminal-failure tests: the progress mark the agent's status thread
writes while steps move, failure records before and after it, and the cap that scales both groups
to zero and says why in the newest record (what ``petctl status`` shows).
"""

from __future__ import annotations

import time
from pathlib import Path

import boto3
from test_terminal_failure import _groups, _lifecycle
from test_terminal_failure import job as job  # noqa: F401 - a fixture, used by name

from petctl_agent import EXIT_TERMINAL
from petctl_agent.cloud.status import make_writer
from petctl_agent.node import churn, failure, markers
from petctl_agent.spec import JobSpec


def _record(spec: JobSpec, iid: str) -> str:
    key = f"petctl/jobs/bad/boot/{iid}.log"
    return (
        boto3.client("s3", region_name="us-east-1")
        .get_object(Bucket="petctl-bad", Key=key)["Body"]
        .read()
        .decode()
    )


def _progress(spec: JobSpec, step: int) -> None:
    """What the status thread does while the workers step: its refresh writes the mark."""
    mark = churn.ProgressMark(lambda: {"last_step": step}, make_writer(failure.boot_url(spec.status_url)), 0)
    assert mark() == {"last_step": step}


def test_failures_since_the_job_last_trained_stop_it_at_the_cap(job, tmp_path: Path) -> None:
    spec, ids = job
    spec = JobSpec.from_dict({**spec.to_dict(), "max_node_failures": 3})
    markers.mark(tmp_path / failure.WORKERS_MARKER, spec.run_id)  # the job trained: the old rule is out
    boot = failure.boot_url(spec.status_url)
    # two failures, then the job trains again: they are behind it
    for iid in ("i-early-1", "i-early-2"):
        make_writer(boot).write(f"{iid}.log", b"petctl agent: FAILED (exit 78): early\n")
    time.sleep(1.1)  # S3's LastModified has whole seconds
    _progress(spec, 40)
    assert churn.failures_since_progress(boot)[0] == 0
    time.sleep(1.1)
    for n, iid in enumerate(ids, 1):
        failure.failed_for_good(
            EXIT_TERMINAL,
            "cannot fetch the job code from s3://b/x.py: NoSuchKey",
            spec,
            _lifecycle(spec, iid),
            tmp_path,
        )
        assert churn.failures_since_progress(boot)[0] == n
        assert _groups() == (
            {"petctl-bad-workers": 3, "petctl-bad-rdzv": 1}
            if n < 3
            else {"petctl-bad-workers": 0, "petctl-bad-rdzv": 0}
        ), n
    why = _record(spec, ids[-1])
    assert why.startswith(
        "petctl agent: FAILED (exit 78): stopping the job: 3 node failures since it last trained at "
    )
    assert "--max-node-failures" in why and why.endswith(
        "this node: cannot fetch the job code from s3://b/x.py: NoSuchKey\n"
    )
    assert (
        _record(spec, ids[0])
        == "petctl agent: FAILED (exit 78): cannot fetch the job code from s3://b/x.py: NoSuchKey\n"
    )


def test_the_mark_moves_only_with_steps_and_at_most_once_per_interval(tmp_path: Path) -> None:
    writes: list[tuple[str, bytes]] = []

    class W:
        def write(self, name: str, body: bytes) -> None:
            writes.append((name, body))

    step = {"last_step": None}
    mark = churn.ProgressMark(lambda: dict(step), W(), interval=3600)
    mark()
    assert writes == []  # nothing trained yet
    step["last_step"] = 5
    mark()
    mark()
    step["last_step"] = 6
    mark()  # within the interval: no second PUT
    assert [n for n, _ in writes] == ["progress/mark"] and b'"step": 5' in writes[0][1]
    # a file-backed boot/ (the local cloud without S3) takes the sub-directory
    make_writer(str(tmp_path / "boot")).write(churn.MARK_NAME, b"{}")
    assert (tmp_path / "boot" / "progress" / "mark").read_bytes() == b"{}"
    assert failure.count_failures(str(tmp_path / "boot")) == 0  # the mark is no failure


def test_a_job_that_never_reported_a_step_is_not_stopped_by_the_cap(job, tmp_path: Path) -> None:
    """A script that does not call ckpt.step writes no mark: failures spread over its whole life
    must not stop it (its workers started, so the never-trained rule does not apply either)."""
    spec, ids = job
    spec = JobSpec.from_dict({**spec.to_dict(), "max_node_failures": 2})
    markers.mark(tmp_path / failure.WORKERS_MARKER, spec.run_id)
    for iid in ids:
        failure.failed_for_good(EXIT_TERMINAL, "rendezvous timed out", spec, _lifecycle(spec, iid), tmp_path)
    assert churn.failures_since_progress(failure.boot_url(spec.status_url)) == (0, None)
    assert _groups() == {"petctl-bad-workers": 3, "petctl-bad-rdzv": 1}
