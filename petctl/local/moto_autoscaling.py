"""Auto Scaling calls moto lacks or answers loosely, answered as AWS does.

Part of :mod:`petctl.local.moto_patches` (its items 2 and 13):

* **Lifecycle actions**: moto does not implement ``CompleteLifecycleAction`` or
  ``RecordLifecycleActionHeartbeat``. The reconciler emulates the termination hook and sets
  :data:`lifecycle_handler`, so these calls are answered from it: success for an instance that is
  draining (which ends its wait), ``ValidationError`` otherwise, as AWS does.
* **DescribeAutoScalingGroups IncludeInstances=false**: AWS leaves each group's instances out (its
  advice for large groups, whose full answer may be throttled); moto listed them anyway.

Hooks declared on a group are :mod:`petctl.local.moto_hooks`; warm pools :mod:`petctl.local.moto_warm_pool`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap

#: Set by the reconciler: (instance_id, action) -> error message or None. ``action`` is
#: ``"complete"`` or ``"heartbeat"``.
lifecycle_handler: Callable[[str, str, dict[str, Any]], str | None] | None = None


def _patch_lifecycle_actions() -> None:
    from moto.autoscaling.exceptions import ValidationError
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import EmptyResult

    def _lifecycle(self: Any, action: str) -> Any:
        params = {
            k: self._get_param(k)
            for k in ("AutoScalingGroupName", "LifecycleHookName", "InstanceId", "LifecycleActionToken")
        }
        params["LifecycleActionResult"] = self._get_param("LifecycleActionResult")
        instance_id = params.get("InstanceId") or ""
        handler = lifecycle_handler
        error = handler(instance_id, action, params) if handler else "lifecycle hooks are not emulated"
        if error:
            raise ValidationError(error)
        return EmptyResult()

    AutoScalingResponse.complete_lifecycle_action = lambda self: _lifecycle(self, "complete")  # type: ignore[attr-defined]
    AutoScalingResponse.record_lifecycle_action_heartbeat = lambda self: _lifecycle(self, "heartbeat")  # type: ignore[attr-defined]


class _GroupWithoutInstances:
    """An Auto Scaling group as DescribeAutoScalingGroups answers with ``IncludeInstances=false``."""

    instances: list[Any] = []

    def __init__(self, group: Any) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def _patch_include_instances() -> None:
    """DescribeAutoScalingGroups ``IncludeInstances=false`` leaves the groups' instances out
    (AWS's advice against throttling for large groups); moto ignores it and lists them."""
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import ActionResult

    @wrap(AutoScalingResponse, "describe_auto_scaling_groups")
    def describe_auto_scaling_groups(original: Callable[[Any], Any], self: Any) -> Any:
        out = original(self)
        if str(self._get_param("IncludeInstances", True)).lower() != "false":
            return out
        result = dict(out.result)
        result["AutoScalingGroups"] = [_GroupWithoutInstances(g) for g in result["AutoScalingGroups"]]
        return ActionResult(result)


def apply() -> None:
    """Install the Auto Scaling patches (idempotent)."""
    _patch_lifecycle_actions()
    _patch_include_instances()
