"""Long-run logic that a CPU can show without processes: exit-code classification, restart
budget inputs, the below-MIN wait decision, spec fields, the torch internals check,
OMP_NUM_THREADS, signal handler re-installation, lifecycle completion at job end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from harness import FakeImds

from petctl_agent import DRAIN_EXIT_CODE, EXIT_TERMINAL
from petctl_agent.cloud import aws
from petctl_agent.cloud.imds import Imds
from petctl_agent.elastic.agent import PetctlElasticAgent
from petctl_agent.elastic.decisions import capacity_coming, classify_exits, keep_waiting
from petctl_agent.elastic.torch_compat import REQUIRED, Member, check, missing_members, version_mismatch
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError

TERM, KILL = -int(signal.SIGTERM), -int(signal.SIGKILL)
BASE = {"job_name": "j-1", "min_nodes": 2, "max_nodes": 4, "code_url": "file:///x.py", "script": "x.py"}


@pytest.mark.parametrize(
    ("codes", "kind"),
    [
        ([DRAIN_EXIT_CODE], "drain"),
        ([DRAIN_EXIT_CODE, DRAIN_EXIT_CODE], "drain"),  # every local rank reached the drain
        ([DRAIN_EXIT_CODE, TERM], "drain"),  # the sibling torch SIGTERMed after rank 0 exited 75
        ([DRAIN_EXIT_CODE, TERM, TERM, TERM], "drain"),  # 4 GPUs
        ([DRAIN_EXIT_CODE, KILL], "drain"),  # ... and SIGKILLed past torch's grace period
        ([TERM], "failure"),  # nobody drained: something else terminated the worker
        ([1, DRAIN_EXIT_CODE], "failure"),  # a real error next to a drain
        ([1], "failure"),
        ([None], "failure"),
        ([], "failure"),
    ],
)
def test_exit_code_classification(codes, kind) -> None:
    assert classify_exits(codes) == kind


def test_capacity_and_the_below_min_wait() -> None:
    assert capacity_coming(None, 2) is None
    assert capacity_coming({"desired": 2, "pending": 0}, 2) is True
    assert capacity_coming({"desired": 1, "pending": 1}, 2) is True  # still launching
    assert capacity_coming({"desired": 1, "pending": 0}, 2) is False
    # within join_timeout: always wait
    assert keep_waiting(10, 1800, False) and keep_waiting(10, 1800, None)
    # past it: only while capacity is coming, and never past 2x
    assert keep_waiting(1900, 1800, True)
    assert not keep_waiting(1900, 1800, False) and not keep_waiting(1900, 1800, None)
    assert not keep_waiting(3600, 1800, True)


def test_spec_restart_budget_join_timeout_torch_version() -> None:
    old = JobSpec.from_dict(dict(BASE))  # a spec written before these fields existed
    assert (old.max_restarts, old.join_timeout, old.torch_version) == (10, 1800.0, "")
    new = JobSpec.from_dict({**BASE, "max_restarts": 1, "join_timeout": 600, "torch_version": "2.13.0"})
    assert (new.max_restarts, new.join_timeout, new.torch_version) == (1, 600.0, "2.13.0")
    for bad, msg in [
        ({"max_restarts": -1}, "max_restarts must be >= 0"),
        ({"join_timeout": 0}, "join_timeout must be between"),
        ({"join_timeout": "soon"}, "non-numeric"),
        ({"torch_version": "latest"}, "torch_version must be a version"),
        ({"torch_version": 2.13}, "torch_version must be a version"),
    ]:
        with pytest.raises(SpecError, match=msg):
            JobSpec.from_dict({**BASE, **bad})


def test_torch_internals_exist_in_the_installed_torch() -> None:
    import torch

    assert missing_members() == [], f"torch {torch.__version__} lacks agent internals"
    assert check(torch.__version__.split("+")[0]) is None
    assert len(REQUIRED) > 30
    # the check does notice a missing member, of each kind, and names it with the version
    fake = (
        Member("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_no_such_method"),
        Member("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_no_such_attr", "self"),
        Member("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NoSuchClass"),
    )
    assert missing_members(fake) == [m.name for m in fake]
    line = check("", fake)
    assert line and "\n" not in line and torch.__version__ in line and "_no_such_method" in line


def test_torch_version_pin() -> None:
    assert not version_mismatch("", "2.13.0+cpu")
    assert not version_mismatch("2.13.0", "2.13.0+cpu") and not version_mismatch("2.13.0", "2.13.0+cu128")
    assert version_mismatch("2.13.0+cu128", "2.13.0+cpu")
    assert version_mismatch("2.8.0", "2.13.0+cpu")
    assert "pins torch_version 2.8.0" in (check("2.8.0") or "")


def test_omp_num_threads_as_torchrun() -> None:
    from petctl_agent.worker.env import omp_num_threads

    assert omp_num_threads({}, 2) == "1"
    assert omp_num_threads({}, 1) is None
    assert omp_num_threads({"OMP_NUM_THREADS": "8"}, 4) is None


def test_our_sigterm_handler_is_put_back_after_torch_replaces_it() -> None:
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    def ours(signum, frame):  # noqa: ARG001
        pass

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, ours)
        fake = SimpleNamespace(_own_signal_handlers={signal.SIGTERM: ours})
        signal.signal(signal.SIGTERM, _terminate_process_handler)  # what PContext.start does in torch 2.5-2.8
        PetctlElasticAgent._restore_signal_handlers(fake)
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def _saving_worker(save_s: float) -> subprocess.Popen:
    """A worker whose SIGTERM handler saves its own checkpoint for ``save_s`` and exits 0."""
    code = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (time.sleep({save_s}), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize(("loss", "code"), [(False, 0), (True, KILL)], ids=["join", "loss"])
def test_only_a_loss_bounds_the_workers_stop(monkeypatch, loss: bool, code: int) -> None:
    """The SIGTERM sent before a membership restart's rendezvous arms LOSS_STOP_GRACE (then
    SIGKILL) only for a loss or stalled workers (hung in a collective). A join keeps torch's
    stop (30 s): a script whose SIGTERM handler saves its checkpoint (here 1.5 s, the grace
    shrunk to 0.5 s) finishes it; it was SIGKILLed mid-save (a torn torch.save)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from petctl_agent.elastic import processes

    monkeypatch.setattr(processes, "LOSS_STOP_GRACE", 0.5)
    torch_stopped: list[int | None] = []

    def torch_stop(self, wg, *a, **k) -> None:  # noqa: ARG001  torch's close: SIGTERM, wait up to 30 s
        torch_stopped.append(proc.poll())
        proc.wait(30)

    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", torch_stop)
    proc = _saving_worker(1.5)
    try:
        a = object.__new__(PetctlElasticAgent)
        a._pcontext = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=proc)})
        a._sigterm_at, a._stop_bounded = None, loss  # what _invoke_run sets for the change
        a._sigterm_before_rendezvous()
        time.sleep(0.8)  # the rendezvous: longer than the grace
        a._stop_workers(SimpleNamespace())
        assert proc.wait(5) == code, (loss, proc.returncode)
        assert len(torch_stopped) == 1  # torch's stop ran after ours, as always
        assert a._stop_bounded is False and a._sigterm_at is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _lifecycle(monkeypatch, imds_url: str, calls: list) -> Lifecycle:
    spec = JobSpec.from_dict({**BASE, "worker_group": "petctl-j-1-workers", "lifecycle_hook": "petctl-drain"})
    lifecycle = Lifecycle(spec, Imds(imds_url), Settings(imds_poll=0.1), "i-end")

    class Client:
        def complete_lifecycle_action(self, **kw):
            calls.append(("complete", kw))

        def describe_auto_scaling_groups(self, **kw):
            calls.append(("describe", kw))
            inst = [{"LifecycleState": s} for s in ("InService", "Pending", "Pending:Wait")]
            return {"AutoScalingGroups": [{"DesiredCapacity": 3, "Instances": inst}]}

    monkeypatch.setattr(aws, "client", lambda *a, **k: Client())
    return lifecycle


