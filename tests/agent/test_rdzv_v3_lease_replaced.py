"""A new etcd behind the address, first seen by the lease's keepalive thread.

The client raises ``ClusterChanged`` once per change, to whichever call meets the new etcd first,
and then follows it. At steady state the membership lease's keepalive (every second) is nearly
always that call: the watches carry nothing, and a watch on a connection that died silently
(the rendezvous instance replaced on AWS: the address moves, the old flows are gone) is noticed
only after its silence (30 s). The keepalive thread caught every ``EtcdError`` and retried, so it
swallowed the one ``ClusterChanged``: the handler never heard "etcd replaced" from it, kept its
watchers and views of the old etcd, and learned it from the boot token only once a watcher gave
up on its silent connection. The lease now hands the error to the handler (``on_error``: the
same ``_client_error`` every other thread uses) and counts itself lost (the new etcd never
held it).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Etcd, FreezingProxy, wait_for
from test_rendezvous import Group

from petctl_agent.rendezvous import etcdv3 as v3

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


@pytest.fixture
def other_etcd(tmp_path: Path):
    """A second etcd: another cluster (its own peer URL), empty."""
    e = Etcd(tmp_path / "other")
    e.start()
    yield e
    e.stop()


def test_the_lease_thread_reports_a_new_etcd(etcd3: Etcd, other_etcd: Etcd) -> None:
    """The unit: a kept-alive lease through the proxy; the proxy freezes every flow and sends new
    ones to another etcd. The keepalive, retried on a new connection, meets the new cluster:
    ``on_error`` gets the ``ClusterChanged`` and the lease is lost at once."""
    with FreezingProxy(etcd3.endpoint) as proxy:
        c = v3.Client(proxy.endpoint, timeout=2.0)
        errors: list[v3.EtcdError] = []
        lost = threading.Event()
        lid, ttl = c.grant(6)
        lease = v3.Lease(c, lid, ttl, lambda _: lost.set(), interval=0.5, on_error=errors.append).start()
        try:
            wait_for(lambda: lease.keepalives >= 1, 5, "a first keepalive")
            proxy.upstream = ("127.0.0.1", other_etcd.port)
            proxy.freeze()
            assert lost.wait(6), "the lease was not reported lost"
            assert len(errors) == 1 and isinstance(errors[0], v3.ClusterChanged), errors
            assert lease.lost.is_set()
            c.close()  # this thread's connection (the grant's) is frozen
            assert c.status().cluster_id == c.cluster_id  # raised once, to the lease: then followed
        finally:
            lease.stop()


def test_a_handler_hears_of_a_new_etcd_from_its_lease(
    group: Callable[..., Group], etcd3: Etcd, other_etcd: Etcd
) -> None:
    """Two nodes run through the proxy. The proxy silently drops every open flow and sends new
    ones to another etcd (a replaced rendezvous instance). Each handler drops its views of the
    old etcd ("etcd state lost: etcd replaced") within a few seconds, from its lease's
    keepalive, not 30 s later when its watches' silence ends; then both run again on the new
    etcd, registered there. Without the fix no handler said so before its watches gave up."""
    with FreezingProxy(etcd3.endpoint) as proxy:
        g = group(2, 2, endpoint=proxy.endpoint)
        try:
            a, b = g.new(), g.new()
            g.rendezvous(a, b, timeout=20)
            time.sleep(1.0)  # steady state: the watches carry nothing
            proxy.upstream = ("127.0.0.1", other_etcd.port)
            proxy.freeze()
            t0 = time.monotonic()

            def replaced() -> bool:
                return all(any("etcd state lost: etcd replaced" in e for _, e in h.events) for h in (a, b))

            wait_for(replaced, 10, "both handlers to drop their views of the old etcd")
            took = time.monotonic() - t0
            assert took < 10, took
            direct = v3.Client(other_etcd.endpoint)
            wait_for(lambda: all(direct.get(h.node_key) is not None for h in (a, b)), 10,
                     "both nodes registered on the new etcd")  # fmt: skip
        finally:
            g.close()
