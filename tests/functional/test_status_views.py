"""What `status` and `jobs` show a person, against a real moto server with agent reports in S3."""

from __future__ import annotations

import datetime as dt
import json
import time

import boto3
import pytest


@pytest.fixture
def job(run, ready):
    r = run("run-job", "--name", "demo", "--min", "2", "--max", "3", str(ready))
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


def test_status_shows_worker_lines_cloudwatch_did_not_store(run, job):
    a, b = _workers()
    _report(a, last_step=5)
    _report(b, last_step=5)
    assert "not in CloudWatch Logs" not in run("status", "demo").stdout
    assert json.loads(run("-o", "json", "status", "demo").stdout)["log_events_lost"] == {
        "rejected": 0,
        "throttled": 0,
        "failed": 0,
        "queue_full": 0,
    }
    _report(a, last_step=5, log_events_lost={"rejected": 3, "throttled": 0, "failed": 1, "queue_full": 0})
    _report(b, last_step=5, log_events_lost={"rejected": 2, "throttled": 7, "failed": 0, "queue_full": 0})
    out = run("status", "demo").stdout
    assert "logs: 13 worker lines not in CloudWatch Logs (rejected 5, throttled 7, failed 1)" in out
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    assert st["log_events_lost"] == {"rejected": 5, "throttled": 7, "failed": 1, "queue_full": 0}


def test_a_draining_node_stays_listed_until_it_has_left(run, job):
    a, b = _workers()
    _report(a, last_step=50)
    _report("i-0draining000001", state="DRAINING", last_step=50, reason="scale-in", private_ip="10.0.0.9")
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    draining = [h for h in st["hosts"] if h["instance_id"] == "i-0draining000001"]
    assert draining and draining[0]["agent_state"] == "DRAINING" and draining[0]["role"] == "worker"
    assert draining[0]["private_ip"] == "10.0.0.9"  # from the agent's report (the group lists it no more)
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


def _when_stack_exists(job: str, then, timeout: float = 300.0):
    """Play the agents: once the job's stack is made (its spec is uploaded before), call ``then``
    from a thread. Generous: on a loaded 2-core machine setup + run-job can take a while."""
    import threading

    def go():
        cf = boto3.client("cloudformation")
        deadline = time.time() + timeout
        while time.time() < deadline:
            done = {
                s["StackName"]
                for s in cf.describe_stacks()["Stacks"]
                if s["StackStatus"] == "CREATE_COMPLETE"
            }
            if f"petctl-job-{job}" in done:
                time.sleep(1.0)
                then()
                return
            time.sleep(0.3)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _finish(state: str, reason: str | None = None) -> None:
    logs = boto3.client("logs")
    logs.create_log_stream(logGroupName="/petctl/default", logStreamName="waited/i-0abc")
    logs.put_log_events(
        logGroupName="/petctl/default",
        logStreamName="waited/i-0abc",
        logEvents=[{"timestamp": int(time.time() * 1000), "message": "step=7 from the worker"}],
    )
    s3 = boto3.client("s3")
    bucket = s3.list_buckets()["Buckets"][0]["Name"]
    doc = {
        "version": 1,
        "job_name": "waited",
        "instance_id": "i-0abc",
        "state": state,
        "last_step": 7,
        "events": [],
        "updated_at": time.time(),
        **({"reason": reason} if reason else {}),
    }
    s3.put_object(Bucket=bucket, Key="petctl/jobs/waited/status/i-0abc.json", Body=json.dumps(doc).encode())


@pytest.mark.parametrize("state,code", [("SUCCEEDED", 0), ("FAILED", 1)])
def test_run_job_follow_streams_logs_and_exits_with_the_jobs_result(run, job, tmp_path, state, code):
    script = tmp_path / "train.py"
    t = _when_stack_exists("waited", lambda: _finish(state, "workers failed: exit 1" if code else None))
    r = run("run-job", "--name", "waited", "--min", "1", "--max", "1", "--follow", str(script))
    t.join(5)
    assert r.exit_code == code, r.output
    assert "step=7 from the worker" in r.stdout
    if code:
        assert (
            "job waited ended FAILED: the agent of i-0abc FAILED: workers failed: exit 1 "
            "(its log: `petctl logs waited --instance i-0abc`)"
        ) in r.stderr


