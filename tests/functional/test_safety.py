"""What must never happen to a user's jobs and data, against a real moto server over HTTP.

A typo in --profile acting on another profile's job, a delete without a question, checkpoints
deleted by a teardown, a stack left without its code after a timeout, Ctrl-C read as a failure.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from petctl.errors import StackWaitTimeout
from petctl.gateway import stacks as stacks_mod


def live_stacks() -> list[str]:
    return sorted(
        s["StackName"]
        for s in boto3.client("cloudformation").describe_stacks()["Stacks"]
        if s["StackStatus"] != "DELETE_COMPLETE"
    )


def start_job(run, script, name="demo"):
    r = run("run_job", "--name", name, "--min", "1", "--max", "2", str(script))
    assert r.exit_code == 0, r.output


def file_systems() -> list[str]:
    return [f["FileSystemId"] for f in boto3.client("efs").describe_file_systems()["FileSystems"]]


def test_unknown_profile_is_refused_by_every_job_command(run, ready):
    start_job(run, ready)
    for cmd in (
        ["jobs"],
        ["status", "demo"],
        ["scale", "demo", "--size", "2"],
        ["list_hosts", "demo"],
        ["logs", "demo"],
        ["kill_job", "demo", "--yes"],
        ["teardown", "--yes"],
        ["upload", str(ready)],
    ):
        r = run("--profile", "typo", *cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert "unknown profile 'typo' (known: default)" in r.stderr, cmd
    assert "petctl-job-demo" in live_stacks()


def test_a_job_of_another_profile_is_never_touched(run, ready):
    start_job(run, ready)
    # A second profile in the same account and region (job stack names are per region).
    assert run("--profile", "other", "configure", "--region", "us-east-1").exit_code == 0
    for cmd in (["kill_job", "demo", "--yes"], ["status", "demo"], ["scale", "demo", "--size", "2"]):
        r = run("--profile", "other", *cmd)
        assert r.exit_code == 3, (cmd, r.output)
        assert "belongs to profile 'default'" in r.stderr, cmd
    r = run("--profile", "other", "--output", "json", "jobs")
    assert r.exit_code == 0 and json.loads(r.stdout) == []
    assert "petctl-job-demo" in live_stacks()
    assert run("kill_job", "demo", "--yes").exit_code == 0
    assert "petctl-job-demo" not in live_stacks()


def test_destructive_commands_refuse_without_a_terminal_or_yes(run, ready):
    start_job(run, ready)
    r = run("kill_job", "demo")
    assert r.exit_code == 2 and "pass --yes" in r.stderr
    assert "checkpoints on fs-" in r.stderr  # says what is kept, with the real file-system id
    r = run("teardown", "--force")
    assert r.exit_code == 2 and "pass --yes" in r.stderr and "job(s) demo" in r.stderr
    assert live_stacks() == ["petctl-default", "petctl-job-demo"]


def _pty_petctl(aws: str, args: list[str], answer: str, timeout: float = 60) -> tuple[int, str]:
    """Run petctl on a pseudo-terminal, answer its question, return (exit code, screen)."""
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.execve(sys.executable, [sys.executable, "-m", "petctl.cli", *args], dict(os.environ))
    screen, answered, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = b""
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal (it exited)
                chunk = b""
            if not chunk:
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status), screen.decode(errors="replace")
            screen += chunk
        if not answered and b"[y/N]" in screen:
            os.write(fd, answer.encode() + b"\n")
            answered = True
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"petctl did not finish on the terminal: {screen!r}")


def test_kill_job_asks_on_a_terminal(aws, run, ready):
    start_job(run, ready)
    code, screen = _pty_petctl(aws, ["kill_job", "demo"], "n")
    assert "Delete job demo" in screen and "are kept" in screen and "[y/N]" in screen
    assert code == 1 and "nothing was deleted" in screen
    assert "petctl-job-demo" in live_stacks()
    code, screen = _pty_petctl(aws, ["kill_job", "demo"], "y")
    assert code == 0 and "job demo deleted" in screen, screen
    assert "petctl-job-demo" not in live_stacks()


def test_teardown_keeps_the_file_system_unless_delete_data(run, ready, profile_data):
    efs = profile_data()["efs_id"]
    r = run("teardown", "--yes")
    assert r.exit_code == 0, r.output
    assert f"kept: EFS file system {efs}" in r.stdout and f"--efs-id {efs}" in r.stdout
    assert live_stacks() == [] and file_systems() == [efs]
    # setup again points to the kept checkpoints
    r = run("setup")
    assert r.exit_code == 0 and f"petctl setup --efs-id {efs}" in r.stderr
    new_efs = profile_data()["efs_id"]
    assert new_efs != efs
    # --delete-data deletes, after the question, every file system petctl made for the profile:
    # the stack's own and the one the first teardown kept
    r = run("teardown", "--delete-data")
    assert r.exit_code == 2, r.output
    assert f"EFS file system {new_efs} with every checkpoint" in r.stderr
    assert f"EFS file system {efs} with every checkpoint" in r.stderr
    assert sorted(file_systems()) == sorted([efs, new_efs])
    r = run("--output", "json", "teardown", "--delete-data", "--yes")
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.stdout)["efs_deleted"]) == sorted([efs, new_efs])
    assert file_systems() == [] and profile_data()["retained_efs_ids"] == []


def test_delete_data_never_deletes_a_file_system_the_user_brought(run, tmp_path):
    fs = boto3.client("efs").create_file_system(CreationToken="mine", Encrypted=True)["FileSystemId"]
    r = run("setup", "--efs-id", fs, "--efs-apply-policy")
    assert r.exit_code == 0, r.output
    r = run("teardown", "--delete-data", "--yes")
    assert r.exit_code == 0, r.output
    assert fs in file_systems() and "it was given with --efs-id" in r.stdout


def test_logs_of_an_unknown_job_exits_3_and_an_empty_one_says_so(run, ready):
    r = run("logs", "ghost")
    assert r.exit_code == 3 and "job 'ghost' not found" in r.stderr
    start_job(run, ready)
    r = run("logs", "demo")
    assert r.exit_code == 0 and "job demo has no log lines in the last hour" in r.stderr


def test_missing_s3_target_is_refused_before_anything_is_made(run, ready, profile_data):
    bucket = profile_data()["bucket"]
    r = run("run_job", "--name", "s3job", "--min", "1", "--max", "1", f"s3://{bucket}/petctl/nope/train.py")
    assert r.exit_code == 2 and "does not exist" in r.stderr and "petctl upload" in r.stderr
    assert live_stacks() == ["petctl-default"]
    # an existing one is accepted
    boto3.client("s3").put_object(Bucket=bucket, Key="petctl/code/train.py", Body=b"print(1)\n")
    r = run("run_job", "--name", "s3job", "--min", "1", "--max", "1", f"s3://{bucket}/petctl/code/train.py")
    assert r.exit_code == 0, r.output


def test_run_job_timeout_keeps_the_stack_and_its_uploads(run, ready, monkeypatch):
    """moto creates stacks synchronously, so CloudFormation still working is played by wait()."""

    def still_creating(self, name, timeout, since=None, label=None):
        raise StackWaitTimeout(f"gave up waiting for stack {label or name} after {timeout:.0f}s")

    monkeypatch.setattr(stacks_mod.Stacks, "wait", still_creating)
    r = run("run_job", "--name", "slow", "--min", "1", "--max", "1", "--timeout", "1", str(ready))
    assert r.exit_code == 1
    assert "petctl status slow" in r.stderr and "petctl kill-job slow" in r.stderr
    assert "petctl-job-slow" in live_stacks()
    s3 = boto3.client("s3")
    bucket = s3.list_buckets()["Buckets"][0]["Name"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="petctl/jobs/slow/")["Contents"]]
    assert "petctl/jobs/slow/job.json" in keys and "petctl/jobs/slow/code/train.py" in keys


def test_ctrl_c_exits_130(aws, run, ready):
    """A real SIGINT to a real petctl process following a job's logs."""
    start_job(run, ready)
    logs = boto3.client("logs")
    logs.create_log_stream(logGroupName="/petctl/default", logStreamName="demo/i-0abc")
    logs.put_log_events(
        logGroupName="/petctl/default",
        logStreamName="demo/i-0abc",
        logEvents=[{"timestamp": int(time.time() * 1000), "message": "step=1"}],
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "petctl.cli", "logs", "demo", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a SIGABRT below dumps every thread's stack
        # as from a shell: SIGINT at its default. An xdist worker may ignore SIGINT, and a child
        # inherits SIG_IGN (then Python installs no KeyboardInterrupt handler): a CI run
        # caught the CLI asleep in its poll 60 s after the SIGINT, this way
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert "step=1" in proc.stdout.readline()  # it is following now
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(
                timeout=60
            )  # (failed twice at 30 s on a loaded 2-core machine: say where it was)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            raise AssertionError(
                f"no exit 60 s after SIGINT; the CLI's threads then:\n{err[-6000:]}"
            ) from None
        assert code == 130
    finally:
        proc.kill()
        proc.wait()
    assert Path(os.environ["PETCTL_HOME"]).exists()


