"""A boot that fails: instances publish their boot log under the job's boot/ prefix (as the boot
scripts' ERR trap does, cfn_templates/user_data/common.sh.j2); `status` turns them into FAILED with
the newest log's last lines when every node keeps failing, against a moto server over HTTP."""

from __future__ import annotations

import datetime as dt
import json
import time
import zipfile
from pathlib import Path

import boto3
import pytest

from petctl import jobs

JOB = "bootfail"


@pytest.fixture
def job_stack(run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The base stack and a job stack (min 2) made by the CLI; returns the bucket."""
    wheel = tmp_path / "petctl-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("petctl/__init__.py", "")
    monkeypatch.setenv("PETCTL_DIST", str(wheel))
    assert run("setup").exit_code == 0
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    r = run("--output", "json", "run_job", "--name", JOB, "--min", "2", "--max", "3", str(script))
    assert r.exit_code == 0, r.output
    return [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]][0]


def boot_log(instance: str, last: str) -> bytes:
    lines = [f"petctl boot: 2025-01-01T00:00:0{n}+00:00 step {n}" for n in range(40)]
    lines += [
        "giving up after 8 attempts: dnf install -y amazon-efs-utils python3.11 python3.11-pip",
        last,
        f"petctl boot: FAILED (exit 1) at line 72: see the lines above ({instance})",
    ]
    return ("\n".join(lines) + "\n").encode()


def publish(bucket: str, instance: str, last: str = "Error: Failed to download metadata for repo") -> None:
    boto3.client("s3").put_object(
        Bucket=bucket, Key=f"petctl/jobs/{JOB}/boot/{instance}.log", Body=boot_log(instance, last)
    )
    time.sleep(1.1)  # LastModified has one-second resolution: keep "newest" well defined


def status(run) -> dict:
    r = run("--output", "json", "status", JOB)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_every_boot_failing_is_failed_with_the_newest_log(run, job_stack):
    publish(job_stack, "i-00000000000000001", "first failure")
    st = status(run)
    assert st["state"] != "FAILED" and st["reason"] is None  # one failed boot: the group replaces it
    assert st["boot_failures"]["count"] == 1
    publish(job_stack, "i-00000000000000002", "second failure")
    publish(job_stack, "i-00000000000000003", "Error: Failed to download metadata for repo 'amazonlinux'")
    st = status(run)
    assert st["state"] == "FAILED"
    boot = st["boot_failures"]
    assert boot["count"] == 3 and boot["instance_id"] == "i-00000000000000003"
    assert boot["last_lines"][-2:] == [
        "Error: Failed to download metadata for repo 'amazonlinux'",
        "petctl boot: FAILED (exit 1) at line 72: see the lines above (i-00000000000000003)",
    ]
    assert len(boot["last_lines"]) == jobs.BOOT_LOG_LINES
    assert "3 instance boot(s) failed and no node ever trained" in st["reason"]
    assert "Error: Failed to download metadata for repo 'amazonlinux'" in st["reason"]
    assert dt.datetime.fromisoformat(boot["at"])  # when the newest log came


def test_groups_at_zero_after_a_failed_boot_is_failed(run, job_stack):
    """The boot script gave up (scaled both groups to zero): FAILED, not STOPPED."""
    publish(job_stack, "i-00000000000000001", "mount.nfs4: Connection timed out")
    asg = boto3.client("autoscaling")
    for group in (f"petctl-{JOB}-workers", f"petctl-{JOB}-rdzv"):
        asg.update_auto_scaling_group(AutoScalingGroupName=group, MinSize=0, DesiredCapacity=0)
    st = status(run)
    assert st["state"] == "FAILED"
    assert "mount.nfs4: Connection timed out" in st["reason"]


def test_boot_failures_after_training_started_do_not_fail_the_job(run, job_stack):
    """A node that trained once proves the boot works: later boot failures are replaced, not fatal."""
    ids = [
        i["InstanceId"]
        for i in boto3.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[f"petctl-{JOB}-workers"]
        )["AutoScalingGroups"][0]["Instances"]
    ]
    report = {"version": 1, "job_name": JOB, "instance_id": ids[0], "state": "RUNNING", "world_size": 2}
    boto3.client("s3").put_object(
        Bucket=job_stack, Key=f"petctl/jobs/{JOB}/status/{ids[0]}.json", Body=json.dumps(report).encode()
    )
    for n in range(3):
        publish(job_stack, f"i-0000000000000000{n}")
    st = status(run)
    assert st["state"] == "RUNNING" and st["reason"] is None
    assert st["boot_failures"]["count"] == 3  # still shown


def test_run_job_again_forgets_the_old_boot_logs(run, job_stack, tmp_path):
    for n in range(3):
        publish(job_stack, f"i-0000000000000000{n}")
    assert status(run)["state"] == "FAILED"
    assert run("kill_job", JOB, "--yes").exit_code == 0
    script = tmp_path / "train.py"
    r = run("--output", "json", "run_job", "--name", JOB, "--min", "2", "--max", "3", str(script))
    assert r.exit_code == 0, r.output
    st = status(run)
    assert st["state"] != "FAILED" and st["boot_failures"]["count"] == 0


def test_reason_is_one_line_and_logs_boot_prints_the_whole_log(run, job_stack):
    for n in range(2):
        publish(job_stack, f"i-0000000000000000{n}")
    publish(job_stack, "i-00000000000000009", "ModuleNotFoundError: No module named 'petctl_agent'")
    st = status(run)
    assert st["state"] == "FAILED" and "\n" not in st["reason"]
    assert st["boot_failures"]["error"] == "ModuleNotFoundError: No module named 'petctl_agent'"
    assert "i-00000000000000009: ModuleNotFoundError: No module named 'petctl_agent'" in st["reason"]
    assert f"`petctl logs {JOB} --boot i-00000000000000009`" in st["reason"]
    text = run("status", JOB).output
    assert f"  reason: {st['reason']}" in text and "    petctl boot: FAILED (exit 1) at line 72" in text
    whole = run("logs", JOB, "--boot", "i-00000000000000009")
    assert whole.exit_code == 0 and whole.output.encode() == boot_log(
        "i-00000000000000009", "ModuleNotFoundError: No module named 'petctl_agent'"
    )
    assert run("logs", JOB, "--boot", "i-00000000000000042").exit_code == 3
    bad = run("logs", JOB, "--boot", "../status/x")
    assert bad.exit_code == 2 and "is not an instance id" in bad.output
