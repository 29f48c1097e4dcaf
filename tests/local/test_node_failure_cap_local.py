"""The node-failure cap on the local cloud, as a user meets it: a job trains on 2 nodes, its uploaded
script is deleted from S3, a node is lost; every replacement fails its fetch (the survivor, below
--min, makes no progress meanwhile), and the second failure since the job last trained stops the
job (--max-node-failures 2): both groups at zero, and the reason on record says why."""

from __future__ import annotations

from typing import Any

import pytest
from localcloud_helpers import Cloud, wait_for
from test_boot import TRAIN, bucket_of
from test_boot import petctl as petctl  # noqa: F401 - the module's fixture, used by name

import petctl.local as local

pytestmark = pytest.mark.e2e


def test_a_job_whose_replacements_keep_failing_stops_at_the_cap(petctl: Any, cloud: Cloud) -> None:  # noqa: F811
    job = "churn"
    petctl(
        "run-job", "--name", job, "--min", "2", "--max", "2", "--max-node-failures", "2",
        str(TRAIN), "--", "--total-steps", "100000", "--step-time", "0.05",
    )  # fmt: skip
    wait_for(
        lambda: (s := petctl("status", job))["state"] == "RUNNING" and (s.get("last_step") or 0) > 5,
        timeout=180, what="the job training", poll=1,
    )  # fmt: skip
    bucket = bucket_of(cloud, job)
    prefix = f"petctl/jobs/{job}/"
    wait_for(
        lambda: cloud.s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "boot/progress/mark").get("KeyCount"),
        timeout=60, what="the progress mark", poll=1,
    )  # fmt: skip
    for o in cloud.s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "code/")["Contents"]:
        cloud.s3.delete_object(Bucket=bucket, Key=o["Key"])  # the user's script is gone from S3
    victim = cloud.instances(job, "worker")[0]["instance_id"]
    local.kill_instance(victim)

    def stopped() -> Any:
        groups = cloud.asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[f"petctl-{job}-workers", f"petctl-{job}-rdzv"]
        )["AutoScalingGroups"]
        return all(g["DesiredCapacity"] == 0 for g in groups) and groups

    wait_for(stopped, timeout=300, what="both groups at zero", poll=2)
    logs = [
        cloud.s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read().decode()
        for o in cloud.s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "boot/")["Contents"]
        if o["Key"].endswith(".log")
    ]
    stop = [line for line in logs if "stopping the job" in line]
    assert len(logs) == 2 and len(stop) == 1, logs
    assert "2 node failures since it last trained at" in stop[0] and "NoSuchKey" in stop[0], stop
    st = petctl("status", job)
    assert st["state"] == "FAILED" and st["reason"].startswith("the job stopped itself: 2 node failures"), st
