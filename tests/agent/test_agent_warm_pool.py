"""Warm pools: an instance in a ``Warmed:*`` state never joins the rendezvous.

Unit: the agent's wait against the fake IMDS. End to end: a real agent started warmed publishes
``WARMED``, registers nowhere while it stays warmed (nor while its process tree is paused and
resumed, as the local cloud does), and trains once IMDS says InService.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import boto3
import pytest
from botocore.stub import Stubber
from harness import FakeImds, wait_for

from petctl_agent.cloud.imds import Imds
from petctl_agent.cloud.status import STATES
from petctl_agent.node.agent import Agent
from petctl_agent.node.lifecycle import Lifecycle
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec

STATE = "autoscaling/target-lifecycle-state"


class Pub:
    def __init__(self) -> None:
        self.states: list[str] = []
        self.flushed: list[str] = []  # the state at each flush (written out, not only queued)

    def update(self, **kw) -> None:
        if "state" in kw:
            self.states.append(kw["state"])

    def flush(self) -> None:
        self.flushed.append(self.states[-1] if self.states else "")

    def snapshot(self) -> dict:
        return {"state": self.states[-1] if self.states else None}


@pytest.fixture
def imds():
    f = FakeImds()
    yield f
    f.close()


SPEC = JobSpec.from_dict(
    {"job_name": "warm", "min_nodes": 1, "max_nodes": 2, "code_url": "x.py", "script": "x.py"}
)


def _agent(url: str) -> Agent:
    settings, imds = Settings(imds_poll=0.05), Imds(url, timeout=1)
    a = Agent(SimpleNamespace(local_addr="127.0.0.1"), settings, imds)
    a.lifecycle = Lifecycle(SPEC, imds, settings, a.instance_id)
    a.pub = Pub()
    return a


def test_warmed_waits_until_in_service(imds) -> None:
    assert "WARMED" in STATES
    url = imds.add("i-warm", "127.0.0.1")
    imds.set("i-warm", STATE, "Warmed:Running")
    a = _agent(url)
    t = threading.Thread(target=a._wait_while_warmed)
    t.start()
    wait_for(lambda: a.pub.states, 10, "WARMED")  # the thread's first IMDS read (slow on a loaded box)
    time.sleep(0.3)
    assert t.is_alive() and a.pub.states == ["WARMED"]
    imds.set("i-warm", STATE, "Warmed:Pending")  # still warmed: keeps waiting
    time.sleep(0.3)
    assert t.is_alive()
    imds.set("i-warm", STATE, None)  # a failed read is no InService: joining now would re-form
    time.sleep(0.3)  # the whole job's round just before AWS stops this instance
    assert t.is_alive() and a.pub.states == ["WARMED"]
    imds.set("i-warm", STATE, "InService")
    t.join(5)
    assert not t.is_alive() and a.pub.states == ["WARMED", "STARTING"]


def test_absent_state_is_in_service_and_a_leave_ends_the_wait(imds) -> None:
    url = imds.add("i-plain", "127.0.0.1")
    imds.set("i-plain", STATE, None)  # 404: an instance outside a group with a warm pool
    a = _agent(url)
    t0 = time.monotonic()
    a._wait_while_warmed()
    took = time.monotonic() - t0
    assert took < 5 and a.pub.states == [] and a.lifecycle.state() == "InService"  # no wait (loose bound)

    imds.set("i-plain", STATE, "Warmed:Stopped")
    t = threading.Thread(target=a._wait_while_warmed)
    t.start()
    time.sleep(0.3)
    a.leave_reason = "signal SIGTERM"
    t.join(5)
    assert not t.is_alive()


@pytest.mark.e2e
def test_warmed_agent_joins_only_once_in_service(make_cluster) -> None:
    from petctl.local.procs import descendants

    c = make_cluster(job="warm", min_nodes=1, max_nodes=2,
                     script_args=["--total-steps", "20", "--step-time", "0.05", "--checkpoint-every", "10"])  # fmt: skip
    a = c.add_node(lifecycle_state="Warmed:Running")
    c.wait(lambda: (c.status(a.instance_id) or {}).get("state") == "WARMED", 90, "a WARMED", alive=[a])
    # the local cloud's warm pool: the instance's process tree is paused, later resumed
    tree = [a.proc.pid, *descendants(a.proc.pid)]
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(1)
    for pid in tree:
        os.kill(pid, signal.SIGCONT)
    time.sleep(2)
    doc = c.status(a.instance_id) or {}
    assert doc.get("state") == "WARMED" and a.alive() and not a.steps
    assert not [e for e in doc.get("events", []) if e["kind"] in ("workers_ready", "rendezvous_start")]
    from petctl_agent.rendezvous import DEFAULT_PREFIX
    from petctl_agent.rendezvous import etcdv3 as v3

    # petctl-etcd writes etcd v3 keys (the v2 store would always look empty)
    assert not v3.Client(c.etcd.endpoint).range(DEFAULT_PREFIX, prefix=True).kvs, (
        "a warmed agent registered with the rendezvous"
    )

    # AWS stops a pool instance once its boot is done (systemd: SIGTERM). It never trained: it
    # exits without a drain and without LEFT, which would tell `status` it once trained.
    b = c.add_node(lifecycle_state="Warmed:Pending")
    c.wait(lambda: (c.status(b.instance_id) or {}).get("state") == "WARMED", 90, "b WARMED", alive=[b])
    b.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: b.proc.poll() is not None, 30, "b to exit")
    doc = c.status(b.instance_id) or {}
    assert b.proc.returncode == 0 and doc.get("state") == "WARMED", doc
    assert not [e for e in doc.get("events", []) if e["kind"] in ("drained", "rendezvous_start")], doc

    t = c.now()
    c.imds.set(a.instance_id, STATE, "InService")
    wait_for(lambda: a.proc.poll() is not None, 180, "a to finish the job")
    assert a.proc.returncode == 0 and a.steps and a.steps[0][0] > t
    assert (c.status(a.instance_id) or {}).get("state") == "SUCCEEDED"


def _stubbed(a: Agent, monkeypatch) -> Stubber:
    """moto cannot fake a pending launch action: a Stubber stands for Auto Scaling here."""
    client = boto3.client(
        "autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    stub = Stubber(client)
    monkeypatch.setattr(a.lifecycle, "_autoscaling", lambda: client)
    return stub


def _continue(instance: str = "i-pool", result: str = "CONTINUE") -> dict:
    return {
        "LifecycleHookName": "petctl-launch",
        "AutoScalingGroupName": "petctl-warm-workers",
        "LifecycleActionResult": result,
        "InstanceId": instance,
    }


def _hooked_agent(url: str, tmp_path, instance: str = "i-pool") -> Agent:
    spec = JobSpec.from_dict({**SPEC.to_dict(), "worker_group": "petctl-warm-workers"})
    settings = Settings(imds_poll=0.05, launch_hook="petctl-launch", agent_dir=tmp_path)
    client = Imds(url, timeout=1)
    a = Agent(SimpleNamespace(local_addr="127.0.0.1"), settings, client)
    a.lifecycle = Lifecycle(spec, client, settings, instance)
    a.pub = Pub()
    return a


def test_parking_completes_the_launch_hook_only_after_warmed_and_the_boot(
    imds, monkeypatch, tmp_path
) -> None:
    """A first launch into the pool: the action completes (AWS then stops the instance) only
    once the agent has parked (WARMED written out) and the boot script has ended (else cloud-init
    would run the user data again at the next start); leaving the pool completes it again."""
    url = imds.add("i-pool", "127.0.0.1")
    imds.set("i-pool", STATE, "Warmed:Pending")
    a = _hooked_agent(url, tmp_path)
    stub = _stubbed(a, monkeypatch)
    with stub:  # no response queued yet: a call now would fail the Stubber
        t = threading.Thread(target=a._wait_while_warmed)
        t.start()
        wait_for(lambda: a.pub.states == ["WARMED"], 20, "WARMED")
        time.sleep(0.5)  # the boot is still running: no call
        assert a.pub.flushed == ["WARMED"] and not a.lifecycle.launch_done.is_set()
        stub.add_response("complete_lifecycle_action", {}, _continue())
        (tmp_path / "boot-done").touch()  # the boot's last step
        # launch_done is set before the call (it ends the heartbeats): wait for the call itself
        # (in CI the assertion ran between the two under load)
        wait_for(lambda: a.lifecycle.launch_done.is_set() and not stub._queue, 20, "the launch completed")
        stub.assert_no_pending_responses()
        assert t.is_alive()  # parked: still waiting, joining nothing
        stub.add_response("complete_lifecycle_action", {}, _continue())
        imds.set("i-pool", STATE, "InService")  # a scale-out takes it from the pool
        t.join(5)
        assert not t.is_alive() and a.pub.states == ["WARMED", "STARTING"]
        stub.assert_no_pending_responses()


def test_straight_into_service_completes_the_launch_hook(imds, monkeypatch, tmp_path) -> None:
    url = imds.add("i-cold", "127.0.0.1")
    imds.set("i-cold", STATE, "InService")  # no pool instance free: launched into the group
    a = _hooked_agent(url, tmp_path, "i-cold")
    stub = _stubbed(a, monkeypatch)
    with stub:
        stub.add_response("complete_lifecycle_action", {}, _continue("i-cold"))
        a._wait_while_warmed()
        stub.assert_no_pending_responses()
    assert a.pub.states == [] and a.lifecycle.launch_done.is_set()


def test_agent_heartbeats_the_launch_hook_until_it_completes(imds, monkeypatch, tmp_path) -> None:
    url = imds.add("i-hb", "127.0.0.1")
    a = _hooked_agent(url, tmp_path, "i-hb")
    stub = _stubbed(a, monkeypatch)
    beat = {
        "LifecycleHookName": "petctl-launch",
        "AutoScalingGroupName": "petctl-warm-workers",
        "InstanceId": "i-hb",
    }
    with stub:
        for _ in range(2):
            stub.add_response("record_lifecycle_action_heartbeat", {}, beat)
        t = threading.Thread(target=a.lifecycle.launch_heartbeats, args=(0.2, 60))
        t.start()
        wait_for(lambda: not stub._queue, 20, "two heartbeats")
        a.lifecycle.launch_done.set()  # completed: no more heartbeats (a third would fail the Stubber)
        t.join(2)
        assert not t.is_alive()
        stub.assert_no_pending_responses()
    done = Lifecycle(a.lifecycle.spec, a.imds, a.settings, "i-hb")
    t0 = time.monotonic()
    done.launch_heartbeats(0.05, 0.3)  # bounded: a hung agent is abandoned by the hook, not held
    assert time.monotonic() - t0 < 5  # its 0.3 s bound, not the 60 s one (loose: a loaded box)


def test_sigterm_while_warmed_but_still_preparing_stays_parked(imds, monkeypatch) -> None:
    """AWS stops a pool instance; the agent had not reached its warm-pool wait yet (fetching code,
    waiting for EFS): the target state says it is parked, so no LEFT and no drain."""
    url = imds.add("i-early", "127.0.0.1")
    imds.set("i-early", STATE, "Warmed:Stopped")
    a = _agent(url)
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", lambda rc: exits.append(rc))
    left: list[str] = []  # the leave thread's work: drain if any, LEFT, exit
    monkeypatch.setattr(Agent, "_leave_outside_training", lambda self: left.append(self.instance_id))
    a.request_leave("signal SIGTERM")
    assert exits == [0] and a.pub.states == ["WARMED"] and a.pub.flushed == ["WARMED"]
    assert a.parked
    imds.set("i-early", STATE, "InService")
    b = _agent(url)
    b.request_leave("signal SIGTERM")  # in service: a real leave (the leave thread, then LEFT)
    wait_for(lambda: left, 20, "the leave thread")
    assert exits == [0] and b.pub.states == [] and not b.parked


def test_no_launch_hook_no_call_and_no_action_pending_is_fine(imds, monkeypatch) -> None:
    url = imds.add("i-hook", "127.0.0.1")
    imds.set("i-hook", STATE, "InService")
    spec = JobSpec.from_dict({**SPEC.to_dict(), "worker_group": "petctl-warm-workers"})
    client = Imds(url, timeout=1)
    plain = Lifecycle(spec, client, Settings(), "i-hook")
    stub = _stubbed(SimpleNamespace(lifecycle=plain), monkeypatch)
    with stub:
        plain.complete_launch()  # no hook: nothing to call (the Stubber would refuse a call)
    hooked = Lifecycle(spec, client, Settings(launch_hook="petctl-launch"), "i-hook")
    stub = _stubbed(SimpleNamespace(lifecycle=hooked), monkeypatch)
    with stub:
        stub.add_client_error(
            "complete_lifecycle_action",
            "ValidationError",
            "No active Lifecycle Action found with instance ID i-hook",
        )
        hooked.complete_launch()  # the boot completed it already: not an error
        stub.assert_no_pending_responses()
