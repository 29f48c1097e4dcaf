"""Jobs cannot touch each other's files on EFS: the real base and job templates deployed into moto
(with the local cloud's patches), and the ``mount`` shim run as each job's worker instance would.

What makes it hold on AWS, and what the shim enforces as EFS does at mount time: the file system
policy (no Allow; Deny without an access point; Deny without TLS), each job's access point rooted at
its own directory, and the worker role's ClientMount only through that access point
(docs.aws.amazon.com/efs/latest/ug/iam-access-control-nfs-efs.html, access-points-iam-policy.html).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from petctl import naming, templates
from petctl.local import shims

KEY = "petctl-local"


@pytest.fixture(scope="module")
def aws() -> Iterator[tuple[str, Any]]:
    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    from petctl.local import moto_patches

    moto_patches.apply()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        url = "http://{}:{}".format(*server.get_host_and_port())
        requests.post(f"{url}/moto-api/reset", timeout=10)  # moto's backends are per process
        session = boto3.session.Session(
            aws_access_key_id=KEY, aws_secret_access_key=KEY, region_name="us-east-1"
        )
        yield url, lambda service: session.client(service, endpoint_url=url)
    finally:
        server.stop()


def _stack(
    client: Any, name: str, body: str, parameters: list[dict], bucket: str | None = None
) -> dict[str, str]:
    """Create a stack; with ``bucket``, from a TemplateURL there, as run-job does (a job template
    is over the inline cap)."""
    cf = client("cloudformation")
    where: dict[str, str] = {"TemplateBody": body}
    if bucket:
        client("s3").put_object(Bucket=bucket, Key=f"templates/{name}.yaml", Body=body.encode())
        where = {"TemplateURL": f"https://{bucket}.s3.us-east-1.amazonaws.com/templates/{name}.yaml"}
    cf.create_stack(StackName=name, Parameters=parameters, Capabilities=["CAPABILITY_IAM"], **where)
    (stack,) = cf.describe_stacks(StackName=name)["Stacks"]
    assert stack["StackStatus"] == "CREATE_COMPLETE", stack
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


@pytest.fixture(scope="module")
def jobs(aws: tuple[str, Any]) -> dict[str, Any]:
    """The profile's base stack and two job stacks; one worker instance of each job."""
    _, client = aws
    base = _stack(
        client,
        "petctl-iso",
        templates.render_infra(az_count=1),
        templates.infra_parameters(vpc_cidr="127.0.0.0/16", az_count=1, profile="iso"),
    )
    subnet = base["SubnetIds"]
    out: dict[str, Any] = {"base": base}
    for i, job in enumerate(("job-a", "job-b")):
        values = {
            "JobName": job,
            "User": "tester",
            "MinSize": 0,
            "MaxSize": 1,
            "DesiredCapacity": 0,
            "SubnetIds": [subnet],
            "RdzvSubnetId": subnet,
            "RdzvPrivateIp": f"127.0.0.{250 + i}",
            "VpcId": base["VpcId"],
            "SecurityGroupId": base["InstanceSecurityGroupId"],
            "LogGroupName": base["LogGroupName"],
            "EfsId": base["EfsId"],
            "EfsPosixId": naming.efs_posix_id(job),
            "BucketName": base["BucketName"],
            "SpecUrl": f"s3://{base['BucketName']}/petctl/jobs/{job}/job.json",
            "DistUrl": f"s3://{base['BucketName']}/petctl/jobs/{job}/dist/petctl-0-py3-none-any.whl",
            "TorchVersion": "2.13.0",
        }
        _stack(
            client,
            naming.job_stack(job),
            templates.render_job(),
            templates.job_parameters(**values),
            bucket=base["BucketName"],
        )
        ec2 = client("ec2")
        (lt,) = ec2.describe_launch_templates(LaunchTemplateNames=[f"petctl-{job}-workers"])[
            "LaunchTemplates"
        ]
        (instance,) = ec2.run_instances(
            LaunchTemplate={"LaunchTemplateId": lt["LaunchTemplateId"]},
            MinCount=1,
            MaxCount=1,
            SubnetId=subnet,
        )["Instances"]
        (ap,) = [
            a
            for a in client("efs").describe_access_points(FileSystemId=base["EfsId"])["AccessPoints"]
            if a["RootDirectory"]["Path"] == f"/petctl/jobs/{job}"
        ]
        out[job] = {"instance": instance, "ap": ap["AccessPointId"]}
    return out