def test_status_watch_refreshes_until_the_job_ends(run, job, monkeypatch):
    import threading

    from petctl import jobs

    a, b = _workers()
    for iid in (a, b):
        _report(iid, last_step=10)

    # The job ends once the watch has read it running (not after a fixed 2.5 s: on a loaded
    # machine the first read came later, saw the end, and the watch rightly drew one snapshot).
    observed, real_observe = threading.Event(), jobs.observe

    def observe(*args, **kwargs):
        try:
            return real_observe(*args, **kwargs)
        finally:
            observed.set()

    monkeypatch.setattr(jobs, "observe", observe)

    def finish():
        if observed.wait(120):
            for iid in (a, b):
                _report(iid, state="SUCCEEDED", last_step=40)

    threading.Thread(target=finish, daemon=True).start()
    r = run("status", "demo", "--watch", "--interval", "1")
    assert r.exit_code == 0, r.output
    snapshots = [line for line in r.stdout.splitlines() if "Ctrl-C to leave" in line]
    assert len(snapshots) >= 2 and "job demo: SUCCEEDED" in r.stdout
    assert "steps/s" in r.stdout  # computed between refreshes (10 -> 40)


def test_kill_job_waits_until_instances_are_gone_or_returns_at_once(run, job, tmp_path):
    r = run("-o", "json", "kill-job", "demo", "--yes")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["deleted"] and out["waited"]
    ec2 = boto3.client("ec2")
    alive = [
        i["InstanceId"]
        for res in ec2.describe_instances(Filters=[{"Name": "tag:petctl:job", "Values": ["demo"]}])[
            "Reservations"
        ]
        for i in res["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    assert alive == []
    assert "workers gone" in r.stderr and "instances terminated" in r.stderr
    script = tmp_path / "train.py"
    assert run("run-job", "--name", "quick", "--min", "1", "--max", "1", str(script)).exit_code == 0
    r = run("kill-job", "quick", "--yes", "--no-wait")
    assert r.exit_code == 0 and "deletion started" in r.stdout


@pytest.mark.parametrize("first", ["group", "reports"])
def test_a_job_seen_succeeded_is_seen_scaled_to_zero(run, job, monkeypatch, first):
    """The agent that ends a job scales its group to zero, then publishes SUCCEEDED. A status read
    while it does so (here: right after the read's first of the two facts, whichever that is) never
    shows SUCCEEDED with the workers still wanted: the old order read the group before the reports."""
    from petctl.gateway.groups import Groups
    from petctl.gateway.jobfiles import JobFiles

    workers = _workers()
    for iid in workers:
        _report(iid, last_step=9)
    done: list[str] = []

    def agent_ends() -> None:  # what node/ending.py does, in its order
        boto3.client("autoscaling").update_auto_scaling_group(
            AutoScalingGroupName="petctl-demo-workers", MinSize=0, DesiredCapacity=0
        )
        _report(workers[0], state="SUCCEEDED", last_step=10)

    def hooked(cls, name: str, role: str) -> None:
        real = getattr(cls, name)

        def read(self, *a, **kw):
            out = real(self, *a, **kw)
            if not done:
                done.append(role)
                agent_ends()
            return out

        monkeypatch.setattr(cls, name, read)

    hooked(Groups, "worker_group", "group") if first == "group" else hooked(
        JobFiles, "read_status", "reports"
    )
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    assert done == [first]
    assert st["state"] != "SUCCEEDED" or st["desired"] == 0, (st["state"], st["desired"])
    st = json.loads(run("-o", "json", "status", "demo").stdout)  # after: both facts new
    assert (st["state"], st["desired"]) == ("SUCCEEDED", 0)
