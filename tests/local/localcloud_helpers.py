"""Helpers for the local cloud tests: drive a real daemon through boto3, IMDS and /proc.

Instances boot from their launch template's user data, as every local instance does: here a
small bash script (:func:`worker_user_data`, :func:`rdzv_user_data`) that mounts the EFS and
starts ``standin.py`` (instead of the real agent) or etcd through ``systemctl enable --now``,
so these tests exercise the cloud and its shims, not the agent (tests/local/test_boot.py boots
the real boot scripts). Every fixture that starts a daemon stops it and checks that no process
it started survives.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import petctl.local as local
from petctl.local import procs

STANDIN = Path(__file__).with_name("standin.py")
DAEMON_ENV = {
    # What the test user data's units run (the daemon's environment reaches the boot scripts).
    "PETCTL_TEST_STANDIN": f"{sys.executable} {STANDIN}",
    "PETCTL_TEST_ETCD": shutil.which("etcd") or "etcd",
    "PETCTL_LOCAL_DRAIN_SLACK": "0.5",
    "PETCTL_LOCAL_SHUTDOWN_GRACE": "1",
    "PETCTL_LOCAL_DRAIN_TIMEOUT": "5",
    "PETCTL_LOCAL_PERIOD": "0.25",
    "PETCTL_LOCAL_WARMUP": "0",
    "PETCTL_AGENT_LOG_LEVEL": "DEBUG",  # must reach the instances  # tests use few moto backends; do not spend CPU importing the others
}


def wait_for(
    pred: Callable[[], Any],
    timeout: float = 30,
    what: str = "condition",
    poll: float = 0.1,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds, with
    ``describe()`` (what the test saw last) in the message when given."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(poll)
    seen = f"; saw {describe()!r}" if describe is not None else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last value: {last!r}){seen}")


class Cloud:
    """A running local cloud daemon plus helpers to drive it through boto3."""

    def __init__(self, state_dir: Path, info: dict[str, Any]) -> None:
        import boto3

        self.state_dir = state_dir
        self.info = info
        self.url = info["endpoint_url"]
        session = boto3.session.Session(
            aws_access_key_id="petctl-local", aws_secret_access_key="petctl-local", region_name="us-east-1"
        )
        self.ec2 = session.client("ec2", endpoint_url=self.url)
        self.asg = session.client("autoscaling", endpoint_url=self.url)
        self.s3 = session.client("s3", endpoint_url=self.url)
        self.efs = session.client("efs", endpoint_url=self.url)
        self.seen_pgids: set[int] = set()
        self.seen_pids: set[tuple[int, int | None]] = set()
        self._net: dict[str, str] | None = None

    # ---------------------------------------------------------------- AWS side

    def network(self) -> dict[str, str]:
        if self._net is None:
            vpc = self.ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
            octet = random.randint(16, 250)  # parallel test runs get different subnets
            subnet = self.ec2.create_subnet(
                VpcId=vpc, CidrBlock=f"127.0.{octet}.0/24", AvailabilityZone="us-east-1a"
            )["Subnet"]["SubnetId"]
            self.s3.create_bucket(Bucket="petctl-local-test")
            fs = self.efs.create_file_system(CreationToken="petctl-local-test")["FileSystemId"]
            self.efs.create_mount_target(FileSystemId=fs, SubnetId=subnet)  # mount.efs needs one in the AZ
            self._net = {"vpc": vpc, "subnet": subnet, "efs": fs}
        return self._net

    def make_job(
        self,
        job: str,
        workers: int = 1,
        rdzv: bool = False,
        drain_timeout: float | None = 5,
        mode: str = "normal",
        warm_pool: int = 0,
    ) -> dict[str, Any]:
        """A job as the job stack would make it: spec in S3, launch template, groups, tags, and
        with ``warm_pool`` a warm pool of that absolute size (stopped instances) on the workers."""
        net = self.network()
        spec_key = f"petctl/jobs/{job}/job.json"
        spec: dict[str, Any] = {
            "version": 1,
            "job_name": job,
            "rdzv_port": 2379,
            "status_url": f"s3://petctl-local-test/petctl/jobs/{job}/status/",
        }
        if drain_timeout is not None:
            spec["drain_timeout"] = drain_timeout
        self.s3.put_object(Bucket="petctl-local-test", Key=spec_key, Body=json.dumps(spec).encode())
        eni = self.ec2.create_network_interface(SubnetId=net["subnet"])["NetworkInterface"]
        lts = {
            role: self.ec2.create_launch_template(
                LaunchTemplateName=f"lt-{job}-{role}",
                LaunchTemplateData={
                    "ImageId": "ami-12c6146b",
                    "InstanceType": "t3.medium",
                    "UserData": base64.b64encode(script.encode()).decode(),
                },
            )["LaunchTemplate"]["LaunchTemplateId"]
            for role, script in (
                ("worker", worker_user_data(net["efs"])),
                ("rdzv", rdzv_user_data(eni["PrivateIpAddress"])),
            )
        }

        def tags(role: str) -> list[dict[str, Any]]:
            values = {
                "petctl:role": role,
                "petctl:job": job,
                "petctl:user": "tester",
                "petctl:spec": f"s3://petctl-local-test/{spec_key}",
                "petctl:rdzv": eni["PrivateIpAddress"],
                "test:mode": mode,
            }
            return [{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in values.items()]

        groups = {"workers": f"petctl-{job}-workers", "rdzv": f"petctl-{job}-rdzv"}

        def group(name: str, role: str, max_size: int, desired: int) -> None:
            self.asg.create_auto_scaling_group(
                AutoScalingGroupName=groups[name],
                MinSize=1 if role == "rdzv" else 0,
                MaxSize=max_size,
                DesiredCapacity=desired,
                Tags=tags(role),
                VPCZoneIdentifier=net["subnet"],
                LaunchTemplate={"LaunchTemplateId": lts[role], "Version": "$Latest"},
            )

        if rdzv:
            group("rdzv", "rdzv", 1, 1)
        if workers:
            group("workers", "worker", 8, workers)
        if warm_pool:
            self.asg.put_warm_pool(
                AutoScalingGroupName=groups["workers"],
                MinSize=warm_pool,
                MaxGroupPreparedCapacity=warm_pool,
                PoolState="Stopped",
            )
        return {"job": job, "groups": groups, "rdzv_ip": eni["PrivateIpAddress"], "efs": net["efs"]}

    def group_instances(self, group: str) -> list[str]:
        groups = self.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]
        return sorted(i["InstanceId"] for i in groups[0]["Instances"]) if groups else []

    def ec2_state(self, instance_id: str) -> str:
        res = self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        return res[0]["Instances"][0]["State"]["Name"]

    # ---------------------------------------------------------------- local side

    def instances(self, job: str | None = None, role: str | None = None) -> list[dict[str, Any]]:
        out = [
            i
            for i in local.status()["instances"]
            if (job is None or i["job"] == job) and (role is None or i["role"] == role)
        ]
        for i in out:
            if i.get("pgid"):
                self.seen_pgids.add(i["pgid"])
        return out

    def instance(self, instance_id: str) -> dict[str, Any] | None:
        return next((i for i in self.instances() if i["instance_id"] == instance_id), None)

    def running(self, job: str, role: str = "worker", n: int = 1) -> list[dict[str, Any]] | None:
        """The job's instances whose stand-in has written env.json, once there are ``n``."""
        alive = [i for i in self.instances(job, role) if i["state"] == "running" and i["alive"]]
        if role == "worker":
            alive = [i for i in alive if self.standin(i["instance_id"])]
        return alive if len(alive) == n else None

    def root(self, instance_id: str) -> Path:
        return self.state_dir / "instances" / instance_id / "root"

    def agent_dir(self, instance_id: str) -> Path:
        return self.root(instance_id) / "var" / "lib" / "petctl"

    def standin(self, instance_id: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.agent_dir(instance_id) / "env.json").read_text())
        except (OSError, ValueError):
            return None
        for pid in (data["pid"], data["child"]):
            # only while it is still the stand-in's process: a pid the kernel has given to another
            # process since (no local cloud marker in its environment) is not one to account for
            if procs._marker_of(pid) is not None:
                self.seen_pids.add((pid, procs.start_ticks(pid)))
        return data

    def drained(self, instance_id: str) -> str | None:
        path = self.agent_dir(instance_id) / "drained"
        return path.read_text() if path.exists() else None

    def imds(self, instance_id: str, path: str, token: str | None = "auto") -> tuple[int, str]:
        base = f"{self.info['imds_url']}/{instance_id}/latest"
        if token == "auto":
            token = imds_token(base)
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        return http(base + "/" + path, headers=headers)


