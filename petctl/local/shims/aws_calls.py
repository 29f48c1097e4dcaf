"""The autoscaling and ec2 calls of the ``aws`` shim: each one's options, checked, made into the
API call against moto."""

from __future__ import annotations

from typing import Any

from .base import Refused, client

#: Each option of a call -> its API parameter.
_UPDATE_ASG = {
    "--auto-scaling-group-name": "AutoScalingGroupName",
    "--min-size": "MinSize",
    "--max-size": "MaxSize",
    "--desired-capacity": "DesiredCapacity",
}
_COMPLETE_LIFECYCLE_ACTION = {
    "--auto-scaling-group-name": "AutoScalingGroupName",
    "--lifecycle-hook-name": "LifecycleHookName",
    "--instance-id": "InstanceId",
    "--lifecycle-action-token": "LifecycleActionToken",
    "--lifecycle-action-result": "LifecycleActionResult",
}


def options(args: list[str], spec: dict[str, str]) -> dict[str, Any]:
    """Parse ``--name VALUE`` / ``--flag`` options; ``spec`` maps each allowed name to
    ``value`` | ``values`` | ``flag``. Anything else is refused."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        kind = spec.get(a)
        if kind is None:
            raise Refused(f"argument {a!r} not emulated here (allowed: {' '.join(sorted(spec))})")
        if kind == "flag":
            out[a] = True
            i += 1
        elif kind == "value":
            if i + 1 >= len(args):
                raise Refused(f"{a} needs a value")
            out[a] = args[i + 1]
            i += 2
        else:  # values: until the next option
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            out[a] = args[i + 1 : j]
            i = j
    return out


def set_instance_health(rest: list[str], quiet: bool) -> None:
    o = options(
        rest,
        {
            "--instance-id": "value",
            "--health-status": "value",
            "--should-respect-grace-period": "flag",
            "--no-should-respect-grace-period": "flag",
        },
    )
    if "--instance-id" not in o or o.get("--health-status") not in ("Healthy", "Unhealthy"):
        raise Refused("set-instance-health needs --instance-id and --health-status Healthy|Unhealthy")
    kwargs: dict[str, Any] = {"InstanceId": o["--instance-id"], "HealthStatus": o["--health-status"]}
    if "--should-respect-grace-period" in o or "--no-should-respect-grace-period" in o:
        kwargs["ShouldRespectGracePeriod"] = "--should-respect-grace-period" in o
    client("autoscaling").set_instance_health(**kwargs)


def update_auto_scaling_group(rest: list[str], quiet: bool) -> None:
    o = options(rest, dict.fromkeys(_UPDATE_ASG, "value"))
    if "--auto-scaling-group-name" not in o:
        raise Refused("update-auto-scaling-group needs --auto-scaling-group-name")
    client("autoscaling").update_auto_scaling_group(
        **{_UPDATE_ASG[k]: v if k == "--auto-scaling-group-name" else int(v) for k, v in o.items()}
    )


def delete_warm_pool(rest: list[str], quiet: bool) -> None:
    o = options(rest, {"--auto-scaling-group-name": "value", "--force-delete": "flag"})
    if "--auto-scaling-group-name" not in o:
        raise Refused("delete-warm-pool needs --auto-scaling-group-name")
    client("autoscaling").delete_warm_pool(
        AutoScalingGroupName=o["--auto-scaling-group-name"], ForceDelete="--force-delete" in o
    )


def complete_lifecycle_action(rest: list[str], quiet: bool) -> None:
    o = options(rest, dict.fromkeys(_COMPLETE_LIFECYCLE_ACTION, "value"))
    needed = ("--auto-scaling-group-name", "--lifecycle-hook-name", "--lifecycle-action-result")
    if any(k not in o for k in needed) or not ("--instance-id" in o or "--lifecycle-action-token" in o):
        raise Refused(
            "complete-lifecycle-action needs --auto-scaling-group-name, --lifecycle-hook-name, "
            "--lifecycle-action-result and --instance-id or --lifecycle-action-token"
        )
    if o["--lifecycle-action-result"] not in ("CONTINUE", "ABANDON"):
        raise Refused(f"--lifecycle-action-result {o['--lifecycle-action-result']}: CONTINUE or ABANDON")
    client("autoscaling").complete_lifecycle_action(
        **{_COMPLETE_LIFECYCLE_ACTION[k]: v for k, v in o.items()}
    )


def record_lifecycle_action_heartbeat(rest: list[str], quiet: bool) -> None:
    spec = {k: v for k, v in _COMPLETE_LIFECYCLE_ACTION.items() if k != "--lifecycle-action-result"}
    o = options(rest, dict.fromkeys(spec, "value"))
    needed = ("--auto-scaling-group-name", "--lifecycle-hook-name")
    if any(k not in o for k in needed) or not ("--instance-id" in o or "--lifecycle-action-token" in o):
        raise Refused(
            "record-lifecycle-action-heartbeat needs --auto-scaling-group-name, --lifecycle-hook-name "
            "and --instance-id or --lifecycle-action-token"
        )
    client("autoscaling").record_lifecycle_action_heartbeat(**{spec[k]: v for k, v in o.items()})


def describe_network_interfaces(rest: list[str], quiet: bool) -> dict[str, Any]:
    o = options(rest, {"--network-interface-ids": "values"})
    if not o.get("--network-interface-ids"):
        raise Refused("describe-network-interfaces needs --network-interface-ids")
    return client("ec2").describe_network_interfaces(NetworkInterfaceIds=o["--network-interface-ids"])


def attach_network_interface(rest: list[str], quiet: bool) -> dict[str, Any]:
    o = options(
        rest, {"--network-interface-id": "value", "--instance-id": "value", "--device-index": "value"}
    )
    if len(o) != 3:
        raise Refused(
            "attach-network-interface needs --network-interface-id, --instance-id and --device-index"
        )
    return client("ec2").attach_network_interface(
        NetworkInterfaceId=o["--network-interface-id"],
        InstanceId=o["--instance-id"],
        DeviceIndex=int(o["--device-index"]),
    )