def test_logs_of_one_job_never_show_another_jobs_lines(run, ready):
    """moto ignores logStreamNamePrefix; the local cloud's patch honours it as AWS does."""
    start_job(run, ready, "alpha")
    start_job(run, ready, "alpha-2")  # a name that shares alpha's first letters
    logs = boto3.client("logs")
    now = int(time.time() * 1000)
    for job in ("alpha", "alpha-2"):
        for inst in ("i-01", "i-02"):
            logs.create_log_stream(logGroupName="/petctl/default", logStreamName=f"{job}/{inst}")
            logs.put_log_events(
                logGroupName="/petctl/default",
                logStreamName=f"{job}/{inst}",
                logEvents=[{"timestamp": now, "message": f"line of {job} on {inst}"}],
            )
    r = run("logs", "alpha")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("line of alpha on") == 2 and "alpha-2" not in r.stdout
    r = run("logs", "alpha-2", "--instance", "i-02")
    assert r.stdout.count("line of alpha-2 on i-02") == 1 and len(r.stdout.strip().splitlines()) == 1
    with pytest.raises(Exception, match="Cannot specify both"):
        logs.filter_log_events(
            logGroupName="/petctl/default", logStreamNames=["alpha/i-01"], logStreamNamePrefix="alpha/"
        )


