"""The local cloud against a real daemon: IMDS, reconciler, drain, faults, etcd."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time

import botocore.exceptions
import pytest
from click.testing import CliRunner
from localcloud_helpers import Cloud, http, imds_token, wait_for

import petctl.local as local
from petctl.local import procs
from petctl.local.cli import local_group


def test_import_is_light() -> None:
    code = (
        "import sys, petctl.local, petctl.local.cli; "
        "heavy = [m for m in ('boto3', 'botocore', 'moto', 'torch') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_imds_serves_per_instance_views(cloud: Cloud) -> None:
    cloud.make_job("imds", workers=2)
    a, b = (i["instance_id"] for i in wait_for(lambda: cloud.running("imds", n=2), what="2 workers"))
    moto = {
        i["InstanceId"]: i
        for r in cloud.ec2.describe_instances(InstanceIds=[a, b])["Reservations"]
        for i in r["Instances"]
    }
    base = f"{cloud.info['imds_url']}/{a}/latest"

    # IMDSv2 only: no token, a bad TTL, or another instance's token are refused.
    assert cloud.imds(a, "meta-data/instance-id", token=None)[0] == 401
    assert http(base + "/api/token", "PUT")[0] == 400
    assert http(base + "/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "99999"})[0] == 400
    assert http(base + "/api/token")[0] == 405
    token_b = imds_token(f"{cloud.info['imds_url']}/{b}/latest")
    assert cloud.imds(a, "meta-data/instance-id", token=token_b)[0] == 401
    assert cloud.imds(a, "meta-data/instance-id", token="forged")[0] == 401

    for iid in (a, b):
        assert cloud.imds(iid, "meta-data/instance-id") == (200, iid)
        assert cloud.imds(iid, "meta-data/local-ipv4") == (200, moto[iid]["PrivateIpAddress"])
    ip = moto[a]["PrivateIpAddress"]
    assert ip.startswith("127.0.") and ip != moto[b]["PrivateIpAddress"]
    assert cloud.imds(a, "meta-data/placement/availability-zone") == (200, "us-east-1a")
    assert cloud.imds(a, "meta-data/placement/region") == (200, "us-east-1")
    assert cloud.imds(a, "meta-data/tags/instance/petctl:job") == (200, "imds")
    assert cloud.imds(a, "meta-data/tags/instance/petctl:role") == (200, "worker")
    status, keys = cloud.imds(a, "meta-data/tags/instance")
    assert status == 200 and {"petctl:job", "petctl:spec", "petctl:rdzv"} <= set(keys.split("\n"))
    assert cloud.imds(a, "meta-data/tags/instance/nope")[0] == 404
    assert cloud.imds(a, "meta-data/autoscaling/target-lifecycle-state") == (200, "InService")
    assert cloud.imds(a, "meta-data/spot/instance-action")[0] == 404
    status, listing = cloud.imds(a, "meta-data")
    assert status == 200 and "instance-id" in listing.split("\n") and "placement/" in listing.split("\n")
    assert "spot/" not in listing.split("\n")  # no notice yet
    status, doc = cloud.imds(a, "dynamic/instance-identity/document")
    assert status == 200 and json.loads(doc)["privateIp"] == ip
    assert http(f"{cloud.info['imds_url']}/i-0000000000000000/latest/api/token", "PUT", {
        "X-aws-ec2-metadata-token-ttl-seconds": "60"
    })[0] == 404  # fmt: skip


def test_worker_gets_the_agent_environment(cloud: Cloud) -> None:
    job = cloud.make_job("env", workers=1)
    (inst,) = wait_for(lambda: cloud.running("env"), what="worker")
    iid = inst["instance_id"]
    data = cloud.standin(iid)
    env = data["env"]
    assert data["mode"] == "normal"  # it read its own tag over IMDS
    assert env["PETCTL_IMDS_URL"] == f"{cloud.info['imds_url']}/{iid}"
    # The unit's Environment= lines, with the instance's paths mapped into its root; the boot
    # script's mount made /mnt/efs the shared directory.
    root = cloud.root(iid)
    assert env["PETCTL_EFS_MOUNT"] == str(root / "mnt" / "efs")
    assert (root / "mnt" / "efs").resolve() == (cloud.state_dir / "efs" / job["efs"]).resolve()
    inst = wait_for(lambda: (i := cloud.instance(iid))["boot"]["state"] == "done" and i, what="boot done")
    assert inst["efs_id"] == job["efs"] and inst["boot"]["exit_code"] == 0
    assert env["PETCTL_AGENT_DIR"] == str(cloud.agent_dir(iid))
    # the boot's context stays in the boot; only the instance marker goes everywhere
    assert [k for k in env if k.startswith("PETCTL_LOCAL_")] == [procs.MARKER]
    assert env["AWS_ENDPOINT_URL"] == cloud.url
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"
    assert env["AWS_ACCESS_KEY_ID"] == "petctl-local"
    assert env["AWS_REGION"] == "us-east-1"
    assert "AWS_PROFILE" not in env and "PETCTL_LOCAL_DIR" not in env and "PETCTL_HOME" not in env
    assert env["PETCTL_AGENT_LOG_LEVEL"] == "DEBUG"  # agent knobs set where the cloud started pass
    # The unit runs in its own process group (as in its own cgroup under systemd), apart from the
    # boot script's (gone by now); the grandchild left it too (new session). All carry the marker.
    assert inst["pid"] == data["pid"] and procs.group_members(data["pid"]) == [data["pid"]]
    assert inst["pgid"] == inst["boot"]["pid"] and not procs.group_members(inst["pgid"])
    marker = data["env"][procs.MARKER]
    assert marker.startswith(iid + "@")
    assert sorted(procs.tree_members(inst["pgid"], marker)) == sorted([data["pid"], data["child"]])
    assert (cloud.state_dir / "logs" / f"{iid}.log").exists()


def test_scale_in_drains_then_kills_the_tree(cloud: Cloud) -> None:
    job = cloud.make_job("scalein", workers=2, drain_timeout=3)
    wait_for(lambda: cloud.running("scalein", n=2), what="2 workers")
    before = set(cloud.group_instances(job["groups"]["workers"]))
    cloud.asg.set_desired_capacity(AutoScalingGroupName=job["groups"]["workers"], DesiredCapacity=1)
    (gone,) = before - set(cloud.group_instances(job["groups"]["workers"]))
    (kept,) = before - {gone}
    pids = cloud.standin(gone)

    # The stand-in reads IMDS in its SIGTERM handler: the lifecycle state was flipped first.
    assert wait_for(lambda: cloud.drained(gone), what="SIGTERM handler") == "Terminated"
    wait_for(lambda: cloud.instance(gone)["state"] == "terminated", timeout=15, what="state terminated")
    assert not procs.group_members(pids["pid"])
    assert not procs.is_alive(pids["child"])  # the grandchild (a torch worker, own session) too
    assert cloud.instance(gone)["lifecycle_state"] == "Terminated"
    assert cloud.imds(gone, "meta-data/autoscaling/target-lifecycle-state") == (200, "Terminated")
    assert cloud.instance(kept)["alive"] and cloud.drained(kept) is None


def test_drain_ends_on_lifecycle_completion_or_timeout(cloud: Cloud) -> None:
    job = cloud.make_job("hook", workers=2, drain_timeout=60, mode="ignore-term")
    insts = wait_for(lambda: cloud.running("hook", n=2), what="2 workers")
    group = job["groups"]["workers"]
    with pytest.raises(botocore.exceptions.ClientError, match="No active Lifecycle Action"):
        cloud.asg.complete_lifecycle_action(
            AutoScalingGroupName=group,
            LifecycleHookName="petctl-drain",
            LifecycleActionResult="CONTINUE",
            InstanceId=insts[0]["instance_id"],
        )
    cloud.asg.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=1)
    (gone,) = {i["instance_id"] for i in insts} - set(cloud.group_instances(group))
    wait_for(lambda: cloud.drained(gone), what="SIGTERM seen")
    assert cloud.instance(gone)["state"] == "draining" and cloud.instance(gone)["alive"]  # it ignores SIGTERM
    t0 = time.monotonic()
    cloud.asg.complete_lifecycle_action(
        AutoScalingGroupName=group,
        LifecycleHookName="petctl-drain",
        LifecycleActionResult="CONTINUE",
        InstanceId=gone,
    )
    wait_for(
        lambda: cloud.instance(gone)["state"] == "terminated", timeout=30, what="terminated after completion"
    )
    assert time.monotonic() - t0 < 30  # far below the 60 s drain timeout (1 s grace; loose: a loaded box)
    assert not cloud.instance(gone)["alive"]

    # Without completion, the drain timeout (2 s here, + 0.5 s slack) ends it.
    job2 = cloud.make_job("hook-timeout", workers=1, drain_timeout=2, mode="ignore-term")
    (inst,) = wait_for(lambda: cloud.running("hook-timeout"), what="worker")
    t0 = time.monotonic()
    cloud.asg.set_desired_capacity(AutoScalingGroupName=job2["groups"]["workers"], DesiredCapacity=0)
    wait_for(
        lambda: cloud.instance(inst["instance_id"])["state"] == "terminated", what="terminated after timeout"
    )
    assert time.monotonic() - t0 >= 2
    assert cloud.drained(inst["instance_id"]) == "Terminated"


def test_kill_during_drain(cloud: Cloud) -> None:
    job = cloud.make_job("drainkill", workers=1, drain_timeout=60, mode="ignore-term")
    (inst,) = wait_for(lambda: cloud.running("drainkill"), what="worker")
    iid = inst["instance_id"]
    cloud.asg.set_desired_capacity(AutoScalingGroupName=job["groups"]["workers"], DesiredCapacity=0)
    wait_for(lambda: cloud.drained(iid), what="SIGTERM seen")
    res = local.kill_instance(iid)
    assert res["replaced_by_group"] is False  # already leaving: nothing to replace
    assert not procs.group_members(inst["pgid"]) and not procs.is_alive(cloud.standin(iid)["child"])
    wait_for(lambda: cloud.instance(iid)["state"] == "killed", timeout=5, what="state stays killed")
    assert cloud.group_instances(job["groups"]["workers"]) == []


def test_kill_instance_is_hard_and_the_group_replaces_it(cloud: Cloud) -> None:
    job = cloud.make_job("kill", workers=1)
    (inst,) = wait_for(lambda: cloud.running("kill"), what="worker")
    iid, pids = inst["instance_id"], cloud.standin(inst["instance_id"])
    res = local.kill_instance(iid)
    assert res["killed"] and res["replaced_by_group"]
    assert not procs.group_members(pids["pid"]) and not procs.is_alive(pids["child"])
    assert cloud.drained(iid) is None  # no SIGTERM, no drain
    assert cloud.instance(iid)["state"] == "killed"
    assert cloud.ec2_state(iid) == "terminated"
    (new,) = wait_for(lambda: cloud.running("kill"), what="replacement worker")
    assert new["instance_id"] != iid and cloud.group_instances(job["groups"]["workers"]) == [
        new["instance_id"]
    ]
    with pytest.raises(local.LocalCloudError, match="nothing to kill"):
        local.kill_instance(iid)
    with pytest.raises(local.LocalCloudError, match="no instance"):
        local.kill_instance("i-doesnotexist")


def test_spot_interruption_notice_then_replacement(cloud: Cloud) -> None:
    job = cloud.make_job("spot", workers=1, mode="ignore-term")
    (inst,) = wait_for(lambda: cloud.running("spot"), what="worker")
    iid = inst["instance_id"]
    # bounds from before and after the call (the notice's time is whole seconds, truncated): on a
    # loaded box the reads below can take seconds, and a second notice after the deadline would
    # meet a terminated instance, not the "already has a notice" refusal under test
    before = time.time()
    res = local.spot_interrupt(iid, seconds=4)
    after = time.time()
    with pytest.raises(local.LocalCloudError, match="already has a spot notice"):
        local.spot_interrupt(iid, seconds=4)
    status, body = cloud.imds(iid, "meta-data/spot/instance-action")
    assert status == 200 and json.loads(body) == res["spot_action"]
    notice = json.loads(body)
    when = dt.datetime.strptime(notice["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert notice["action"] == "terminate" and before + 4 - 1 <= when.timestamp() <= after + 4, notice
    assert "spot/" in cloud.imds(iid, "meta-data")[1].split("\n")
    wait_for(lambda: cloud.ec2_state(iid) == "terminated", timeout=15, what="terminated at the deadline")
    assert cloud.drained(iid) is not None  # the shutdown sent SIGTERM first
    assert not cloud.instance(iid)["alive"]
    (new,) = wait_for(lambda: cloud.running("spot"), what="replacement")
    assert new["instance_id"] != iid and cloud.group_instances(job["groups"]["workers"]) == [
        new["instance_id"]
    ]


def test_crashed_tree_is_not_restarted(cloud: Cloud) -> None:
    cloud.make_job("crash", workers=1, mode="crash")
    inst = wait_for(
        lambda: next((i for i in cloud.instances("crash") if i["state"] == "exited"), None), what="exit seen"
    )
    assert inst["exit_code"] == 3
    first = cloud.standin(inst["instance_id"])["pid"]
    # Several reconcile periods later it is still the same, dead, process.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert cloud.instance(inst["instance_id"])["state"] == "exited"
        time.sleep(0.1)
    assert cloud.standin(inst["instance_id"])["pid"] == first
    # The grandchild is still running on the "instance", like on a real host ...
    child = cloud.standin(inst["instance_id"])["child"]
    assert procs.is_alive(child) and cloud.instance(inst["instance_id"])["alive"]
    # ... until the instance goes.
    local.kill_instance(inst["instance_id"])
    assert not procs.is_alive(child)


def test_deleting_the_group_ends_its_instances(cloud: Cloud) -> None:
    job = cloud.make_job("delete", workers=2)
    insts = wait_for(lambda: cloud.running("delete", n=2), what="2 workers")
    children = [cloud.standin(i["instance_id"])["child"] for i in insts]
    cloud.asg.delete_auto_scaling_group(AutoScalingGroupName=job["groups"]["workers"], ForceDelete=True)
    for i in insts:
        wait_for(lambda i=i: cloud.instance(i["instance_id"])["state"] == "terminated", what="terminated")
        assert not procs.group_members(i["pgid"])
    assert not any(procs.is_alive(c) for c in children)


def test_rdzv_runs_real_etcd_and_restart_keeps_data(cloud: Cloud) -> None:
    job = cloud.make_job("rdzv", workers=0, rdzv=True)
    url = f"http://{job['rdzv_ip']}:2379/v2/keys"
    wait_for(lambda: cloud.running("rdzv", role="rdzv"), what="rdzv instance")
    wait_for(lambda: http(url)[0] == 200, timeout=20, what="etcd v2 answering")
    assert http(url + "/petctl", "PUT", {"Content-Type": "application/x-www-form-urlencoded"}, b"value=kept")[
        0
    ] in (
        200,
        201,
    )
    (inst,) = cloud.instances("rdzv", "rdzv")
    assert inst["bind_ip"] == job["rdzv_ip"]  # the ENI address from the petctl:rdzv tag
    res = local.restart_rdzv("rdzv")
    assert res["old_pid"] == inst["pid"] and res["pid"] != inst["pid"] and res["ip"] == job["rdzv_ip"]
    assert not procs.group_members(inst["pgid"])
    wait_for(lambda: http(url + "/petctl")[0] == 200, timeout=20, what="etcd back")
    assert json.loads(http(url + "/petctl")[1])["node"]["value"] == "kept"
    after = cloud.instance(inst["instance_id"])
    assert after["restarts"] == 1 and after["state"] == "running" and after["pid"] == res["pid"]
    with pytest.raises(local.LocalCloudError, match="no running rendezvous"):
        local.restart_rdzv("no-such-job")


def test_cli_commands(cloud: Cloud) -> None:
    runner = CliRunner()
    res = runner.invoke(local_group, ["status", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["running"] and st["endpoint_url"] == cloud.url and "control_token" not in st
    res = runner.invoke(local_group, ["status"])
    assert res.exit_code == 0 and "local cloud running" in res.output
    res = runner.invoke(local_group, ["start", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["pid"] == cloud.info["pid"]
    res = runner.invoke(local_group, ["logs", "--path"])
    assert res.exit_code == 0 and res.output.strip() == str(cloud.state_dir / "cloud.log")
    res = runner.invoke(local_group, ["logs", "-n", "5"])
    assert res.exit_code == 0 and "ready" in (cloud.state_dir / "cloud.log").read_text()
    res = runner.invoke(local_group, ["kill-instance", "i-nope"])
    assert res.exit_code == 1 and "no instance i-nope" in res.output
    res = runner.invoke(local_group, ["logs", "i-nope"])
    assert res.exit_code == 1 and "no log" in res.output


def test_control_api_needs_the_token(cloud: Cloud) -> None:
    assert http(cloud.info["imds_url"] + "/_control/status")[0] == 403
    assert (
        http(cloud.info["imds_url"] + "/_control/status", headers={"X-Petctl-Control-Token": "x"})[0] == 403
    )
    status, _ = http(
        cloud.info["imds_url"] + "/_control/status",
        headers={"X-Petctl-Control-Token": cloud.info["control_token"]},
    )
    assert status == 200


def test_an_address_an_interface_holds_is_never_given_to_an_instance(monkeypatch) -> None:
    """As on AWS: the job's pinned rendezvous address (its interface's) never goes to a worker."""
    import boto3
    import moto

    from petctl.local import moto_patches

    moto_patches.apply()
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # moto in this process, no server
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with moto.mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
        vpc = ec2.create_vpc(CidrBlock="127.255.250.0/24")["Vpc"]["VpcId"]
        # 3 usable addresses (.4, .5, .6): the interface holds .5
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.255.250.0/29")["Subnet"]["SubnetId"]
        ec2.create_network_interface(SubnetId=subnet, PrivateIpAddress="127.255.250.5")
        ips = [
            i["PrivateIpAddress"]
            for _ in range(2)
            for i in ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, SubnetId=subnet)[
                "Instances"
            ]
        ]
        assert sorted(ips) == ["127.255.250.4", "127.255.250.6"]


def test_private_ips_are_random_claimed_and_never_reused() -> None:
    from petctl.local import moto_ec2

    # A /29 has 3 usable addresses once AWS's reserved ones (first four, last one) are skipped.
    got = {moto_ec2._random_host("127.255.254.0/29", lambda ip: False) for _ in range(3)}
    assert got == {"127.255.254.4", "127.255.254.5", "127.255.254.6"}
    assert moto_ec2._random_host("127.255.254.0/29", lambda ip: False) is None  # exhausted, never reused
    # Another daemon's claim (an flock held by another process) is respected.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from petctl.local import moto_ec2 as m; "
            "print(m.claim_ip('127.255.253.4'), flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        assert not moto_ec2.claim_ip("127.255.253.4")
    finally:
        holder.communicate("")
    assert moto_ec2.claim_ip("127.255.253.4")  # released when its holder exited
