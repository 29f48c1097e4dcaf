"""Warm pools in the local cloud, with a real daemon: pool instances boot through their user data,
are paused (SIGSTOP) once their agent reports WARMED, and a scale-out resumes one instead of
booting a new instance. The agent is the stand-in (tests/local/standin.py), which does what the
agent does in a pool; bench/bench_warm_pool.py runs the real agent."""

from __future__ import annotations

import json

from localcloud_helpers import Cloud, wait_for

from petctl.local import procs


def _pool(cloud: Cloud, group: str) -> dict[str, str]:
    res = cloud.asg.describe_warm_pool(AutoScalingGroupName=group)
    return {i["InstanceId"]: i["LifecycleState"] for i in res["Instances"]}


def _stopped(pid: int) -> bool:
    """The process and every descendant are stopped (state T in /proc)."""
    return all(_proc_state(p) == "T" for p in [pid, *procs.descendants(pid)])


def _proc_state(pid: int) -> str | None:
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[0]


def test_scale_out_takes_the_paused_pool_instance_and_the_pool_refills(cloud: Cloud) -> None:
    job = cloud.make_job("warm", workers=1, warm_pool=1)
    group = job["groups"]["workers"]
    (first,) = wait_for(lambda: cloud.running("warm"), what="the group's worker")

    # The pool instance boots like any instance, then is stopped: in moto and here.
    (warm,) = _pool(cloud, group)
    assert warm != first["instance_id"]
    wait_for(lambda: _pool(cloud, group) == {warm: "Warmed:Stopped"}, timeout=30, what="Warmed:Stopped")
    assert cloud.ec2_state(warm) == "stopped"
    inst = wait_for(lambda: (i := cloud.instance(warm)) and i["paused"] and i, what="paused tree")
    assert inst["warm"] == "Warmed:Stopped" and inst["lifecycle_state"] == "Warmed:Stopped"
    assert inst["boot"]["state"] == "done" and inst["state"] == "running"
    assert wait_for(lambda: _stopped(inst["pid"]), what="the agent stopped")
    assert cloud.imds(warm, "meta-data/autoscaling/target-lifecycle-state") == (200, "Warmed:Stopped")
    status = cloud.s3.get_object(Bucket="petctl-local-test", Key=f"petctl/jobs/warm/status/{warm}.json")
    assert json.loads(status["Body"].read())["state"] == "WARMED"
    assert cloud.standin(warm) is None  # it never joined
    groups = cloud.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]
    assert groups[0]["DesiredCapacity"] == 1 and cloud.group_instances(group) == [first["instance_id"]]

    # Scale out by one: the pool instance is resumed (not a new boot) and joins.
    cloud.asg.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=2)
    assert cloud.group_instances(group) == sorted([first["instance_id"], warm])
    joined = wait_for(lambda: cloud.standin(warm), timeout=15, what="the pool instance joins")
    assert joined["env"]["PETCTL_IMDS_URL"].endswith(warm)
    after = cloud.instance(warm)
    assert not after["paused"] and after["warm"] is None and after["lifecycle_state"] == "InService"
    assert after["started_at"] == inst["started_at"]  # the same boot, resumed
    assert cloud.imds(warm, "meta-data/autoscaling/target-lifecycle-state") == (200, "InService")
    assert cloud.ec2_state(warm) == "running"

    # The pool refills with a new instance, which is paused in turn.
    (refill,) = wait_for(lambda: [i for i in _pool(cloud, group) if i != warm], what="refill")
    wait_for(lambda: _pool(cloud, group) == {refill: "Warmed:Stopped"}, timeout=30, what="refill stopped")
    wait_for(lambda: cloud.instance(refill)["paused"], what="refill paused")

    # Scale-in terminates (no InstanceReusePolicy); deleting the group ends the paused pool instance too.
    cloud.asg.delete_auto_scaling_group(AutoScalingGroupName=group, ForceDelete=True)
    for iid in (first["instance_id"], warm, refill):
        wait_for(lambda iid=iid: cloud.instance(iid)["state"] == "terminated", timeout=20, what=f"{iid} gone")
        assert not cloud.instance(iid)["alive"]