def mount(
    tmp_path: Path, aws: tuple[str, Any], jobs: dict, job: str, options: str, fs: str = ""
) -> subprocess.CompletedProcess:
    """``mount -t efs -o OPTIONS <fs>:/ <root>/mnt/efs/petctl/jobs/<job>`` on ``job``'s worker."""
    url, _ = aws
    root = tmp_path / job / "root"
    target = root / "mnt" / "efs" / "petctl" / "jobs" / job
    target.mkdir(parents=True, exist_ok=True)
    instance = jobs[job]["instance"]
    env = {
        "PATH": os.environ["PATH"],
        "PETCTL_LOCAL_ROOT": str(root),
        "PETCTL_LOCAL_STATE": str(tmp_path / "state"),
        "PETCTL_LOCAL_INSTANCE_ID": instance["InstanceId"],
        "PETCTL_LOCAL_AZ": instance["Placement"]["AvailabilityZone"],
        "AWS_ENDPOINT_URL": url,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": KEY,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    argv = ["mount", "-t", "efs", "-o", options, f"{fs or jobs['base']['EfsId']}:/", str(target)]
    return subprocess.run(
        [sys.executable, "-I", str(shims.SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=60
    )


def test_each_job_sees_and_writes_only_its_own_directory(tmp_path: Path, aws, jobs) -> None:
    a, b = jobs["job-a"]["ap"], jobs["job-b"]["ap"]
    res = mount(tmp_path, aws, jobs, "job-a", f"tls,iam,accesspoint={a},noresvport")
    assert res.returncode == 0, res.stderr
    mine = tmp_path / "job-a" / "root" / "mnt" / "efs" / "petctl" / "jobs" / "job-a"
    # the access point's root directory, made on the first mount with its CreationInfo mode
    efs_dir = tmp_path / "state" / "efs" / jobs["base"]["EfsId"] / "petctl" / "jobs" / "job-a"
    assert mine.resolve() == efs_dir.resolve() and oct(efs_dir.stat().st_mode & 0o777) == "0o750"
    (mine / "checkpoints").mkdir()
    (mine / "checkpoints" / "latest").write_text("a's")
    res = mount(tmp_path, aws, jobs, "job-b", f"tls,iam,accesspoint={b},noresvport")
    assert res.returncode == 0, res.stderr
    theirs = tmp_path / "job-b" / "root" / "mnt" / "efs" / "petctl" / "jobs" / "job-b"
    assert list(theirs.iterdir()) == []  # nothing of job-a's
    assert not (tmp_path / "job-b" / "root" / "mnt" / "efs" / "petctl" / "jobs" / "job-a").exists()


@pytest.mark.parametrize(
    ("options", "rc", "error"),
    [
        # another job's access point: job-a's role may mount only through its own
        ("tls,iam,accesspoint={b}", 32, "access denied by server"),
        # the file system's root, every job's directory: denied whatever the role
        ("tls,iam", 32, "access denied by server"),
        # anonymous (no iam): the file system policy allows nobody
        ("tls,accesspoint={a}", 32, "access denied by server"),
        ("tls", 32, "access denied by server"),
        # efs-utils itself: iam and access points need TLS
        ("iam,accesspoint={a}", 1, "requires the 'tls' option"),
    ],
)
def test_a_job_cannot_mount_what_is_not_its_own(
    tmp_path: Path, aws, jobs, options: str, rc: int, error: str
) -> None:
    options = options.format(a=jobs["job-a"]["ap"], b=jobs["job-b"]["ap"])
    res = mount(tmp_path, aws, jobs, "job-a", options)
    assert res.returncode == rc and error in res.stderr, (res.returncode, res.stderr)
    target = tmp_path / "job-a" / "root" / "mnt" / "efs" / "petctl" / "jobs" / "job-a"
    assert target.is_dir() and not target.is_symlink()  # nothing mounted


def test_without_a_file_system_policy_everything_mounts(tmp_path: Path, aws, jobs) -> None:
    """EFS's default policy (none set): any client reaching a mount target mounts anything, even
    anonymously. The base stack's policy is what makes the access points matter; a profile on an
    existing file system (`setup --efs-id`) needs its owner to set the same policy."""
    _, client = aws
    efs = client("efs")
    fs = efs.create_file_system(CreationToken="no-policy", Encrypted=True)["FileSystemId"]
    efs.create_mount_target(FileSystemId=fs, SubnetId=jobs["base"]["SubnetIds"])
    other = efs.create_access_point(FileSystemId=fs, RootDirectory={"Path": "/"})["AccessPointId"]
    res = mount(tmp_path, aws, jobs, "job-a", f"tls,accesspoint={other}", fs=fs)
    assert res.returncode == 0, res.stderr
    res = mount(tmp_path / "again", aws, jobs, "job-a", "noresvport", fs=fs)
    assert res.returncode == 0, res.stderr
