"""A job that fails for good stops its groups: nothing keeps paying for idle instances.

A real agent process, a real etcd, a moto server on 127.0.0.1 holding the job's two
Auto Scaling groups; the training script fails every time and the restart budget is 0.
"""

from __future__ import annotations

import json

import pytest
from harness import wait_for

from petctl_agent import EXIT_TERMINAL

moto_server = pytest.importorskip("moto.server")


def test_failed_job_scales_its_groups_to_zero(make_cluster, tmp_path) -> None:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        import boto3

        kw = {
            "endpoint_url": url,
            "region_name": "us-east-1",
            "aws_access_key_id": "t",
            "aws_secret_access_key": "t",
        }
        ec2, asg = boto3.client("ec2", **kw), boto3.client("autoscaling", **kw)
        lt = ec2.create_launch_template(
            LaunchTemplateName="boom-lt",
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"},
        )["LaunchTemplate"]["LaunchTemplateId"]
        for name in ("petctl-boom-workers", "petctl-boom-rdzv"):
            asg.create_auto_scaling_group(
                AutoScalingGroupName=name,
                LaunchTemplate={"LaunchTemplateId": lt},
                MinSize=1,
                MaxSize=2,
                DesiredCapacity=1,
                AvailabilityZones=["us-east-1a"],
            )

        cluster = make_cluster(
            job="boom",
            min_nodes=1,
            max_nodes=1,
            extra_env={"AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1"},
        )
        script = cluster.tmp / "code" / "fail.py"
        script.write_text("import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n")
        spec = json.loads(cluster.spec_path.read_text())
        spec.update(
            code_url=f"file://{script}",
            script="fail.py",
            max_restarts=0,
            worker_group="petctl-boom-workers",
            rdzv_group="petctl-boom-rdzv",
        )
        cluster.spec_path.write_text(json.dumps(spec))

        node = cluster.add_node()
        wait_for(lambda: node.proc.poll() is not None, 120, "the agent to give up")
        assert node.proc.returncode == EXIT_TERMINAL
        assert (cluster.status(node.instance_id) or {}).get("state") == "FAILED"
        groups = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=["petctl-boom-workers", "petctl-boom-rdzv"]
        )
        assert [(g["MinSize"], g["DesiredCapacity"]) for g in groups["AutoScalingGroups"]] == [(0, 0), (0, 0)]
    finally:
        server.stop()
