"""``aws``: the AWS CLI calls the boot scripts make, against the local cloud's moto server, with
the CLI's global options, output and error text. The calls themselves are in :mod:`.s3` and
:mod:`.aws_calls`."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from . import aws_calls, s3
from .base import Failed, Refused

#: (service, command) -> the call: ``(args after the command, quiet) -> result to print or None``.
CALLS = {
    ("s3", "cp"): s3.cp,
    ("s3", "ls"): s3.ls,
    ("autoscaling", "set-instance-health"): aws_calls.set_instance_health,
    ("autoscaling", "update-auto-scaling-group"): aws_calls.update_auto_scaling_group,
    ("autoscaling", "delete-warm-pool"): aws_calls.delete_warm_pool,
    ("autoscaling", "complete-lifecycle-action"): aws_calls.complete_lifecycle_action,
    ("autoscaling", "record-lifecycle-action-heartbeat"): aws_calls.record_lifecycle_action_heartbeat,
    ("ec2", "describe-network-interfaces"): aws_calls.describe_network_interfaces,
    ("ec2", "attach-network-interface"): aws_calls.attach_network_interface,
}


def _text(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return "\t".join(_text(v) for v in value)
    raise Refused("--output text of a structure is not emulated: --query it down to scalars")


def _print(result: dict[str, Any], query: str | None, output: str) -> None:
    result = {k: v for k, v in result.items() if k != "ResponseMetadata"}
    if query:
        import jmespath

        result = jmespath.search(query, result)
    if output == "text":
        print(_text(result))
    elif result not in (None, {}):
        print(json.dumps(result, indent=4, default=str))


def aws(args: list[str]) -> None:
    """The AWS CLI calls the boot scripts make, against the local cloud's moto server."""
    globs: dict[str, str] = {"--output": "json"}
    rest = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--region", "--output", "--query"):
            if i + 1 >= len(args):
                raise Refused(f"{a} needs a value")
            globs[a] = args[i + 1]
            i += 2
        elif a in ("--only-show-errors", "--no-cli-pager"):
            globs[a] = "1"
            i += 1
        else:
            rest.append(a)
            i += 1
    region = os.environ.get("AWS_REGION", "us-east-1")
    if globs.get("--region", region) != region:
        raise Refused(f"--region {globs['--region']}: the local cloud has one region, {region}")
    if globs["--output"] not in ("json", "text"):
        raise Refused(f"--output {globs['--output']} not emulated (json, text)")
    if len(rest) < 2:
        raise Refused(f"aws {shlex.join(args)}: give a service and a command")
    service, command, rest = rest[0], rest[1], rest[2:]
    quiet = "--only-show-errors" in globs
    handler = CALLS.get((service, command))
    if handler is None:
        raise Refused(
            f"'aws {service} {command}' is not emulated (known: "
            + ", ".join(f"{s} {c}" for s, c in sorted(CALLS))
            + ")"
        )
    import botocore.exceptions

    try:
        result = handler(rest, quiet)
    except botocore.exceptions.ClientError as e:
        op = e.operation_name
        err = e.response.get("Error", {})
        raise Failed(
            f"An error occurred ({err.get('Code')}) when calling the {op} operation: {err.get('Message')}",
            254,
        ) from e
    if result is not None:
        _print(result, globs.get("--query"), globs["--output"])
