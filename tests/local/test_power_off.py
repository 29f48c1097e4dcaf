"""An instance that powers itself off (the give-up's and the agent's last resort, issue #31), on
the local cloud: the ``shutdown`` shim, the daemon's OS power-off, EC2's stop and the group's
replacement, as on AWS."""

from __future__ import annotations

import base64

from localcloud_helpers import Cloud, wait_for

GROUP = "petctl-poff-workers"
# a first schedule, replaced by a second, cancelled, then a power-off now (systemd's semantics)
USER_DATA = """#!/bin/bash
set -Eeuo pipefail
shutdown -h +5 "petctl: later"
shutdown -h +9
shutdown -c
shutdown -h now "petctl: this node gave up; powering off (last resort)"
"""


def test_an_instance_that_powers_itself_off_is_stopped_and_replaced(cloud: Cloud) -> None:
    net = cloud.network()
    lt = cloud.ec2.create_launch_template(
        LaunchTemplateName="lt-poff",
        LaunchTemplateData={
            "ImageId": "ami-12c6146b",
            "InstanceType": "t3.medium",
            "UserData": base64.b64encode(USER_DATA.encode()).decode(),
        },
    )["LaunchTemplate"]["LaunchTemplateId"]
    tags = {"petctl:role": "worker", "petctl:job": "poff", "petctl:user": "tester"}
    cloud.asg.create_auto_scaling_group(
        AutoScalingGroupName=GROUP,
        MinSize=0,
        MaxSize=2,
        DesiredCapacity=1,
        Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in tags.items()],
        VPCZoneIdentifier=net["subnet"],
        LaunchTemplate={"LaunchTemplateId": lt, "Version": "$Latest"},
    )
    try:
        (first,) = wait_for(lambda: cloud.group_instances(GROUP) or None, what="the first instance")
        wait_for(lambda: (cloud.instance(first) or {}).get("state") == "powered-off", what="powered off")
        assert not cloud.instance(first)["alive"]  # every process of it is gone
        log = (cloud.state_dir / "logs" / f"{first}.log").read_text()
        assert "shutdown (petctl local shim): shutdown -c: cancelled" in log
        # EC2 stopped it; the group's health check (a stopped instance is unhealthy) replaced it
        wait_for(lambda: cloud.ec2_state(first) == "terminated", what="terminated by its group")
        wait_for(
            lambda: [i for i in cloud.group_instances(GROUP) if i != first] or None, what="a replacement"
        )
    finally:
        cloud.asg.update_auto_scaling_group(AutoScalingGroupName=GROUP, MinSize=0, DesiredCapacity=0)
        wait_for(lambda: not cloud.group_instances(GROUP), what="the group at zero")