def worker_user_data(efs: str) -> str:
    """A worker boot as the real one does it, minus the installs: mount the EFS, write the agent's
    unit (running the stand-in), enable it --now."""
    return f"""#!/bin/bash
set -Eeuo pipefail
mkdir -p /mnt/efs /var/lib/petctl
mount -t efs -o tls {efs}:/ /mnt/efs
cat > /etc/systemd/system/petctl-agent.service <<UNIT
[Unit]
RequiresMountsFor=/mnt/efs
[Service]
Environment=PETCTL_EFS_MOUNT=/mnt/efs
Environment=PETCTL_AGENT_DIR=/var/lib/petctl
ExecStart=$PETCTL_TEST_STANDIN
KillMode=mixed
[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now petctl-agent.service
"""


def rdzv_user_data(ip: str) -> str:
    """etcd on the rendezvous address as a Type=notify unit (peers on the instance's loopback)."""
    peer = "http://127.0.0.1:2380"
    return f"""#!/bin/bash
set -Eeuo pipefail
mkdir -p /var/lib/etcd
cat > /etc/systemd/system/petctl-etcd.service <<UNIT
[Service]
Type=notify
ExecStart=$PETCTL_TEST_ETCD --name rdzv --data-dir /var/lib/etcd --enable-v2 --listen-client-urls http://{ip}:2379 --advertise-client-urls http://{ip}:2379 --listen-peer-urls {peer} --initial-advertise-peer-urls {peer} --initial-cluster rdzv={peer}
[Install]
WantedBy=multi-user.target
UNIT
systemctl enable --now petctl-etcd.service
"""


def http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, data: bytes | None = None
) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)  # not listening (yet)


def imds_token(base: str, ttl: str = "60") -> str:
    status, body = http(base + "/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": ttl})
    assert status == 200, (status, body)
    return body


def assert_nothing_left(cloud: Cloud, daemon_pid: int, grace: float = 15.0) -> None:
    """Nothing the local cloud started outlives its stop. A SIGKILLed process that held gigabytes
    takes seconds to exit (the kernel frees its memory first), so each check waits up to
    ``grace`` for the processes to be gone, not for a fixed time."""
    deadline = time.monotonic() + grace
    while True:
        left = {g: procs.group_members(g) for g in cloud.seen_pgids}
        alive = [pid for pid, ticks in cloud.seen_pids if ticks is not None and procs.is_alive(pid, ticks)]
        if (
            not procs.is_alive(daemon_pid) and not any(left.values()) and not alive
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not procs.is_alive(daemon_pid), f"daemon {daemon_pid} still alive"
    assert not any(left.values()), f"instance process groups survived: {left}"
    described = {pid: _describe(pid) for pid in alive}
    assert not alive, f"processes survived: {described}"


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"
