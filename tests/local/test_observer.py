"""The reconciler reads moto again only when it may have changed (petctl.local.observe.Observer),
against a real moto server in this process, as the daemon runs it: a change made by any other
client is seen on the next tick, the observer's own reads change nothing, and without the count
(a moto server elsewhere) every tick reads."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from petctl.local import observe, plan

AMI = "ami-12c6146b"  # one of the images moto's EC2 starts with


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield "http://{}:{}".format(*server.get_host_and_port())
    server.stop()


def _clients(endpoint: str) -> dict[str, Any]:
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    return {name: session.client(name, endpoint_url=endpoint) for name in ("ec2", "autoscaling", "s3")}


def _counted(clients: dict[str, Any]) -> list[str]:
    """The URLs of the requests ``clients`` send."""
    sent: list[str] = []
    for c in clients.values():
        c.meta.events.register("before-send", lambda request, **_: sent.append(request.url))
    return sent


def _launch(ec2: Any) -> str:
    tags = [{"ResourceType": "instance", "Tags": [{"Key": plan.ROLE_TAG, "Value": "worker"}]}]
    return ec2.run_instances(ImageId=AMI, MinCount=1, MaxCount=1, TagSpecifications=tags)["Instances"][0][
        "InstanceId"
    ]


def test_a_tick_reads_again_only_after_a_change_and_sees_it(endpoint: str) -> None:
    clients = _clients(endpoint)
    sent = _counted(clients)
    obs = observe.Observer(clients)
    obs.count_changes()

    first = obs.observe({}, with_groups=True)
    reads = len(sent)
    assert reads >= 1
    assert obs.observe({}, with_groups=False) is first and len(sent) == reads  # nothing changed
    assert obs.observe({}, with_groups=True) is first and len(sent) == reads

    iid = _launch(_clients(endpoint)["ec2"])  # another client: the CLI, an agent, a shim
    seen = obs.observe({}, with_groups=False)
    assert len(sent) > reads and iid in seen.instances
    reads = len(sent)
    changes = observe.changes
    assert obs.observe({}, with_groups=False) is seen and len(sent) == reads
    assert observe.changes == changes  # the observer's reads are not changes

    # a record the reconciler has just made is a reason to read (its lifecycle state matters)
    known = {iid: SimpleNamespace(warm=None, status_url=None, instance_id=iid)}
    obs.observe(known, with_groups=False)  # type: ignore[arg-type]
    assert len(sent) > reads
    reads = len(sent)
    assert obs.observe(known, with_groups=False) is not None and len(sent) == reads  # type: ignore[arg-type]


def test_a_warm_pool_instance_waiting_for_its_report_is_read_every_tick(endpoint: str) -> None:
    clients = _clients(endpoint)
    sent = _counted(clients)
    obs = observe.Observer(clients)
    obs.count_changes()
    known = {"i-w": SimpleNamespace(warm=plan.WARMED + "Pending", status_url=None, instance_id="i-w")}
    obs.observe(known, with_groups=False)  # type: ignore[arg-type]
    reads = len(sent)
    obs.observe(known, with_groups=False)  # type: ignore[arg-type]
    assert len(sent) > reads  # its report is an S3 object the agent writes: read it each tick


def test_reads_at_least_every_read_at_least_s(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clients = _clients(endpoint)
    sent = _counted(clients)
    obs = observe.Observer(clients)
    obs.count_changes()
    obs.observe({}, with_groups=False)
    reads = len(sent)
    monkeypatch.setattr(observe, "READ_AT_LEAST_S", 0.0)
    obs.observe({}, with_groups=False)
    assert len(sent) > reads


def test_without_the_count_every_tick_reads(endpoint: str) -> None:
    """A reconciler whose moto runs elsewhere cannot count its changes: it reads each tick."""
    clients = _clients(endpoint)
    sent = _counted(clients)
    obs = observe.Observer(clients)
    obs.observe({}, with_groups=False)
    reads = len(sent)
    obs.observe({}, with_groups=False)
    assert len(sent) == 2 * reads


def test_groups_are_read_after_a_change_and_an_action_makes_the_next_tick_read(endpoint: str) -> None:
    """The groups' instances carry their health (Unhealthy: the reconciler replaces the instance);
    an action may change moto without a request (a warm pool instance parked in the backend)."""
    clients = _clients(endpoint)
    sent = _counted(clients)
    obs = observe.Observer(clients)
    obs.count_changes()
    obs.observe({}, with_groups=True)
    _launch(_clients(endpoint)["ec2"])
    reads = len(sent)
    obs.observe({}, with_groups=False)  # the change, without the groups
    assert len(sent) > reads
    reads = len(sent)
    obs.observe({}, with_groups=True)
    assert len(sent) > reads
    reads = len(sent)
    obs.observe({}, with_groups=True)
    assert len(sent) == reads  # the groups as of the last change
    obs.stale()
    obs.observe({}, with_groups=False)
    assert len(sent) > reads