def test_job_end_completes_the_lifecycle_action_once_terminating(monkeypatch) -> None:
    imds = FakeImds()
    try:
        url = imds.add("i-end", "127.0.0.1")
        calls: list = []
        lifecycle = _lifecycle(monkeypatch, url, calls)
        # the groups were just scaled to zero: the instance enters Terminating:Wait a bit later
        threading.Timer(0.5, imds.set, ("i-end", "autoscaling/target-lifecycle-state", "Terminated")).start()
        t0 = time.monotonic()
        lifecycle.complete_action_at_end(20)
        assert time.monotonic() - t0 < 10
        assert calls == [
            (
                "complete",
                {
                    "LifecycleHookName": "petctl-drain",
                    "AutoScalingGroupName": "petctl-j-1-workers",
                    "LifecycleActionResult": "CONTINUE",
                    "InstanceId": "i-end",
                },
            )
        ]
        # not terminating and no wait: nothing to complete
        imds.set("i-end", "autoscaling/target-lifecycle-state", "InService")
        calls.clear()
        lifecycle.pending = False
        lifecycle.complete_action_at_end(0)
        assert calls == []
        assert lifecycle.capacity() == {"desired": 3, "in_service": 1, "pending": 2}
    finally:
        imds.close()


def test_wrong_torch_fails_in_one_line_before_the_rendezvous(tmp_path) -> None:
    """An agent whose torch does not match the spec publishes FAILED and never contacts etcd."""
    status = tmp_path / "status"
    spec = {**BASE, "code_url": f"file://{tmp_path}/x.py", "torch_version": "1.0.0",
            "status_url": f"file://{status}/"}  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(spec))
    (tmp_path / "x.py").write_text("print('never runs')\n")
    env = {"PETCTL_IMDS_URL": "http://127.0.0.1:9", "PETCTL_AGENT_DIR": str(tmp_path / "agent"),
           "PETCTL_EFS_MOUNT": str(tmp_path), "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "PATH": "/usr/bin:/bin"}  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "petctl_agent.main", "run", "--spec", str(tmp_path / "job.json"),
         "--rdzv-endpoint", "127.0.0.1:9", "--local-addr", "127.0.0.1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert p.returncode == EXIT_TERMINAL, p.stderr  # terminal: systemd must not restart it
    doc = json.loads(next(status.glob("*.json")).read_text())
    assert doc["state"] == "FAILED"
    # counted where failed boots are (boot/, next to status/), with its one-line reason
    (record,) = (tmp_path / "boot").glob("*.log")
    assert record.read_text().startswith("petctl agent: FAILED (exit 78): torch ")
    assert doc["reason"].startswith("torch ") and "pins torch_version 1.0.0" in doc["reason"]
    assert "\n" not in doc["reason"]
    assert not any(e["kind"].startswith("rendezvous") for e in doc["events"])
    assert "FAILED: torch" in p.stderr


@pytest.mark.parametrize("launch_hook", ["petctl-launch", ""], ids=["warm_pool", "no_pool"])
def test_job_end_deletes_the_warm_pool_with_the_groups(moto_endpoint, launch_hook) -> None:
    """A group scaled to zero keeps its warm pool (its size is absolute): the job's end deletes it,
    so no stopped pool instance bills until kill-job. Only a worker with a launch hook (the
    stacks with a warm pool, whose role may delete one) tries."""
    ec2, asg = aws.client("ec2"), aws.client("autoscaling")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(
        LaunchTemplateName="lt",
        LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.medium"},
    )["LaunchTemplate"]["LaunchTemplateId"]
    for group, size in (("petctl-j-1-workers", 1), ("petctl-j-1-rdzv", 1)):
        asg.create_auto_scaling_group(
            AutoScalingGroupName=group,
            LaunchTemplate={"LaunchTemplateId": template},
            MinSize=size,
            MaxSize=2,
            DesiredCapacity=size,
            VPCZoneIdentifier=subnet,
        )
    asg.put_warm_pool(AutoScalingGroupName="petctl-j-1-workers", MinSize=1, MaxGroupPreparedCapacity=1)
    (warm,) = asg.describe_warm_pool(AutoScalingGroupName="petctl-j-1-workers")["Instances"]
    spec = JobSpec.from_dict({**BASE, "worker_group": "petctl-j-1-workers", "rdzv_group": "petctl-j-1-rdzv"})
    Lifecycle(
        spec, Imds("http://127.0.0.1:9"), Settings(launch_hook=launch_hook), "i-end"
    ).scale_groups_to_zero()

    groups = asg.describe_auto_scaling_groups()["AutoScalingGroups"]
    assert {(g["MinSize"], g["DesiredCapacity"]) for g in groups} == {(0, 0)}
    pool = asg.describe_warm_pool(AutoScalingGroupName="petctl-j-1-workers")
    (reservation,) = ec2.describe_instances(InstanceIds=[warm["InstanceId"]])["Reservations"]
    state = reservation["Instances"][0]["State"]["Name"]
    if launch_hook:
        assert not pool.get("WarmPoolConfiguration") and not pool["Instances"]
        assert state == "terminated"
    else:
        assert [i["InstanceId"] for i in pool["Instances"]] == [warm["InstanceId"]]