def _vpc_with_subnet(cidr: str = "10.9.0.0/16") -> tuple[str, str]:
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock=cidr)["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr.replace("/16", "/24"), AvailabilityZone="us-east-1a")
    return vpc, subnet["Subnet"]["SubnetId"]


def test_moto_refuses_mount_targets_in_two_vpcs_as_aws_does(aws):
    efs = boto3.client("efs")
    fs = efs.create_file_system(CreationToken="two-vpcs")["FileSystemId"]
    _, subnet_a = _vpc_with_subnet("10.8.0.0/16")
    _, subnet_b = _vpc_with_subnet("10.9.0.0/16")
    efs.create_mount_target(FileSystemId=fs, SubnetId=subnet_a)
    with pytest.raises(Exception, match="MountTargetConflict"):
        efs.create_mount_target(FileSystemId=fs, SubnetId=subnet_b)


def test_setup_refuses_a_file_system_mounted_in_another_vpc(run):
    efs = boto3.client("efs")
    fs = efs.create_file_system(CreationToken="elsewhere")["FileSystemId"]
    vpc, subnet = _vpc_with_subnet()
    efs.create_mount_target(FileSystemId=fs, SubnetId=subnet)
    r = run("setup", "--efs-id", fs)
    assert r.exit_code == 2, r.output
    assert f"has mount targets in {vpc}" in r.stderr and "MountTargetConflict" in r.stderr
    assert "petctl configure" in r.stderr and "another file system" in r.stderr
    assert live_stacks() == []


def test_setup_refuses_a_one_zone_file_system_across_zones(run):
    fs = boto3.client("efs").create_file_system(CreationToken="onezone", AvailabilityZoneName="us-east-1a")[
        "FileSystemId"
    ]
    r = run("setup", "--efs-id", fs, "--az-count", "2")
    assert r.exit_code == 2 and "is One Zone (us-east-1a)" in r.stderr and "--az-count 1" in r.stderr
    assert live_stacks() == []


def test_setup_checks_az_count_against_the_regions_zones(run):
    zones = boto3.client("ec2", region_name="eu-west-3").describe_availability_zones()["AvailabilityZones"]
    assert len(zones) < 6
    r = run("--profile", "paris", "--region", "eu-west-3", "setup", "--az-count", str(len(zones) + 1))
    assert r.exit_code == 2 and f"more than the {len(zones)} zones of eu-west-3" in r.stderr
    assert live_stacks() == []


def test_an_existing_sse_kms_bucket_gives_the_job_roles_its_key(run, tmp_path):
    """On AWS every read of the code and write of a status in an SSE-KMS bucket needs the key;
    moto does not check, so the job template is checked for the grant."""
    kms = boto3.client("kms")
    key = kms.create_key(Description="petctl test")["KeyMetadata"]
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="kms-bucket")
    s3.put_bucket_encryption(
        Bucket="kms-bucket",
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": key["KeyId"],
                    }
                }
            ]
        },
    )
    r = run("setup", "--s3-bucket", "kms-bucket")
    assert r.exit_code == 0, r.output
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    r = run("-o", "json", "run-job", "--dry-run", "--min", "1", "--max", "1", str(script))
    plan = json.loads(r.stdout)
    assert plan["parameters"]["BucketKmsKeyArn"] == key["Arn"]
    from petctl import templates

    t = templates.load_template(plan["template"])
    for role in ("WorkerRole", "RdzvRole"):
        (policy,) = t["Resources"][role]["Properties"]["Policies"]
        (grant,) = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "BucketKmsKey"]
        assert grant["Action"] == ["kms:Decrypt", "kms:GenerateDataKey"]
        assert grant["Resource"] == {"Ref": "BucketKmsKeyArn"}
        assert "kms:ViaService" in grant["Condition"]["StringEquals"]
    # The job's uploads, its TLS keys included, encrypt with that key, which its roles may use.
    r = run("run-job", "--name", "kmsjob", "--min", "1", "--max", "1", str(script))
    assert r.exit_code == 0, r.output
    listed = s3.list_objects_v2(Bucket="kms-bucket", Prefix="petctl/jobs/kmsjob/")["Contents"]
    assert any("/tls/" in o["Key"] for o in listed)
    for o in listed:
        head = s3.head_object(Bucket="kms-bucket", Key=o["Key"])
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] in (key["Arn"], key["KeyId"])


def test_a_bucket_whose_kms_key_petctl_cannot_use_is_refused(run):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="foreign-key-bucket")
    s3.put_bucket_encryption(
        Bucket="foreign-key-bucket",
        ServerSideEncryptionConfiguration={
            "Rules": [
                {
                    "ApplyServerSideEncryptionByDefault": {
                        "SSEAlgorithm": "aws:kms",
                        "KMSMasterKeyID": "arn:aws:kms:us-east-1:999999999999:key/00000000-0000-0000-0000-000000000000",
                    }
                }
            ]
        },
    )
    r = run("setup", "--s3-bucket", "foreign-key-bucket")
    assert r.exit_code == 2 and "which petctl cannot use" in r.stderr and "another bucket" in r.stderr
    assert live_stacks() == []
