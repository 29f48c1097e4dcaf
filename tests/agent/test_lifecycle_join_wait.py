"""Below MIN, an agent waits while its worker group still brings capacity, up to the join timeout
and beyond it only while capacity is coming; a rendezvous timeout alone never stops the groups.

A real agent process and etcd; the job's Auto Scaling groups live in a moto server on 127.0.0.1.
"""

from __future__ import annotations

import time

import pytest
from harness import wait_for

from petctl_agent import EXIT_JOIN_TIMEOUT

moto_server = pytest.importorskip("moto.server")
pytestmark = pytest.mark.e2e


def test_below_min_waits_while_capacity_is_coming_and_never_scales_to_zero(make_cluster) -> None:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        import boto3

        kw = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "t",
              "aws_secret_access_key": "t"}  # fmt: skip
        ec2, asg = boto3.client("ec2", **kw), boto3.client("autoscaling", **kw)
        lt = ec2.create_launch_template(
            LaunchTemplateName="wait-lt",
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"},
        )["LaunchTemplate"]["LaunchTemplateId"]
        groups = ("petctl-wait-workers", "petctl-wait-rdzv")
        for name in groups:  # desired 2 = MIN: the second node is "still coming"
            asg.create_auto_scaling_group(AutoScalingGroupName=name, LaunchTemplate={"LaunchTemplateId": lt},
                                          MinSize=0, MaxSize=4, DesiredCapacity=2,
                                          AvailabilityZones=["us-east-1a"])  # fmt: skip

        join_timeout = 6
        c = make_cluster(job="wait", min_nodes=2, max_nodes=2,
                         extra_env={"AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1",
                                    "PETCTL_AGENT_RDZV_ATTEMPT": "2"},
                         spec_extra={"join_timeout": join_timeout, "worker_group": groups[0],
                                     "rdzv_group": groups[1]})  # fmt: skip
        a = c.add_node()
        wait_for(lambda: (c.status(a.instance_id) or {}).get("state") == "RENDEZVOUS", 120, "a waiting")
        t0 = time.monotonic()
        # past the join timeout the group still says capacity is coming: a keeps waiting
        time.sleep(join_timeout + 3)
        assert a.alive(), (a.agent_dir / "agent.err").read_text()[-2000:]
        st = c.status(a.instance_id)
        assert st["state"] == "RENDEZVOUS" and "desired 2" in (st["reason"] or ""), st

        # the group is scaled below MIN: nothing is coming any more -> FAILED, groups left alone
        asg.update_auto_scaling_group(AutoScalingGroupName=groups[0], MinSize=0, DesiredCapacity=1)
        wait_for(lambda: a.proc.poll() is not None, 60, "a to give up")
        assert time.monotonic() - t0 < 2 * join_timeout + 60
        st = c.status(a.instance_id)
        assert a.proc.returncode == EXIT_JOIN_TIMEOUT and st["state"] == "FAILED", st
        assert "fewer than min_nodes=2" in st["reason"] and "desired 1" in st["reason"], st["reason"]
        got = asg.describe_auto_scaling_groups(AutoScalingGroupNames=list(groups))["AutoScalingGroups"]
        assert sorted(g["DesiredCapacity"] for g in got) == [1, 2], "a rendezvous timeout scaled a group"
        # and the rendezvous was not closed: a node arriving later can still form the job
        # (petctl-etcd: no rounds/closed key; the node's join of round 1 is there, so this
        # looked in the right place)
        from petctl_agent.rendezvous import DEFAULT_PREFIX
        from petctl_agent.rendezvous import etcdv3 as v3

        client = v3.Client(c.etcd.endpoint)
        assert client.range(f"{DEFAULT_PREFIX}/wait/joins/", prefix=True).kvs
        assert client.get(f"{DEFAULT_PREFIX}/wait/rounds/closed") is None
    finally:
        server.stop()
