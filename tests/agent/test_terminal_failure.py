"""A terminal agent failure is not restarted by systemd and counts like a failed boot.

Classification (which failures are terminal, and their exit statuses), then the accounting against
a moto server (boot/ records, SetInstanceHealth, three failures with no workers ever started scale
the job's groups to zero), then the launch action a failure before parking abandons (a Stubber:
moto cannot hold a pending launch action).
"""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from petctl_agent import DRAIN_EXIT_CODE, EXIT_FAILED, EXIT_JOIN_TIMEOUT, EXIT_TERMINAL, TERMINAL_EXITS
from petctl_agent.cloud.imds import Imds
from petctl_agent.node import failure, markers
from petctl_agent.node.ending import SUCCESS_MARKER
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec


def test_exit_statuses_are_classified() -> None:
    assert (EXIT_TERMINAL, EXIT_JOIN_TIMEOUT) == (78, 79) and TERMINAL_EXITS == (78, 79)
    assert failure.exit_status("spec") == failure.exit_status("torch") == EXIT_TERMINAL
    assert failure.exit_status("workers") == EXIT_TERMINAL
    assert failure.exit_status("join_timeout") == EXIT_JOIN_TIMEOUT
    assert failure.exit_status("crash") == EXIT_FAILED == 1  # a restart may cure it
    assert [rc for rc in (0, 1, 2, DRAIN_EXIT_CODE, 78, 79, 143) if failure.is_terminal(rc)] == [78, 79]
    assert failure.boot_url("s3://b/petctl/jobs/j/status/") == "s3://b/petctl/jobs/j/boot/"
    assert failure.boot_url("file:///x/status") == "file:///x/boot/" and failure.boot_url("") == ""


def _spec(bucket: str, run_id: str = "run-2") -> JobSpec:
    return JobSpec.from_dict(
        {
            "run_id": run_id,
            "job_name": "bad",
            "min_nodes": 1,
            "max_nodes": 3,
            "code_url": "x.py",
            "script": "x.py",
            "status_url": f"s3://{bucket}/petctl/jobs/bad/status/",
            "worker_group": "petctl-bad-workers",
            "rdzv_group": "petctl-bad-rdzv",
        }
    )


@pytest.fixture
def job(moto_endpoint: str) -> tuple[JobSpec, list[str]]:
    s3, ec2, asg = (boto3.client(s, region_name="us-east-1") for s in ("s3", "ec2", "autoscaling"))
    s3.create_bucket(Bucket="petctl-bad")
    s3.put_object(Bucket="petctl-bad", Key="petctl/jobs/bad/boot/events/i-other.json", Body=b"{}")
    lt = ec2.create_launch_template(
        LaunchTemplateName="bad-lt",
        LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"},
    )["LaunchTemplate"]["LaunchTemplateId"]
    for name, n in (("petctl-bad-workers", 3), ("petctl-bad-rdzv", 1)):
        asg.create_auto_scaling_group(
            AutoScalingGroupName=name,
            LaunchTemplate={"LaunchTemplateId": lt},
            MinSize=n,
            MaxSize=3,
            DesiredCapacity=n,
            AvailabilityZones=["us-east-1a"],
        )
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["petctl-bad-workers"])[
        "AutoScalingGroups"
    ][0]
    return _spec("petctl-bad"), [i["InstanceId"] for i in group["Instances"]]


def _groups() -> dict[str, int]:
    asg = boto3.client("autoscaling", region_name="us-east-1")
    got = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["petctl-bad-workers", "petctl-bad-rdzv"])
    return {g["AutoScalingGroupName"]: g["DesiredCapacity"] for g in got["AutoScalingGroups"]}


def _health(iid: str) -> str:
    asg = boto3.client("autoscaling", region_name="us-east-1")
    return asg.describe_auto_scaling_instances(InstanceIds=[iid])["AutoScalingInstances"][0]["HealthStatus"]


def _lifecycle(spec: JobSpec, iid: str) -> Lifecycle:
    return Lifecycle(spec, Imds("http://127.0.0.1:9", timeout=0.2), Settings(), iid)


def test_three_terminal_failures_stop_a_job_that_never_trained(job, tmp_path: Path) -> None:
    spec, ids = job
    for n, iid in enumerate(ids, 1):
        failure.failed_for_good(EXIT_TERMINAL, "rendezvous backend 'bogus' is not one of ...\nmore", spec,
                                _lifecycle(spec, iid), tmp_path)  # fmt: skip
        if n < 3:  # (the third one's group went to zero: moto drops its instances at once)
            assert _health(iid).upper() == "UNHEALTHY"  # its group replaces it
        assert _groups() == (
            {"petctl-bad-workers": 3, "petctl-bad-rdzv": 1}
            if n < 3
            else {"petctl-bad-workers": 0, "petctl-bad-rdzv": 0}
        ), n
    body = boto3.client("s3").get_object(Bucket="petctl-bad", Key=f"petctl/jobs/bad/boot/{ids[0]}.log")[
        "Body"
    ]
    # one line, as `petctl status` and `petctl logs --boot` read it
    assert (
        body.read().decode()
        == "petctl agent: FAILED (exit 78): rendezvous backend 'bogus' is not one of ...\n"
    )


