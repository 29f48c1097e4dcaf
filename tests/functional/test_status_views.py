"""What `status` and `jobs` show a person, against a real moto server with agent reports in S3."""

from __future__ import annotations

import datetime as dt
import json
import time
import zipfile

import boto3
import pytest


@pytest.fixture
def job(run, tmp_path, monkeypatch):
    wheel = tmp_path / "petctl-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("petctl/__init__.py", "")
    monkeypatch.setenv("PETCTL_DIST", str(wheel))
    assert run("setup").exit_code == 0
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    r = run("run-job", "--name", "demo", "--min", "2", "--max", "3", str(script))
    assert r.exit_code == 0, r.output
    return "demo"


def _workers() -> list[str]:
    group = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-demo-workers"]
    )
    return [i["InstanceId"] for i in group["AutoScalingGroups"][0]["Instances"]]


def _report(iid: str, **fields) -> None:
    s3 = boto3.client("s3")
    bucket = s3.list_buckets()["Buckets"][0]["Name"]
    doc = {
        "version": 1,
        "job_name": "demo",
        "instance_id": iid,
        "state": "RUNNING",
        "world_size": 2,
        "round": 2,
        "restarts": 1,
        "events": [],
        "updated_at": time.time(),
        **fields,
    }
    s3.put_object(Bucket=bucket, Key=f"petctl/jobs/demo/status/{iid}.json", Body=json.dumps(doc).encode())


def test_a_script_without_the_helper_is_said_to_report_no_progress(run, job):
    for iid in _workers():
        _report(iid)  # no last_step: a plain torchrun script
    r = run("status", "demo")
    assert r.exit_code == 0, r.output
    assert "the script reports no progress" in r.stdout and "step -" not in r.stdout
    assert "restarts 1" in r.stdout and "rendezvous rounds 2" in r.stdout and ", up " in r.stdout
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    assert st["reports_progress"] is False and st["uptime_s"] >= 0


def test_a_draining_node_stays_listed_until_it_has_left(run, job):
    a, b = _workers()
    _report(a, last_step=50)
    _report("i-0draining000001", state="DRAINING", last_step=50, reason="scale-in")
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    draining = [h for h in st["hosts"] if h["instance_id"] == "i-0draining000001"]
    assert draining and draining[0]["agent_state"] == "DRAINING" and draining[0]["role"] == "worker"
    assert "DRAINING" in run("status", "demo").stdout
    _report("i-0draining000001", state="LEFT", last_step=50)  # it has left: gone from the list
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    assert "i-0draining000001" not in [h["instance_id"] for h in st["hosts"]]


def test_jobs_shows_ages_and_json_keeps_iso_timestamps(run, job):
    rows = json.loads(run("-o", "json", "jobs").stdout)
    created = dt.datetime.fromisoformat(rows[0]["created"])
    assert created.tzinfo is not None and abs(time.time() - created.timestamp()) < 600
    text = run("jobs").stdout
    assert "AGE" in text and " ago" in text and "s ago" in text.split("demo", 1)[1]
