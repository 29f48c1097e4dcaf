"""The job commands against a real moto server over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import boto3


def objects(prefix: str) -> list[str]:
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def spec_of(job: str) -> dict:
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    return json.loads(s3.get_object(Bucket=bucket, Key=f"petctl/jobs/{job}/job.json")["Body"].read())


def run_job(run, script, *extra):
    r = run(
        "--output",
        "json",
        "run_job",
        "--name",
        "demo",
        "--min",
        "2",
        "--max",
        "4",
        *extra,
        str(script),
        "--",
        "--epochs",
        "3",
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_dry_run_prints_plan_and_creates_nothing(run, ready):
    r = run(
        "--output", "json", "run_job", "--dry-run", "--name", "demo", "--min", "2", "--max", "4", str(ready)
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["parameters"]["MinSize"] == "2" and plan["parameters"]["DesiredCapacity"] == "2"
    assert "AWS::AutoScaling::AutoScalingGroup" in plan["template"]
    assert any(u["s3_url"].endswith("/code/train.py") for u in plan["uploads"])
    assert objects("petctl/jobs/") == []
    assert [s["StackName"] for s in boto3.client("cloudformation").describe_stacks()["Stacks"]] == [
        "petctl-default"
    ]


def test_run_job_creates_stack_uploads_and_spec(run, ready):
    out = run_job(run, ready, "--size", "3")
    assert out["job"] == "demo" and out["size"] == 3 and out["rendezvous_endpoint"].endswith(":2379")
    keys = objects("petctl/jobs/demo/")
    assert "petctl/jobs/demo/code/train.py" in keys and "petctl/jobs/demo/job.json" in keys
    assert any(k.startswith("petctl/jobs/demo/dist/") for k in keys)
    spec = spec_of("demo")
    assert spec["min_nodes"] == 2 and spec["max_nodes"] == 4 and spec["args"] == ["--epochs", "3"]
    assert spec["code_kind"] == "script" and spec["script"] == "train.py"
    asg = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-demo-workers"]
    )
    group = asg["AutoScalingGroups"][0]
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (2, 4, 3)
    tags = {t["Key"]: t["Value"] for t in group["Tags"]}
    assert tags["petctl:job"] == "demo" and tags["petctl:spec"].endswith("/petctl/jobs/demo/job.json")


def test_run_job_pins_torch_and_budgets_in_the_spec(run, ready):
    from petctl import jobs

    run_job(run, ready)
    spec = spec_of("demo")
    assert spec["torch_version"] == jobs.DEFAULT_TORCH_VERSION
    assert (spec["max_restarts"], spec["join_timeout"], spec["drain_timeout"]) == (10, 1800, 120)
    assert spec["max_node_failures"] == 10
    assert spec["rdzv_backend"] == "petctl-etcd"
    r = run(
        "--output",
        "json",
        "run_job",
        "--dry-run",
        "--name",
        "pinned",
        "--min",
        "1",
        "--max",
        "2",
        "--spot",
        "--torch-version",
        "2.11.0",
        "--max-restarts",
        "1",
        "--max-node-failures",
        "4",
        "--join-timeout",
        "600",
        "--rdzv-backend",
        "etcd-v2",
        str(ready),
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["parameters"]["TorchVersion"] == "2.11.0" and plan["spec"]["torch_version"] == "2.11.0"
    assert (plan["spec"]["max_restarts"], plan["spec"]["join_timeout"]) == (1, 600)
    assert plan["spec"]["max_node_failures"] == 4
    assert plan["spec"]["rdzv_backend"] == "etcd-v2"
    # spot: the drain fits inside the 2-minute interruption notice
    assert plan["spec"]["drain_timeout"] == 90 and plan["parameters"]["DrainTimeout"] == "90"


def test_instance_type_list_becomes_overrides_and_az_rebalance_is_suspended(run, ready):
    r = run(
        "run_job",
        "--name",
        "multi",
        "--min",
        "1",
        "--max",
        "3",
        "--spot",
        "--instance-type",
        "c5.xlarge,c6i.xlarge,m5.xlarge",
        str(ready),
    )
    assert r.exit_code == 0, r.output
    group = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-multi-workers"]
    )["AutoScalingGroups"][0]
    policy = group["MixedInstancesPolicy"]
    assert [o["InstanceType"] for o in policy["LaunchTemplate"]["Overrides"]] == [
        "c5.xlarge",
        "c6i.xlarge",
        "m5.xlarge",
    ]
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == "price-capacity-optimized"
    assert [p["ProcessName"] for p in group["SuspendedProcesses"]] == ["AZRebalance"]


def test_run_job_directory_target(run, ready, tmp_path):
    code = tmp_path / "proj"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "main.py").write_text("print(1)\n")
    (code / ".git").mkdir()
    (code / ".git" / "HEAD").write_text("ref")
    r = run(
        "run_job",
        "--name",
        "dirjob",
        "--min",
        "1",
        "--max",
        "1",
        str(code),
        "--",
        "pkg/main.py",
        "--lr",
        "0.1",
    )
    assert r.exit_code == 0, r.output
    spec = spec_of("dirjob")
    assert spec["code_kind"] == "dir" and spec["script"] == "pkg/main.py" and spec["args"] == ["--lr", "0.1"]
    assert "petctl/jobs/dirjob/code/code.tar.gz" in objects("petctl/jobs/dirjob/")


def test_default_job_name_is_readable_and_the_same_for_dry_and_real_runs(run, ready):
    args = ["--output", "json", "run_job", "--min", "1", "--max", "1", str(ready)]
    dry = json.loads(run(*args[:3], "--dry-run", *args[3:]).stdout)["job"]
    r1 = run(*args)
    assert r1.exit_code == 0, r1.output
    assert json.loads(r1.stdout)["job"] == dry and dry.startswith("train-")
    # the same command again finds the first job instead of launching a twin
    r2 = run(*args)
    assert (
        r2.exit_code == 1
        and f"job '{dry}' already exists" in r2.stderr
        and f"petctl status {dry}" in r2.stderr
    )
    # another command (other sizes) is another job
    r3 = run("--output", "json", "run_job", "--min", "1", "--max", "2", str(ready))
    assert r3.exit_code == 0 and json.loads(r3.stdout)["job"] not in (dry,)


def test_dry_run_text_is_a_short_plan(run, ready):
    r = run(
        "run_job",
        "--dry-run",
        "--min",
        "2",
        "--max",
        "4",
        "--spot",
        "--instance-type",
        "g5.xlarge",
        str(ready),
    )
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "2-4 x g5.xlarge (start 2); spot above 2 on-demand (price-capacity-optimized)" in out
    assert "Deep Learning Base OSS Nvidia Driver AMI" in out and "CUDA torch 2.13.0" in out
    assert "dist/petctl-" in out and ".whl" in out  # the wheel is among the uploads
    assert "AWSTemplateFormatVersion" not in out and "--show-template" in out
    r = run("run_job", "--dry-run", "--show-template", "--min", "2", "--max", "4", str(ready))
    assert "AWSTemplateFormatVersion" in r.stdout


def test_run_job_duplicate_name_refused(run, ready):
    run_job(run, ready)
    r = run("run_job", "--name", "demo", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 1 and "job 'demo' already exists" in r.stderr


def test_failed_stack_leaves_nothing_behind(run, ready, profile_data):
    # A subnet that does not exist makes the job stack fail to create.
    p = profile_data()
    p["subnet_ids"] = ["subnet-0000000000000dead"]
    Path(__import__("os").environ["PETCTL_HOME"], "profiles", "default.json").write_text(json.dumps(p))
    r = run("run_job", "--name", "broken", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 1
    assert "petctl-job-broken" in r.stderr and "Traceback" not in r.output
    names = [
        s["StackName"]
        for s in boto3.client("cloudformation").describe_stacks()["Stacks"]
        if s["StackStatus"] != "DELETE_COMPLETE"
    ]
    assert names == ["petctl-default"]
    assert objects("petctl/jobs/broken/") == []
    assert boto3.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"] == []


def test_interrupted_run_job_cleans_up(run, ready, monkeypatch):
    """Ctrl-C while waiting for the new stack: the stack and the uploads are removed."""
    from petctl.gateway import stacks

    real_wait = stacks.Stacks.wait
    calls = []

    def interrupted_once(self, *a, **k):
        calls.append(a)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(self, *a, **k)

    monkeypatch.setattr(stacks.Stacks, "wait", interrupted_once)
    r = run("run_job", "--name", "ctrlc", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 130 and "interrupted" in r.stderr
    live = [
        s["StackName"]
        for s in boto3.client("cloudformation").describe_stacks()["Stacks"]
        if s["StackStatus"] != "DELETE_COMPLETE"
    ]
    assert live == ["petctl-default"]
    assert objects("petctl/jobs/ctrlc/") == []


def test_scale_within_and_outside_range(run, ready):
    run_job(run, ready)
    r = run("scale", "demo", "--size", "4")
    assert r.exit_code == 0 and "2 -> 4" in r.stdout
    group = boto3.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-demo-workers"]
    )
    assert group["AutoScalingGroups"][0]["DesiredCapacity"] == 4
    r = run("scale", "demo", "--size", "9")
    assert r.exit_code == 2 and "--size 9 is outside the job's range [2, 4]" in r.stderr


def test_list_hosts_and_status(run, ready):
    run_job(run, ready)
    r = run("--output", "json", "list_hosts", "demo")
    assert r.exit_code == 0, r.output
    hosts = json.loads(r.stdout)
    roles = sorted(h["role"] for h in hosts)
    assert roles == ["rdzv", "worker", "worker"]
    assert all(h["private_ip"] and h["ssm"].startswith("aws ssm start-session --target i-") for h in hosts)
    r = run("--output", "json", "status", "demo")
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)
    assert st["state"] == "STARTING" and st["desired"] == 2 and st["in_service"] == 2
    text = run("status", "demo").stdout
    assert "job demo: STARTING" in text and "WORKER" not in text and "worker" in text


def test_status_reads_agent_reports(run, ready):
    run_job(run, ready)
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    ids = [
        i["InstanceId"]
        for i in boto3.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=["petctl-demo-workers"]
        )["AutoScalingGroups"][0]["Instances"]
    ]
    for n, iid in enumerate(ids):
        report = {
            "version": 1,
            "job_name": "demo",
            "instance_id": iid,
            "state": "RUNNING",
            "world_size": 2,
            "round": 1,
            "restarts": 0,
            "last_step": 100 + n,
            "last_checkpoint_step": 100,
            "events": [{"t": 1.0 + n, "kind": "rendezvous_done", "round": 1, "world_size": 2}],
        }
        s3.put_object(
            Bucket=bucket, Key=f"petctl/jobs/demo/status/{iid}.json", Body=json.dumps(report).encode()
        )
    st = json.loads(run("--output", "json", "status", "demo").stdout)
    assert (
        st["state"] == "RUNNING"
        and st["world_size"] == 2
        and st["last_step"] == 101
        and st["last_checkpoint_step"] == 100
    )
    assert len(st["events"]) == 2
    jobs = json.loads(run("--output", "json", "jobs").stdout)
    assert [(j["job"], j["state"]) for j in jobs] == [("demo", "RUNNING")]


def test_unknown_job_errors(run, ready):
    for cmd in (["status", "ghost"], ["scale", "ghost", "--size", "1"], ["list_hosts", "ghost"]):
        r = run(*cmd)
        assert r.exit_code == 3 and "job 'ghost' not found" in r.stderr, cmd


def test_kill_job_is_idempotent(run, ready):
    run_job(run, ready)
    r = run("kill_job", "demo", "--yes")
    assert r.exit_code == 0 and "job demo deleted" in r.stdout
    assert (
        boto3.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=["petctl-demo-workers"]
        )["AutoScalingGroups"]
        == []
    )
    r = run("kill-job", "demo", "-y")
    assert r.exit_code == 0 and "does not exist" in r.stdout


def test_teardown_refuses_with_jobs_unless_forced(run, ready):
    run_job(run, ready)
    r = run("teardown", "--yes")
    assert r.exit_code == 1 and "still has jobs (demo)" in r.stderr
    r = run("teardown", "--force", "--yes")
    assert r.exit_code == 0, r.output
    assert "petctl-job-demo" in r.stdout and "petctl-default" in r.stdout


def test_upload(run, ready, tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("a")
    (d / "sub" / "b.txt").write_text("b")
    r = run("--output", "json", "upload", str(d))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["count"] == 2
    assert sorted(objects("petctl/uploads/data/")) == [
        "petctl/uploads/data/a.txt",
        "petctl/uploads/data/sub/b.txt",
    ]


def test_logs_prints_agent_streams(run, ready):
    logs = boto3.client("logs")
    logs.create_log_stream(logGroupName="/petctl/default", logStreamName="demo/i-0abc")
    import time

    now = int(time.time() * 1000)
    logs.put_log_events(
        logGroupName="/petctl/default",
        logStreamName="demo/i-0abc",
        logEvents=[{"timestamp": now, "message": "step=5 world_size=2"}],
    )
    r = run("logs", "demo", "--since", "1h")
    assert r.exit_code == 0, r.output
    assert "i-0abc step=5 world_size=2" in r.stdout


def test_ami_override_is_checked_and_its_root_device_used(run, ready):
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]
    r = run(
        "--output",
        "json",
        "run_job",
        "--dry-run",
        "--ami",
        image["ImageId"],
        "--min",
        "1",
        "--max",
        "1",
        str(ready),
    )
    assert r.exit_code == 0, r.output
    params = json.loads(r.stdout)["parameters"]
    assert params["ImageId"] == image["ImageId"] and params["RootDeviceName"] == image["RootDeviceName"]
    r = run("run_job", "--dry-run", "--ami", "ami-0123456789abcdef0", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 2 and "--ami ami-0123456789abcdef0" in r.stderr and "Traceback" not in r.output


def test_s3_target_outside_the_petctl_prefix_warns(run, ready):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="someone-elses-bucket")
    s3.put_object(Bucket="someone-elses-bucket", Key="train.py", Body=b"print(1)\n")
    r = run("run_job", "--dry-run", "--min", "1", "--max", "1", "s3://someone-elses-bucket/train.py")
    assert r.exit_code == 0, r.output
    assert "is outside s3://" in r.stderr and "petctl upload" in r.stderr


def test_reused_job_name_starts_without_old_reports(run, ready):
    run_job(run, ready)
    first_run = spec_of("demo")["run_id"]
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    old = {"version": 1, "instance_id": "i-0old", "state": "FAILED", "reason": "old run", "last_step": 99}
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo/status/i-0old.json", Body=json.dumps(old).encode())
    assert json.loads(run("--output", "json", "status", "demo").stdout)["state"] == "FAILED"
    assert run("kill_job", "demo", "--yes").exit_code == 0
    run_job(run, ready)
    st = json.loads(run("--output", "json", "status", "demo").stdout)
    assert st["state"] == "STARTING" and st["last_step"] is None
    # the checkpoint dir's markers outlive the first run: the agents tell the runs apart by this
    assert len(first_run) == 16 and spec_of("demo")["run_id"] not in ("", first_run)


def test_jobs_ignores_reports_of_instances_that_are_gone(run, ready):
    run_job(run, ready)
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    ghost = {"version": 1, "instance_id": "i-0killed", "state": "RUNNING", "world_size": 2}
    s3.put_object(
        Bucket=bucket, Key="petctl/jobs/demo/status/i-0killed.json", Body=json.dumps(ghost).encode()
    )
    jobs = json.loads(run("--output", "json", "jobs").stdout)
    assert [(j["job"], j["state"]) for j in jobs] == [("demo", "STARTING")]


def test_ctrl_c_during_create_stack_call_cleans_up(run, ready, monkeypatch):
    """The request reached CloudFormation, then Ctrl-C: the stack it made must still go."""
    from petctl.gateway import stacks

    real_init = stacks.Stacks.__init__

    def init(self, cf, *a, **k):
        real_init(self, cf, *a, **k)
        real_create = cf.create_stack

        def create_then_interrupt(**kw):
            real_create(**kw)
            raise KeyboardInterrupt

        self.cf = type(
            "CF",
            (),
            {
                "__getattr__": lambda _s, n: getattr(cf, n),
                "create_stack": staticmethod(create_then_interrupt),
            },
        )()

    monkeypatch.setattr(stacks.Stacks, "__init__", init)
    r = run("run_job", "--name", "ctrlc2", "--min", "1", "--max", "1", str(ready))
    assert r.exit_code == 130 and "interrupted" in r.stderr
    live = [
        s["StackName"]
        for s in boto3.client("cloudformation").describe_stacks()["Stacks"]
        if s["StackStatus"] != "DELETE_COMPLETE"
    ]
    assert live == ["petctl-default"]
    assert boto3.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"] == []


def test_tls_keys_are_uploaded_encrypted_and_deleted_with_the_job(run, ready):
    run_job(run, ready)
    s3 = boto3.client("s3")
    bucket = [b["Name"] for b in s3.list_buckets()["Buckets"]][0]
    # another job whose name starts the same: its files are not this job's
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo2/status/i-0other.json", Body=b"{}")
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo/status/i-0abc.json", Body=b"{}")
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo/boot/i-0abc.log", Body=b"boot")
    keys = sorted(objects("petctl/jobs/demo/tls/"))
    assert keys == [f"petctl/jobs/demo/tls/{n}" for n in ("ca.key", "ca.pem", "client.key", "client.pem")]
    for key in keys:
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["ServerSideEncryption"] == "AES256", key
    assert b"BEGIN CERTIFICATE" in s3.get_object(Bucket=bucket, Key=keys[1])["Body"].read()
    assert run("kill-job", "demo", "--yes").exit_code == 0
    # the whole prefix: secrets, uploads (code, spec, wheel, template) and reports
    assert objects("petctl/jobs/demo/") == []
    assert objects("petctl/jobs/demo2/") == ["petctl/jobs/demo2/status/i-0other.json"]


def test_kill_job_no_wait_keeps_the_tls_keys_until_the_next_kill_job(run, ready):
    """Should the deletion fail (DELETE_FAILED), the groups left would launch instances whose boot
    needs the keys: --no-wait keeps them, and a kill-job that finds the stack gone deletes them."""
    run_job(run, ready)
    r = run("kill-job", "demo", "--yes", "--no-wait")
    assert r.exit_code == 0 and "deletion started" in r.stdout
    assert "petctl kill-job demo` again once it is gone" in " ".join(r.stdout.split()), r.stdout
    assert len(objects("petctl/jobs/demo/tls/")) == 4
    assert "petctl/jobs/demo/job.json" in objects("petctl/jobs/demo/")
    r = run("kill-job", "demo", "--yes")
    assert r.exit_code == 0 and "does not exist" in r.stdout
    assert objects("petctl/jobs/demo/") == []


def test_warm_pool_is_made_and_its_hosts_are_warmed_not_capacity(run, ready):
    out = run_job(run, ready, "--warm-pool", "1")
    assert out["job"] == "demo"
    asg = boto3.client("autoscaling")
    pool = asg.describe_warm_pool(AutoScalingGroupName="petctl-demo-workers")
    assert pool["WarmPoolConfiguration"]["PoolState"] == "Stopped"
    st = json.loads(run("-o", "json", "status", "demo").stdout)
    workers = [h for h in st["hosts"] if h["role"] == "worker"]
    warmed = [h for h in workers if h["lifecycle_state"].startswith("Warmed:")]
    assert len(warmed) == 1 and warmed[0]["agent_state"] == "WARMED"  # the pool's one instance
    assert st["in_service"] == 2 == len(workers) - 1  # running capacity: the pool is not part of it
    r = run(
        "run-job", "--dry-run", "--name", "warm2", "--min", "1", "--max", "2", "--warm-pool", "2", str(ready)
    )
    assert r.exit_code == 0 and "warm pool:    2 stopped instance(s)" in r.stdout


def test_kill_job_deletes_the_warm_pool_so_its_stopped_instances_do_not_hold_it(run, ready):
    run_job(run, ready, "--warm-pool", "1")
    asg = boto3.client("autoscaling")
    r = run("kill-job", "demo", "--yes")
    # Scaled to zero, the group keeps its pool; waiting for "workers gone" with the pool's stopped
    # instance still there would run to its timeout (drain + 120 s) and leave it billing.
    assert r.exit_code == 0 and "deleting the warm pool" in r.output, r.output
    assert "still waiting" not in r.output, r.output
    ec2 = boto3.client("ec2")
    left = [
        i["InstanceId"]
        for page in ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "tag:petctl:job", "Values": ["demo"]}]
        )
        for res in page["Reservations"]
        for i in res["Instances"]
        if i["State"]["Name"] not in ("terminated", "shutting-down")
    ]
    assert left == []
    assert (
        asg.describe_auto_scaling_groups(AutoScalingGroupNames=["petctl-demo-workers"])["AutoScalingGroups"]
        == []
    )


def test_kill_job_deletes_the_warm_pool_even_when_the_scale_to_zero_raises(run, ready, monkeypatch):
    from petctl.gateway import groups

    def stop_then_raise(self, name):
        stop(self, name)  # done, but its answer lost: the pool must be deleted all the same
        raise RuntimeError("connection reset")

    stop = groups.Groups.stop
    monkeypatch.setattr(groups.Groups, "stop", stop_then_raise)
    run_job(run, ready, "--warm-pool", "1")
    r = run("kill-job", "demo", "--yes")
    assert r.exit_code == 0, r.output
    assert "could not scale petctl-demo-workers to zero" in r.output
    assert "deleting the warm pool of petctl-demo-workers" in r.output
    assert "still waiting" not in r.output, r.output


def test_kill_job_asks_for_no_warm_pool_where_the_stack_has_none(run, ready, monkeypatch):
    """A user policy without autoscaling:DescribeWarmPool kills a job made without --warm-pool
    without a warning: only a stack with WarmPoolSize is asked for its pool."""
    from petctl.gateway import groups

    def denied(self, name):
        raise AssertionError(f"DescribeWarmPool on {name}, a group without a warm pool")

    monkeypatch.setattr(groups.Groups, "delete_warm_pool", denied)
    run_job(run, ready)
    r = run("kill-job", "demo", "--yes")
    assert r.exit_code == 0 and "job demo deleted" in r.stdout, r.output
    assert "could not" not in r.output, r.output


def test_kill_job_with_no_stack_leaves_another_regions_job_files_alone(run, ready):
    """With no stack here, kill-job deletes what a `--no-wait` left; but a bucket shared with a
    profile of another region may hold a running job of that name, whose stack is not here to find:
    its job.json names its region, and that job's files are never deleted from this one."""
    run_job(run, ready)
    r = run("kill-job", "demo", "--yes", "--no-wait")
    assert r.exit_code == 0
    bucket = next(b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"])
    s3 = boto3.client("s3")
    spec = json.loads(s3.get_object(Bucket=bucket, Key="petctl/jobs/demo/job.json")["Body"].read())
    assert spec["region"] == "us-east-1"
    spec["region"] = "eu-west-1"  # now the files of a job `demo` running in eu-west-1
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo/job.json", Body=json.dumps(spec).encode())
    before = objects("petctl/jobs/demo/")
    r = run("kill-job", "demo", "--yes")
    assert r.exit_code == 0, r.output
    assert "belongs to a job demo in eu-west-1" in " ".join(r.stderr.split()), r.stderr
    assert objects("petctl/jobs/demo/") == before and "petctl/jobs/demo/tls/ca.key" in before
    # this region's own leftovers still go
    spec["region"] = "us-east-1"
    s3.put_object(Bucket=bucket, Key="petctl/jobs/demo/job.json", Body=json.dumps(spec).encode())
    assert run("kill-job", "demo", "--yes").exit_code == 0
    assert objects("petctl/jobs/demo/") == []
