"""At the job's end the agent deletes the job's etcd CA key, and only it, and only once no rendezvous
instance can boot for the job any more (a replacement would need the key to sign etcd's certificate
again). Against a moto server over HTTP with the local cloud's patches."""

from __future__ import annotations

from types import SimpleNamespace

from petctl_agent.cloud.aws import client as aws_client
from petctl_agent.cloud.jobend import ca_key_location, forget_ca_key

PREFIX = "petctl/jobs/j1/"
KEPT = [
    "job.json",
    "code/train.py",
    "status/i-0a.json",
    "boot/events/i-0a.json",
    "tls/ca.pem",
    "tls/client.key",
]


def _keys(s3) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket="job-bucket").get("Contents", []))


def test_ca_key_location_comes_from_the_status_url() -> None:
    assert ca_key_location("s3://b/petctl/jobs/j1/status/") == ("b", "petctl/jobs/j1/tls/ca.key")
    assert ca_key_location("file:///tmp/status/") is None
    assert ca_key_location("s3://b/elsewhere/") is None


def test_ca_key_goes_only_once_the_rendezvous_group_is_at_zero(moto_endpoint: str) -> None:
    s3 = aws_client("s3")
    s3.create_bucket(Bucket="job-bucket")
    for name in [*KEPT, "tls/ca.key"]:
        s3.put_object(Bucket="job-bucket", Key=PREFIX + name, Body=b"x")
    s3.put_object(Bucket="job-bucket", Key="petctl/jobs/j10/tls/ca.key", Body=b"other job")
    ec2, asg = aws_client("ec2"), aws_client("autoscaling")
    lt = ec2.create_launch_template(
        LaunchTemplateName="lt", LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    asg.create_auto_scaling_group(
        AutoScalingGroupName="petctl-j1-rdzv",
        LaunchTemplate={"LaunchTemplateId": lt},
        MinSize=1,
        MaxSize=1,
        DesiredCapacity=1,
        AvailabilityZones=["us-east-1a"],
    )
    spec = SimpleNamespace(status_url=f"s3://job-bucket/{PREFIX}status/", rdzv_group="petctl-j1-rdzv")
    # the scale-down did not happen (or not yet): a replacement rendezvous instance may still boot
    assert forget_ca_key(spec, aws_client) is False
    assert PREFIX + "tls/ca.key" in _keys(s3)
    asg.update_auto_scaling_group(AutoScalingGroupName="petctl-j1-rdzv", MinSize=0, DesiredCapacity=0)
    assert forget_ca_key(spec, aws_client) is True
    assert _keys(s3) == sorted([*(PREFIX + k for k in KEPT), "petctl/jobs/j10/tls/ca.key"])
    assert forget_ca_key(spec, aws_client) is True  # every ending agent may call it: idempotent


def test_a_failing_delete_is_not_fatal(moto_endpoint: str) -> None:
    spec = SimpleNamespace(status_url="s3://no-such-bucket/petctl/jobs/j1/status/", rdzv_group="")
    assert forget_ca_key(spec, aws_client) is False
