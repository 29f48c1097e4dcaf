"""Lifecycle hooks declared on an Auto Scaling group, as AWS creates them (part of
:mod:`petctl.local.moto_patches`).

The job template declares its hooks (``petctl-drain``, and ``petctl-launch`` with a warm pool) in
the worker group's ``LifecycleHookSpecificationList``: AWS adds them before the group launches any
instance, so its first instances are held by them too (a separate ``AWS::AutoScaling::LifecycleHook``
resource is created after the group has launched them, and the launch hook missed them). moto 5.2
ignores that property, in CloudFormation and in ``CreateAutoScalingGroup`` alike (and its
CloudFormation skips ``AWS::AutoScaling::LifecycleHook``), so a job's group had no hooks at all.
Here:

* a group created from a template or by ``CreateAutoScalingGroup`` gets the hooks of its
  ``LifecycleHookSpecificationList`` (``DescribeLifecycleHooks`` lists them), and only those: a
  group made again under the same name (moto's stack update deletes and recreates it) does not
  keep the hooks of the one before;
* what AWS refuses of a hook (API_LifecycleHookSpecification, API_PutLifecycleHook) is refused,
  and the group is not created: a name that is not 1-255 of ``A-Za-z0-9-_/``, a transition other
  than ``autoscaling:EC2_INSTANCE_LAUNCHING``/``…_TERMINATING``, a ``DefaultResult`` other than
  ``CONTINUE``/``ABANDON``, a ``HeartbeatTimeout`` outside 30-7200 s, the same name twice, more
  than 50 hooks. AWS's defaults for what a hook leaves out: ``ABANDON``, 3600 s (moto's too).

Not emulated: holding an instance in ``Pending:Wait`` (moto launches at once; the local cloud's
reconciler emulates the termination hook's ``Terminating:Wait``, docs/local.md), and
``NotificationTargetARN``/``RoleARN``/``NotificationMetadata`` (moto answers fixed stand-ins).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap

TRANSITIONS = ("autoscaling:EC2_INSTANCE_LAUNCHING", "autoscaling:EC2_INSTANCE_TERMINATING")
RESULTS = ("CONTINUE", "ABANDON")
#: PutLifecycleHook: HeartbeatTimeout "from 30 to 7200 seconds"
TIMEOUT_RANGE = (30, 7200)
#: Amazon EC2 Auto Scaling quotas: lifecycle hooks per Auto Scaling group
MAX_HOOKS = 50
_NAME = re.compile(r"[A-Za-z0-9\-_/]{1,255}")


def checked(group: str, specs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The hook specifications of ``group`` as AWS takes them (the defaults filled in); raises
    moto's ``ValidationError`` for what AWS refuses (the module docstring)."""
    from moto.autoscaling.exceptions import ValidationError

    specs = list(specs or [])
    if len(specs) > MAX_HOOKS:
        raise ValidationError(f"{group}: {len(specs)} lifecycle hooks; a group has at most {MAX_HOOKS}")
    out: list[dict[str, Any]] = []
    for spec in specs:
        name = str(spec.get("LifecycleHookName") or "")
        if not _NAME.fullmatch(name):
            raise ValidationError(f"{group}: invalid LifecycleHookName {name!r} (1-255 of A-Za-z0-9-_/)")
        if name in (h["name"] for h in out):
            raise ValidationError(f"{group}: lifecycle hook {name} is declared twice")
        transition = spec.get("LifecycleTransition")
        if transition not in TRANSITIONS:
            raise ValidationError(
                f"{group}: lifecycle hook {name}: LifecycleTransition {transition!r} is not one of {', '.join(TRANSITIONS)}"
            )
        result = spec.get("DefaultResult") or "ABANDON"
        if result not in RESULTS:
            raise ValidationError(
                f"{group}: lifecycle hook {name}: DefaultResult {result!r} is not CONTINUE or ABANDON"
            )
        raw = spec.get("HeartbeatTimeout")
        try:
            timeout = 3600 if raw in (None, "") else int(raw)
        except (TypeError, ValueError):
            raise ValidationError(
                f"{group}: lifecycle hook {name}: HeartbeatTimeout {raw!r} is not a number"
            ) from None
        lo, hi = TIMEOUT_RANGE
        if not lo <= timeout <= hi:
            raise ValidationError(
                f"{group}: lifecycle hook {name}: HeartbeatTimeout {timeout} is outside {lo}-{hi} seconds"
            )
        out.append({"name": name, "transition": transition, "result": result, "timeout": timeout})
    return out


def put(backend: Any, group: str, hooks: list[dict[str, Any]]) -> None:
    """Give ``group`` exactly ``hooks`` (as :func:`checked` returns them)."""
    for key in [k for k, h in backend.lifecycle_hooks.items() if h.auto_scaling_group_name == group]:
        del backend.lifecycle_hooks[key]
    for h in hooks:
        backend.create_lifecycle_hook(
            name=h["name"],
            as_name=group,
            transition=h["transition"],
            timeout=h["timeout"],
            result=h["result"],
        )


def _patch_cloudformation() -> None:
    from moto.autoscaling.models import FakeAutoScalingGroup, autoscaling_backends

    # A plain function on the class, as moto calls it: cls.create_from_cloudformation_json(...)
    # (its stack update too); ``original`` is the classmethod, bound to the class.
    @wrap(FakeAutoScalingGroup, "create_from_cloudformation_json")
    def create(
        original: Callable[..., Any],
        resource_name: str,
        cloudformation_json: dict[str, Any],
        account_id: str,
        region_name: str,
        **kwargs: Any,
    ) -> Any:
        props = cloudformation_json.get("Properties", {})
        hooks = checked(resource_name, props.get("LifecycleHookSpecificationList"))
        group = original(resource_name, cloudformation_json, account_id, region_name, **kwargs)
        put(autoscaling_backends[account_id][region_name], group.name, hooks)
        return group


def _patch_api() -> None:
    from moto.autoscaling.responses import AutoScalingResponse

    @wrap(AutoScalingResponse, "create_auto_scaling_group")
    def create_auto_scaling_group(original: Callable[[Any], Any], self: Any) -> Any:
        name = self._get_param("AutoScalingGroupName")
        hooks = checked(name, self._get_params().get("LifecycleHookSpecificationList"))
        answer = original(self)
        put(self.autoscaling_backend, name, hooks)
        return answer


def apply() -> None:
    """Install the lifecycle hook patches (idempotent)."""
    _patch_cloudformation()
    _patch_api()
