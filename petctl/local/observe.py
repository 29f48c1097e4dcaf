"""What the reconciler reads from moto each tick, over HTTP as any client would: the desired
state of :func:`petctl.local.plan.diff`.

:class:`Observer` reads again only when moto may have changed. The daemon counts the requests
its moto server answers that can change state (any but GET and HEAD, other than the reads of
:func:`observe` itself, which carry :data:`OBSERVE_HEADER`). A tick that sees no new change, no
new local instance, no action of the reconciler since and no warm pool instance waiting for its
agent's report reuses the last answer (on the ticks that read the groups: when no change came
since they were last read); it reads anyway after :data:`READ_AT_LEAST_S`.
An idle daemon (no instances) costs 4 % of a core at a period of 0.25 s or 0.5 s, where reading
every tick cost 16 % and 9 % (2-core machine, ``bench/bench_idle_daemon.py``).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from petctl.local import plan
from petctl.local.instance import Instance
from petctl.local.patching import wrap

#: Marks the reconciler's own reads, which change nothing.
OBSERVE_HEADER = "X-Petctl-Observe"
_OBSERVE_ENVIRON = "HTTP_" + OBSERVE_HEADER.upper().replace("-", "_")
#: Seconds after which a tick reads moto even when no change was counted.
READ_AT_LEAST_S = 10.0

_count = itertools.count(1)
#: Requests the moto servers of this process answered that may have changed their state (counted
#: once :meth:`Observer.count_changes` has hooked them).
changes = 0


def _count_changes() -> None:
    """Hook moto's WSGI application (every moto server of this process) to count :data:`changes`:
    each request but GET, HEAD and the observer's own reads, once answered, so that a read which
    starts after it sees the change. Idempotent."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    @wrap(DomainDispatcherApplication, "__call__")
    def __call__(original: Any, app: Any, environ: dict[str, Any], start_response: Any) -> Any:
        global changes
        try:
            return original(app, environ, start_response)
        finally:
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD") and not environ.get(_OBSERVE_ENVIRON):
                changes = next(_count)


class Observer:
    """:func:`observe`, skipped while nothing it reads can have changed (the module docstring).
    It always reads until :meth:`count_changes` says that the moto server is in this process."""

    def __init__(self, clients: Mapping[str, Any]) -> None:
        self.clients = clients
        self.counting = False
        self._reading = threading.local()
        self._last: plan.Observed | None = None
        self._ids: frozenset[str] = frozenset()
        self._t = 0.0
        self._read_at = self._groups_read_at = -1  # the count of changes at the last read (of groups)
        for client in clients.values():
            client.meta.events.register("before-send", self._mark)

    def _mark(self, request: Any, **_: Any) -> None:
        if getattr(self._reading, "on", False):
            request.headers[OBSERVE_HEADER] = "1"

    def count_changes(self) -> None:
        """The clients' moto server runs in this process: count its changes, and skip reads."""
        _count_changes()
        self.counting = True

    def stale(self) -> None:
        """The next tick reads: the reconciler acted, and an action may change moto without a
        request (a warm pool instance parked by :func:`petctl.local.moto_warm_pool.mark_warmed`)."""
        self._last = None

    def observe(self, known: Mapping[str, Instance], with_groups: bool) -> plan.Observed:
        ids = frozenset(known)
        if (
            self.counting
            and self._last is not None
            and ids == self._ids
            and changes == self._read_at
            # the groups (their instances' health: ReplaceUnhealthy) as of the last change
            and (not with_groups or changes == self._groups_read_at)
            and time.monotonic() - self._t < READ_AT_LEAST_S
            and not any(rec.warm == plan.WARMED + "Pending" for rec in known.values())
        ):
            return self._last
        seen, t = changes, time.monotonic()  # before the reads: a change during them is read next tick
        self._reading.on = True
        try:
            observed = observe(self.clients, known, with_groups)
        finally:
            self._reading.on = False
        self._last, self._ids, self._t, self._read_at = observed, ids, t, seen
        if with_groups:
            self._groups_read_at = seen
        return observed


def observe(clients: Mapping[str, Any], known: Mapping[str, Instance], with_groups: bool) -> plan.Observed:
    """Tagged instances (live, and stopped ones a warm pool parks), their lifecycle state where
    it matters (new instances of a group, warm pool instances), the groups when ``with_groups``
    (a backstop: moto already terminates a deleted group's instances), and which warm pool
    instances' agents report WARMED."""
    ec2, asg = clients["ec2"], clients["autoscaling"]
    described: dict[str, dict[str, Any]] = {}
    for page in ec2.get_paginator("describe_instances").paginate(
        # Only live (or parked) instances: one that left simply vanishes from the answer, and
        # the answer does not grow with every instance ever terminated.
        Filters=[
            {"Name": "tag-key", "Values": [plan.ROLE_TAG]},
            {"Name": "instance-state-name", "Values": [*plan.LIVE_STATES, *plan.PARKED_STATES]},
        ]
    ):
        for res in page["Reservations"]:
            for i in res["Instances"]:
                described[i["InstanceId"]] = i
    tags = {iid: {t["Key"]: t["Value"] for t in i.get("Tags", [])} for iid, i in described.items()}
    ask = [iid for iid in described if plan.ASG_TAG in tags[iid] and (iid not in known or known[iid].warm)]
    lifecycle: dict[str, str] = {}
    if ask:
        for gi in asg.describe_auto_scaling_instances(InstanceIds=ask)["AutoScalingInstances"]:
            lifecycle[gi["InstanceId"]] = gi["LifecycleState"]
    seen = {
        iid: plan.Seen(iid, i["State"]["Name"], tags[iid], i, lifecycle.get(iid))
        for iid, i in described.items()
    }
    groups = None
    if with_groups and any(x.group for x in seen.values()):
        groups = {}
        for page in asg.get_paginator("describe_auto_scaling_groups").paginate():
            groups.update({g["AutoScalingGroupName"]: g for g in page["AutoScalingGroups"]})
    warmed = frozenset(
        iid
        for iid, rec in known.items()
        if rec.warm == plan.WARMED + "Pending" and reports_warmed(clients["s3"], rec)
    )
    return plan.Observed(seen, groups, warmed)


def reports_warmed(s3: Any, rec: Instance) -> bool:
    """Whether the instance's agent published status WARMED (its boot is done, it waits)."""
    url = rec.status_url or ""
    if not url.startswith("s3://"):
        return False
    bucket, _, prefix = url[5:].partition("/")
    try:
        body = s3.get_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{rec.instance_id}.json")["Body"].read()
        return json.loads(body).get("state") == "WARMED"
    except Exception:  # noqa: BLE001 - no status yet, or not readable yet
        return False
