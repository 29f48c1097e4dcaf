"""The warm pool model the local cloud adds to moto (petctl/local/moto_warm_pool.py), over HTTP.

No daemon, no process: a moto server with the local cloud's patches, driven through boto3 as
petctl drives AWS. The pool's instances boot as processes in tests/local/test_warm_pool.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

WORKERS = "petctl-wp-workers"


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    from petctl.local import moto_patches

    moto_patches.apply()
    # port 0: bound by the server itself (picked first, it could be taken before moto bound it,
    # and start() then waited for ever)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    server.stop()


def _client(url: str, name: str) -> Any:
    return boto3.session.Session(
        aws_access_key_id="petctl-local", aws_secret_access_key="petctl-local", region_name="us-east-1"
    ).client(name, endpoint_url=url)


def _template(subnet: str, pool: dict[str, Any]) -> str:
    """A worker group with a warm pool, shaped as the job template makes it."""
    return json.dumps(
        {
            "Parameters": {"WarmPoolSize": {"Type": "Number", "Default": "1"}},
            "Resources": {
                "WorkerLaunchTemplate": {
                    "Type": "AWS::EC2::LaunchTemplate",
                    "Properties": {
                        "LaunchTemplateData": {"ImageId": "ami-12c6146b", "InstanceType": "t3.medium"}
                    },
                },
                "WorkerGroup": {
                    "Type": "AWS::AutoScaling::AutoScalingGroup",
                    "Properties": {
                        "AutoScalingGroupName": WORKERS,
                        "MinSize": "0",
                        "MaxSize": "4",
                        "DesiredCapacity": "1",
                        "VPCZoneIdentifier": [subnet],
                        "LaunchTemplate": {
                            "LaunchTemplateId": {"Ref": "WorkerLaunchTemplate"},
                            "Version": {"Fn::GetAtt": ["WorkerLaunchTemplate", "LatestVersionNumber"]},
                        },
                        "Tags": [{"Key": "petctl:role", "Value": "worker", "PropagateAtLaunch": True}],
                    },
                },
                "WorkerWarmPool": {
                    "Type": "AWS::AutoScaling::WarmPool",
                    "Properties": {"AutoScalingGroupName": {"Ref": "WorkerGroup"}, **pool},
                },
            },
        }
    )


def _stack(moto: str, name: str, pool: dict[str, Any]) -> tuple[Any, Any, Any]:
    ec2, asg, cfn = (_client(moto, n) for n in ("ec2", "autoscaling", "cloudformation"))
    vpc = ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.77.0/24", AvailabilityZone="us-east-1a")
    cfn.create_stack(StackName=name, TemplateBody=_template(subnet["Subnet"]["SubnetId"], pool))
    return ec2, asg, cfn


def _pool(asg: Any) -> dict[str, str]:
    res = asg.describe_warm_pool(AutoScalingGroupName=WORKERS)
    return {i["InstanceId"]: i["LifecycleState"] for i in res["Instances"]}


def _ec2_state(ec2: Any, iid: str) -> str:
    return ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_cloudformation_pool_boots_stops_and_serves_a_scale_out(moto: str) -> None:
    from petctl.local.moto_warm_pool import mark_warmed

    pool_props = {"MinSize": {"Ref": "WarmPoolSize"}, "MaxGroupPreparedCapacity": {"Ref": "WarmPoolSize"}}
    ec2, asg, cfn = _stack(moto, "wp-abs", pool_props)
    config = asg.describe_warm_pool(AutoScalingGroupName=WORKERS)["WarmPoolConfiguration"]
    assert config["MinSize"] == 1 and config["PoolState"] == "Stopped"

    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[WORKERS])["AutoScalingGroups"][0]
    (member,) = [i["InstanceId"] for i in group["Instances"]]
    assert group["DesiredCapacity"] == 1  # the pool is not counted
    ((warm, state),) = _pool(asg).items()
    assert state == "Warmed:Pending" and warm != member and _ec2_state(ec2, warm) == "running"
    tags = {
        t["Key"]: t["Value"]
        for t in ec2.describe_tags(Filters=[{"Name": "resource-id", "Values": [warm]}])["Tags"]
    }
    assert tags["aws:autoscaling:groupName"] == WORKERS and tags["petctl:role"] == "worker"
    lifecycle = {
        i["InstanceId"]: i["LifecycleState"]
        for i in asg.describe_auto_scaling_instances(InstanceIds=[member, warm])["AutoScalingInstances"]
    }
    assert lifecycle == {member: "InService", warm: "Warmed:Pending"}

    # Booted: AWS stops it.
    assert mark_warmed(warm, "us-east-1") == "Warmed:Stopped"
    assert _pool(asg) == {warm: "Warmed:Stopped"} and _ec2_state(ec2, warm) == "stopped"
    assert mark_warmed(member, "us-east-1") is None  # not a pool instance

    # A scale-out by one takes the pool instance (started again) and the pool refills.
    asg.set_desired_capacity(AutoScalingGroupName=WORKERS, DesiredCapacity=2)
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[WORKERS])["AutoScalingGroups"][0]
    assert sorted(i["InstanceId"] for i in group["Instances"]) == sorted([member, warm])
    assert _ec2_state(ec2, warm) == "running"
    ((refill, state),) = _pool(asg).items()
    assert refill not in (member, warm) and state == "Warmed:Pending"

    # Scale-in terminates (no InstanceReusePolicy); the absolute pool keeps its one instance.
    asg.set_desired_capacity(AutoScalingGroupName=WORKERS, DesiredCapacity=1)
    assert list(_pool(asg)) == [refill]

    # Deleting the stack ends the pool's instances with the group.
    cfn.delete_stack(StackName="wp-abs")
    assert _ec2_state(ec2, refill) == "terminated"


def test_pool_size_follows_aws_rule(moto: str) -> None:
    """Without MaxGroupPreparedCapacity the pool is MaxSize - DesiredCapacity (at least MinSize)."""
    ec2, asg, cfn = _stack(moto, "wp-dyn", {"MinSize": 1})
    assert len(_pool(asg)) == 3  # max 4 - desired 1
    asg.set_desired_capacity(AutoScalingGroupName=WORKERS, DesiredCapacity=3)
    assert len(_pool(asg)) == 1  # 4 - 3 = 1, also MinSize
    asg.set_desired_capacity(AutoScalingGroupName=WORKERS, DesiredCapacity=4)
    assert len(_pool(asg)) == 1  # MinSize holds
    asg.delete_warm_pool(AutoScalingGroupName=WORKERS)
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[WORKERS])["AutoScalingGroups"][0]
    assert len(group["Instances"]) == 4
    cfn.delete_stack(StackName="wp-dyn")


def test_terminating_a_pool_instance_refills_the_pool(moto: str) -> None:
    ec2, asg, cfn = _stack(moto, "wp-term", {"MinSize": 1, "MaxGroupPreparedCapacity": 1})
    (warm,) = _pool(asg)
    asg.terminate_instance_in_auto_scaling_group(InstanceId=warm, ShouldDecrementDesiredCapacity=False)
    assert _ec2_state(ec2, warm) == "terminated"
    (new,) = _pool(asg)
    assert new != warm
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[WORKERS])["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 1 and len(group["Instances"]) == 1
    cfn.delete_stack(StackName="wp-term")


def test_reuse_on_scale_in_is_refused_not_ignored(moto: str) -> None:
    ec2, asg, cfn = _stack(moto, "wp-reuse", {"MinSize": 1, "InstanceReusePolicy": {"ReuseOnScaleIn": False}})
    with pytest.raises(asg.exceptions.ClientError, match="ReuseOnScaleIn=true is not emulated"):
        asg.put_warm_pool(
            AutoScalingGroupName=WORKERS, MinSize=1, InstanceReusePolicy={"ReuseOnScaleIn": True}
        )
    cfn.delete_stack(StackName="wp-reuse")


@pytest.mark.parametrize(
    ("group", "lt", "why"),
    [
        (
            {
                "MixedInstancesPolicy": {
                    "LaunchTemplate": {
                        "LaunchTemplateSpecification": {
                            "LaunchTemplateId": {"Ref": "WorkerLaunchTemplate"},
                            "Version": {"Fn::GetAtt": ["WorkerLaunchTemplate", "LatestVersionNumber"]},
                        },
                        "Overrides": [{"InstanceType": "t3.medium"}, {"InstanceType": "t3a.medium"}],
                    }
                }
            },
            {},
            "mixed instances policy",
        ),
        ({}, {"InstanceMarketOptions": {"MarketType": "spot"}}, "requests Spot Instances"),
    ],
)
def test_a_pool_on_a_mixed_or_spot_group_is_refused_as_aws_does(moto: str, group, lt, why) -> None:
    """AWS PutWarmPool refuses both; moto alone accepted them, so a template that made one would
    have passed every local test and failed on AWS."""
    ec2, asg, cfn = (_client(moto, n) for n in ("ec2", "autoscaling", "cloudformation"))
    body = json.loads(_template("subnet-x", {"MinSize": 1}))
    res = body["Resources"]
    res["WorkerLaunchTemplate"]["Properties"]["LaunchTemplateData"].update(lt)
    if group:
        del res["WorkerGroup"]["Properties"]["LaunchTemplate"]
        res["WorkerGroup"]["Properties"].update(group)
    vpc = ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.78.0/24", AvailabilityZone="us-east-1a")
    res["WorkerGroup"]["Properties"]["VPCZoneIdentifier"] = [subnet["Subnet"]["SubnetId"]]
    del res["WorkerWarmPool"]
    cfn.create_stack(StackName="wp-refused", TemplateBody=json.dumps(body))
    with pytest.raises(asg.exceptions.ClientError, match=why):
        asg.put_warm_pool(AutoScalingGroupName=WORKERS, MinSize=1)
    cfn.delete_stack(StackName="wp-refused")
