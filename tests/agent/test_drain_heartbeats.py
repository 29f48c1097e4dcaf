"""The termination hook's heartbeats: a drain longer than the hook's timeout is not cut off.

The drain hook's HeartbeatTimeout is the job's drain timeout, counted from Terminating:Wait; the
agent sees that state an IMDS poll later and may drain the whole drain timeout, then stops its
workers and completes the action. Without heartbeats AWS abandons the action (and terminates the
instance) before a full-length drain ends. moto cannot fake a pending termination action, so a
Stubber stands for Auto Scaling; the local cloud's side (a heartbeat restarts the timeout, up to
AWS's global limit) is checked on :func:`petctl.local.leaving.hook_deadline`.
"""

from __future__ import annotations

import threading

import boto3
import pytest
from botocore.stub import Stubber
from harness import FakeImds, wait_for

from petctl.local.leaving import hook_deadline
from petctl_agent.cloud.imds import Imds
from petctl_agent.node.lifecycle import Lifecycle, drain_heartbeat_plan
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec

SPEC = JobSpec.from_dict(
    {
        "job_name": "drain",
        "min_nodes": 1,
        "max_nodes": 2,
        "code_url": "x.py",
        "script": "x.py",
        "worker_group": "petctl-drain-workers",
        "lifecycle_hook": "petctl-drain",
        "drain_timeout": 90,
    }
)
BEAT = {
    "LifecycleHookName": "petctl-drain",
    "AutoScalingGroupName": "petctl-drain-workers",
    "InstanceId": "i-d",
}


@pytest.fixture
def imds():
    f = FakeImds()
    yield f
    f.close()


def _lifecycle(imds, monkeypatch) -> tuple[Lifecycle, Stubber]:
    url = imds.add("i-d", "127.0.0.1")
    lc = Lifecycle(SPEC, Imds(url, timeout=1), Settings(imds_poll=0.05), "i-d")
    client = boto3.client(
        "autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    monkeypatch.setattr(lc, "_autoscaling", lambda: client)
    return lc, Stubber(client)


def test_a_draining_node_heartbeats_its_termination_action_until_it_completes(imds, monkeypatch) -> None:
    lc, stub = _lifecycle(imds, monkeypatch)
    with stub:
        for _ in range(2):
            stub.add_response("record_lifecycle_action_heartbeat", {}, BEAT)
        t = threading.Thread(target=lc.drain_heartbeats, args=(0.2, 60))
        t.start()
        wait_for(lambda: not stub._queue, 20, "two heartbeats")
        # the drain ends: completing the action ends the heartbeats (a third call would fail the Stubber)
        imds.set("i-d", "autoscaling/target-lifecycle-state", "Terminated")
        stub.add_response("complete_lifecycle_action", {}, {**BEAT, "LifecycleActionResult": "CONTINUE"})
        lc.complete_action()
        t.join(5)
        assert not t.is_alive()
        stub.assert_no_pending_responses()


def test_the_imds_watch_starts_the_heartbeats_when_the_instance_enters_terminating_wait(
    imds, monkeypatch
) -> None:
    lc, stub = _lifecycle(imds, monkeypatch)
    started: list[tuple] = []
    monkeypatch.setattr(lc, "drain_heartbeats", lambda *a: started.append(a))
    left: list[str] = []
    imds.set("i-d", "autoscaling/target-lifecycle-state", "Terminated")
    lc.watch(threading.Event(), left.append)
    wait_for(lambda: started, 10, "the heartbeat thread")
    assert left == ["autoscaling target-lifecycle-state=Terminated"] and lc.pending


def test_the_heartbeats_are_bounded_so_a_hung_agent_never_holds_its_instance() -> None:
    every, limit = drain_heartbeat_plan(SPEC.drain_timeout)
    assert every < SPEC.drain_timeout / 2  # a late or failed call still leaves one more before the timeout
    assert 2 * SPEC.drain_timeout < limit < 100 * SPEC.drain_timeout  # beyond the drain, inside AWS's limit


def test_the_local_cloud_times_the_action_out_as_aws_does() -> None:
    t0 = 1000.0
    assert hook_deadline(t0, None, 30, 0) == t0 + 30  # no heartbeat: the hook's timeout
    assert hook_deadline(t0, t0 + 25, 30, 0) == t0 + 55  # a heartbeat restarts it
    assert hook_deadline(t0, t0 + 25, 30, 10) == t0 + 65  # the local cloud's IMDS slack on top
    # the global limit: 100 heartbeat timeouts (or 48 h) after the start, whatever the heartbeats
    assert hook_deadline(t0, t0 + 2995, 30, 0) == t0 + 3000
    assert hook_deadline(t0, t0 + 10**6, 7200, 0) == t0 + 48 * 3600
