"""What the reconciler reads from moto each tick, over HTTP as any client would: the desired
state of :func:`petctl.local.plan.diff`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from petctl.local import plan
from petctl.local.instance import Instance


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