@pytest.mark.parametrize("marker", [failure.WORKERS_MARKER, SUCCESS_MARKER])
def test_failures_after_the_job_trained_do_not_stop_it(job, tmp_path: Path, marker: str) -> None:
    """A late node's join timeout while the others train is no "every node keeps failing"."""
    spec, ids = job
    markers.mark(tmp_path / marker, "run-1")  # an earlier run's, replaced by this run's below
    markers.mark(tmp_path / marker, spec.run_id)
    assert (tmp_path / marker).read_text() == "run-2\n" and [p.name for p in tmp_path.iterdir()] == [marker]
    for iid in ids:
        failure.failed_for_good(
            EXIT_JOIN_TIMEOUT, "rendezvous timed out", spec, _lifecycle(spec, iid), tmp_path
        )
        assert _health(iid).upper() == "UNHEALTHY"
    assert _groups() == {"petctl-bad-workers": 3, "petctl-bad-rdzv": 1}
    assert failure.count_failures(failure.boot_url(spec.status_url)) == 3  # boot/events/ not counted


@pytest.mark.parametrize(("run_id", "stale"), [("run-2", "run-1"), ("run-2", ""), ("", ""), ("", "run-1")])
def test_markers_of_an_earlier_run_do_not_keep_a_failing_rerun_alive(
    job, tmp_path: Path, run_id: str, stale: str
) -> None:
    """The checkpoint dir, and the markers in it, outlive a run of the job's name; boot/ does not.
    A rerun whose every node fails for good still stops at the third failure: a marker written by
    an earlier run (or by an older agent, empty) is not this run's, and a spec without a run id
    (an older petctl) is an unknown run, which no marker keeps alive."""
    _, ids = job
    spec = _spec("petctl-bad", run_id)
    for m in (failure.WORKERS_MARKER, SUCCESS_MARKER):
        (tmp_path / m).write_text(stale + "\n" if stale else "")
    assert not failure.workers_ever_started(tmp_path, spec.run_id)
    for n, iid in enumerate(ids, 1):
        failure.failed_for_good(EXIT_TERMINAL, "torch 2.0.0 is not the pinned 2.13.0", spec,
                                _lifecycle(spec, iid), tmp_path)  # fmt: skip
        assert _groups() == (
            {"petctl-bad-workers": 3, "petctl-bad-rdzv": 1}
            if n < 3
            else {"petctl-bad-workers": 0, "petctl-bad-rdzv": 0}
        ), n


def test_a_failure_before_parking_abandons_the_launch_action(tmp_path: Path, monkeypatch) -> None:
    spec = JobSpec.from_dict({**_spec("x").to_dict(), "status_url": ""})
    lifecycle = Lifecycle(
        spec, Imds("http://127.0.0.1:9", timeout=0.2), Settings(launch_hook="petctl-launch"), "i-1"
    )
    client = boto3.client(
        "autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    monkeypatch.setattr(lifecycle, "_autoscaling", lambda: client)
    with Stubber(client) as stub:
        stub.add_response(
            "complete_lifecycle_action",
            {},
            {
                "LifecycleHookName": "petctl-launch",
                "AutoScalingGroupName": "petctl-bad-workers",
                "LifecycleActionResult": "ABANDON",
                "InstanceId": "i-1",
            },
        )
        stub.add_response(
            "set_instance_health",
            {},
            {"InstanceId": "i-1", "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": False},
        )
        failure.failed_for_good(EXIT_TERMINAL, "torch 2.0 is installed but ...", spec, lifecycle, None)
        stub.assert_no_pending_responses()
        assert lifecycle.launch_done.is_set()
        # completed already (parked, or in service): only the health call, no second completion
        stub.add_response(
            "set_instance_health",
            {},
            {"InstanceId": "i-1", "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": False},
        )
        failure.failed_for_good(EXIT_JOIN_TIMEOUT, "rendezvous timed out", spec, lifecycle, None)
        stub.assert_no_pending_responses()


def test_a_success_marker_of_an_earlier_run_is_no_success_of_this_one(tmp_path: Path) -> None:
    """A closed rendezvous reads as "the job succeeded" only when this run's marker says so
    (node/ending.py); a spec without a run id keeps the old rule (the marker exists)."""
    from petctl_agent.node.ending import _succeeded_before

    marker = tmp_path / SUCCESS_MARKER
    assert not _succeeded_before(marker, "run-2") and not _succeeded_before(marker, "")
    markers.mark(marker, "run-1")
    assert not _succeeded_before(marker, "run-2") and _succeeded_before(marker, "run-1")
    assert _succeeded_before(marker, "")
    markers.mark(marker, "run-2")
    assert _succeeded_before(marker, "run-2") and not _succeeded_before(marker, "run-1")
