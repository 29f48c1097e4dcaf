"""The size hint's fresh read reaches the Auto Scaling API: the agent's
``CapacityHint`` caches DescribeAutoScalingGroups for 5 s, so the leader's re-read of a hint that
expects no growth while newcomers are ready must ask the source, not the cache; and it is
rate-limited (one read at a time, ``min_interval`` apart) so no number of callers storms the
account's Auto Scaling API. Against the moto server over HTTP (the local cloud's patches), and
a real etcd for the rendezvous."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest
from botocore.exceptions import ParamValidationError
from test_rendezvous import Group

from petctl_agent.cloud import aws
from petctl_agent.cloud.imds import Imds
from petctl_agent.node.lifecycle import CapacityHint, Lifecycle
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec

GROUP = "petctl-j-1-workers"


def _group(size: int) -> Lifecycle:
    """A worker group of ``size`` on the moto server, and a node's Lifecycle in it."""
    ec2, asg = aws.client("ec2"), aws.client("autoscaling")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(
        LaunchTemplateName="lt", LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.medium"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    asg.create_auto_scaling_group(
        AutoScalingGroupName=GROUP,
        LaunchTemplate={"LaunchTemplateId": template},
        MinSize=0,
        MaxSize=32,
        DesiredCapacity=size,
        VPCZoneIdentifier=subnet,
    )
    spec = JobSpec.from_dict(
        {"job_name": "j-1", "min_nodes": 2, "max_nodes": 32, "code_url": "file:///x.py", "script": "x.py",
         "worker_group": GROUP}
    )  # fmt: skip
    return Lifecycle(spec, Imds("http://127.0.0.1:9"), Settings(), "i-hint")


def _set_desired(n: int) -> None:
    aws.client("autoscaling").set_desired_capacity(AutoScalingGroupName=GROUP, DesiredCapacity=n)


def _until(cond: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_fresh_read_sees_a_new_desired_capacity_the_cache_does_not(moto_endpoint: str) -> None:
    lc = _group(2)
    hint = CapacityHint(lambda: lc.capacity(instances=False), max_age=60)
    hint()
    _until(lambda: hint.value is not None, 10)
    assert hint() == 2
    _set_desired(5)
    since = time.monotonic()
    # the cached read: 2 for max_age (60 s here, 5 s in the agent), and no read of the source
    reads = hint.reads
    for _ in range(20):
        assert hint() == 2
    assert hint.reads == reads
    # the fresh read reaches the source: a read that began after `since` sees 5
    done, value = hint.fresh(since)
    assert (done, value) == (False, 2)
    _until(lambda: hint.fresh(since)[0], 10)
    assert hint.fresh(since) == (True, 5)
    assert hint() == 5
    assert lc.capacity(instances=False) == {"desired": 5, "in_service": 0, "pending": 0}


def test_a_botocore_without_include_instances_still_reads_the_capacity(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """setup.py admits boto3>=1.34, whose botocore may predate DescribeAutoScalingGroups'
    ``IncludeInstances``: botocore then refuses the call before any request (ParamValidationError),
    and the hint, which swallows a failed read, stayed None for the whole job. A real client
    against the moto server, its model without the parameter (as such a botocore's is)."""
    lc = _group(3)
    client = aws.client("autoscaling")
    members = client.meta.service_model.operation_model("DescribeAutoScalingGroups").input_shape.members
    monkeypatch.delitem(members, "IncludeInstances")
    with pytest.raises(ParamValidationError):  # what the old botocore does with it
        client.describe_auto_scaling_groups(AutoScalingGroupNames=[GROUP], IncludeInstances=False)
    monkeypatch.setattr(lc, "_autoscaling", lambda: client)
    assert lc.capacity(instances=False)["desired"] == 3
    assert lc.capacity()["desired"] == 3


def test_reads_of_the_source_are_rate_limited(moto_endpoint: str) -> None:
    """Callers asking for a fresh read 200 times a second for 2.5 s (every one newer than the last
    read) get at most one read of the source per ``min_interval``: 3-4 reads, not hundreds."""
    lc = _group(2)
    calls: list[float] = []

    def probe() -> dict[str, int] | None:
        calls.append(time.monotonic())
        return lc.capacity(instances=False)

    hint = CapacityHint(probe, max_age=5.0, min_interval=1.0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:
        hint.fresh(time.monotonic())
        hint()
        time.sleep(0.005)
    _until(lambda: not hint._busy.locked(), 5)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert 2 <= len(calls) <= 4, calls
    assert min(gaps) >= 0.99, gaps


class _Failing:
    def __call__(self) -> dict[str, int]:
        raise RuntimeError("Rate exceeded")


def test_a_failed_read_is_not_fresh_and_is_not_retried_before_max_age() -> None:
    """A read that failed (throttled, the API down) is no fresh answer (the leader opens with
    what it has after HINT_FRESH_WAIT), and a leader asking again and again does not spend a
    throttled account's bucket: the next read of the source waits ``max_age``, as a routine one."""
    hint = CapacityHint(_Failing(), max_age=1.5, min_interval=0.1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.2:  # every 5 ms, each asking for a read newer than the last
        assert hint.fresh(time.monotonic()) == (False, None)
        time.sleep(0.005)
    _until(lambda: not hint._busy.locked(), 5)
    assert hint.reads == 1  # was 11-12: one read per min_interval for as long as it was asked
    _until(lambda: hint.fresh(time.monotonic()) == (False, None) and hint.reads == 2, 5)  # after max_age


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")
def test_a_scale_up_seen_only_by_the_api_is_one_round(
    group: Callable[..., Group], moto_endpoint: str
) -> None:
    """8 nodes run, each with the agent's hint: a CapacityHint over the worker group on the moto
    server (a cache that would hold 8 for the whole test). DesiredCapacity goes to 16 on the API
    just before 8 newcomers become ready over 3 s. The leader's fresh read reaches the API: one
    round of 16, and no running node stalls for the spread. Before, the re-read returned the
    cache's 8, so the first newcomer opened a round alone (a restart for everyone, then another:
    3 rounds here)."""
    n0, n1, spread = 8, 16, 3.0
    lc = _group(n0)
    g = group(4, 16)

    def hint() -> CapacityHint:
        # max_age 60: only a fresh read can see the scale-out within this test
        h = CapacityHint(lambda: lc.capacity(instances=False), max_age=60)
        h()
        return h

    old = [g.new(expected=hint()) for _ in range(n0)]
    g.rendezvous(*old, timeout=15)
    start_round = old[0].round
    time.sleep(1.5)  # running: every hint has read 8
    assert {h.expected_nodes.value for h in old} == {n0}
    _set_desired(n1)
    new, stalls, _ = g.scale_up(old, n1 - n0, spread, lambda: g.new(expected=hint()))
    rounds = old[0].round - start_round
    opened = [e for h in old for _, e in h.events if e.startswith(("opened round", "closed round"))]
    reads = sum(h.expected_nodes.reads for h in old + new)
    print(f"scale-up 8 -> 16 seen only by the API: {rounds} rounds, {reads} reads: {opened}")
    assert rounds == 1, f"{rounds} rounds for a scale-up the API shows: {opened}"
    assert max(stalls) < 2.0
    # one read per hint at its start, plus the leader's fresh read(s): no storm
    assert reads <= n1 + 3, reads
