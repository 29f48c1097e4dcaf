"""Lifecycle hooks declared on a group, as the local cloud's patch gives them to moto
(petctl/local/moto_hooks.py); the job template's own hooks: tests/unit/test_templates_moto.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest

DRAIN = {
    "LifecycleHookName": "petctl-drain",
    "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
    "DefaultResult": "CONTINUE",
    "HeartbeatTimeout": 120,
}


@pytest.fixture
def asg(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from moto import mock_aws

    from petctl.local import moto_hooks

    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto_hooks.apply()
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.9.0.0/24")["Subnet"]["SubnetId"]
        ec2.create_launch_template(
            LaunchTemplateName="lt-hooks",
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.small"},
        )
        client = boto3.client("autoscaling", region_name="us-east-1")
        client.petctl_subnet = subnet
        yield client


def _create(asg: Any, hooks: list[dict[str, Any]], name: str = "g") -> None:
    asg.create_auto_scaling_group(
        AutoScalingGroupName=name,
        MinSize=0,
        MaxSize=2,
        DesiredCapacity=1,
        LaunchTemplate={"LaunchTemplateName": "lt-hooks", "Version": "$Latest"},
        VPCZoneIdentifier=asg.petctl_subnet,
        LifecycleHookSpecificationList=hooks,
    )


def _hooks(asg: Any, name: str = "g") -> dict[str, tuple[str, str, int]]:
    return {
        h["LifecycleHookName"]: (h["LifecycleTransition"], h["DefaultResult"], h["HeartbeatTimeout"])
        for h in asg.describe_lifecycle_hooks(AutoScalingGroupName=name)["LifecycleHooks"]
    }


def test_a_groups_declared_hooks_exist_with_it_and_only_they(asg: Any) -> None:
    launch = {
        "LifecycleHookName": "petctl-launch",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING",
    }
    _create(asg, [DRAIN, launch])
    assert _hooks(asg) == {
        "petctl-drain": ("autoscaling:EC2_INSTANCE_TERMINATING", "CONTINUE", 120),
        "petctl-launch": ("autoscaling:EC2_INSTANCE_LAUNCHING", "ABANDON", 3600),  # AWS's defaults
    }
    # made again under its name (moto's stack update recreates a group): the new group's hooks only
    asg.delete_auto_scaling_group(AutoScalingGroupName="g", ForceDelete=True)
    _create(asg, [DRAIN])
    assert set(_hooks(asg)) == {"petctl-drain"}


@pytest.mark.parametrize(
    "bad,error",
    [
        ({"HeartbeatTimeout": 10}, "outside 30-7200"),
        ({"HeartbeatTimeout": 7201}, "outside 30-7200"),
        ({"DefaultResult": "RETRY"}, "not CONTINUE or ABANDON"),
        ({"LifecycleTransition": "autoscaling:EC2_INSTANCE_STOPPING"}, "is not one of"),
        ({"LifecycleHookName": "petctl drain"}, "invalid LifecycleHookName"),
    ],
)
def test_what_aws_refuses_of_a_hook_refuses_the_group(asg: Any, bad: dict[str, Any], error: str) -> None:
    with pytest.raises(asg.exceptions.ClientError, match=error):
        _create(asg, [{**DRAIN, **bad}])
    assert asg.describe_auto_scaling_groups(AutoScalingGroupNames=["g"])["AutoScalingGroups"] == []


def test_a_hook_declared_twice_is_refused(asg: Any) -> None:
    with pytest.raises(asg.exceptions.ClientError, match="declared twice"):
        _create(asg, [DRAIN, DRAIN])
