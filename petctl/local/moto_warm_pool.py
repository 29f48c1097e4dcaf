"""Auto Scaling warm pools in moto, as AWS runs them (part of :mod:`petctl.local.moto_patches`).

moto 5.2 stores a warm pool's settings (``PutWarmPool``, ``DescribeWarmPool``) but launches no
instance for it, and its CloudFormation skips ``AWS::AutoScaling::WarmPool``. Here:

* CloudFormation creates, updates and deletes ``AWS::AutoScaling::WarmPool`` through the group's
  warm pool model.
* The pool holds instances of its own, launched from the group's launch template with the group's
  tags, outside the group: not in ``DescribeAutoScalingGroups``' instances nor in its desired
  capacity; ``DescribeWarmPool`` and ``DescribeAutoScalingInstances`` list them with their
  lifecycle state: ``Warmed:Pending`` while they boot, then ``Warmed:Stopped`` (EC2 ``stopped``),
  once the local cloud reports them booted through :func:`mark_warmed` (AWS's own transition; no
  API does it).
* Its size is AWS's: ``max(MinSize, MaxGroupPreparedCapacity - DesiredCapacity)``, where an unset
  ``MaxGroupPreparedCapacity`` (or -1) means the group's ``MaxSize``. It refills whenever the
  group's capacity changes, and shrinks (terminating the surplus) the same way.
* A scale-out takes pool instances first (``Warmed:Stopped`` ones before those still booting): each
  is started in EC2 and joins the group ``InService``; only the rest is launched cold.
* Like AWS, a warm pool is refused on a group with a mixed instances policy or a launch template
  that requests Spot Instances (moto accepts both).
* A scale-in terminates group instances: nothing returns to the pool (``InstanceReusePolicy``
  ``ReuseOnScaleIn: true`` is refused, not emulated);
  deleting the group or the pool terminates the pool's instances.
* Not emulated: the hold of the launch lifecycle hook. The hook itself exists
  (:mod:`petctl.local.moto_hooks`), but AWS holds a pool instance in ``Warmed:Pending:Wait`` and
  one leaving the pool in ``Pending:Wait`` until ``petctl-launch`` is completed; here both go
  straight on, so the boot's and the agent's completion calls get "No active Lifecycle Action"
  (tests use a Stubber for them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from petctl.local.environment import ACCOUNT_ID
from petctl.local.patching import wrap

PENDING, WARMED_PREFIX = "Warmed:Pending", "Warmed:"
# moto's server runs each request in its own thread; pool moves and the reconciler's
# mark_warmed must not interleave.
_lock = threading.RLock()


def pool_size(group: Any) -> int:
    """How many instances the group's warm pool keeps (AWS's rule, above)."""
    pool = group.warm_pool
    prepared = pool.max_group_prepared_capacity
    prepared = group.max_size if prepared in (None, -1, "-1") else int(prepared)
    return max(int(pool.min_size or 0), int(prepared or 0) - int(group.desired_capacity or 0), 0)


def _instances(group: Any) -> list[Any]:
    pool = getattr(group, "warm_pool", None)
    if pool is None:
        return []
    if not hasattr(pool, "instances"):
        pool.instances = []
    return pool.instances


def _refill(group: Any) -> None:
    """Launch or terminate pool instances until the pool has its size."""
    states = _instances(group)
    states[:] = [s for s in states if s.instance.state not in ("terminated", "shutting-down")]
    want = pool_size(group)
    if len(states) < want:
        before = list(group.instance_states)
        group.replace_autoscaling_group_instances(want - len(states), group.get_propagated_tags())
        launched = [s for s in group.instance_states if s not in before]
        group.instance_states = before
        for s in launched:
            s.lifecycle_state = PENDING
        states.extend(launched)
    elif len(states) > want:
        # Still booting first: a pool sheds what it has invested least in.
        surplus = sorted(states, key=lambda s: s.lifecycle_state != PENDING)[: len(states) - want]
        group.ec2_backend.terminate_instances([s.instance.id for s in surplus])
        states[:] = [s for s in states if s not in surplus]


def _terminate_pool(group: Any) -> None:
    states = _instances(group)
    if states:
        group.ec2_backend.terminate_instances([s.instance.id for s in states])
        states.clear()


def mark_warmed(instance_id: str, region: str, account_id: str = ACCOUNT_ID) -> str | None:
    """The instance finished its boot in the pool: it moves to ``Warmed:<PoolState>`` (EC2
    ``stopped`` for Stopped/Hibernated). Returns its lifecycle state, or None when it is no
    longer in a pool (a scale-out took it meanwhile)."""
    from moto.autoscaling.models import autoscaling_backends

    with _lock:
        for group in autoscaling_backends[account_id][region].autoscaling_groups.values():
            for s in _instances(group):
                if s.instance.id != instance_id:
                    continue
                if s.lifecycle_state == PENDING:
                    state = group.warm_pool.pool_state or "Stopped"
                    s.lifecycle_state = WARMED_PREFIX + state
                    if state in ("Stopped", "Hibernated"):
                        s.instance.stop()
                return s.lifecycle_state
    return None


def _requests_spot(group: Any) -> bool:
    template = getattr(group, "ec2_launch_template", None)
    if template is None:
        return False
    try:
        data = template.get_version(group.launch_template_version).data
    except Exception:  # noqa: BLE001 - an unknown version: moto refuses it elsewhere
        return False
    return (data.get("InstanceMarketOptions") or {}).get("MarketType") == "spot"


def _patch_group() -> None:
    from moto.autoscaling.models import FakeAutoScalingGroup

    @wrap(FakeAutoScalingGroup, "set_desired_capacity")
    def set_desired_capacity(original: Callable[..., None], self: Any, new_capacity: int | None) -> None:
        if getattr(self, "warm_pool", None) is None:
            return original(self, new_capacity)
        with _lock:
            wanted = self.min_size if new_capacity is None else new_capacity
            missing = (wanted or 0) - len(self.active_instances())
            pool = _instances(self)
            # Ready instances first, then those still booting (AWS lets them finish, then starts them).
            for s in sorted(pool, key=lambda s: s.lifecycle_state == PENDING)[: max(missing, 0)]:
                pool.remove(s)
                if s.instance.state != "running":
                    s.instance.start()
                s.lifecycle_state = "InService"
                self.instance_states.append(s)
            original(self, new_capacity)
            _refill(self)

    @wrap(FakeAutoScalingGroup, "put_warm_pool")
    def put_warm_pool(original: Callable[..., None], self: Any, **kwargs: Any) -> None:
        from moto.autoscaling.exceptions import ValidationError

        # AWS (PutWarmPool): "cannot be called on an Auto Scaling group that has a mixed instances
        # policy or a launch template or launch configuration that requests Spot Instances".
        # moto accepts both; a template that made either would pass here and fail on AWS.
        if self.mixed_instances_policy:
            raise ValidationError(
                f"You can't add a warm pool to {self.name}: it has a mixed instances policy"
            )
        if _requests_spot(self):
            raise ValidationError(
                f"You can't add a warm pool to {self.name}: its launch template requests Spot Instances"
            )
        reuse = (kwargs.get("instance_reuse_policy") or {}).get("ReuseOnScaleIn")
        if str(reuse).lower() == "true":
            # Refused rather than silently terminating what AWS would return to the pool.
            raise ValidationError(
                "InstanceReusePolicy ReuseOnScaleIn=true is not emulated by the local cloud"
            )
        with _lock:
            kept = _instances(self)
            original(self, **kwargs)
            self.warm_pool.instances = kept
            _refill(self)


def _patch_backend() -> None:
    from moto.autoscaling.models import AutoScalingBackend

    @wrap(AutoScalingBackend, "delete_warm_pool")
    def delete_warm_pool(original: Callable[..., None], self: Any, group_name: str) -> None:
        with _lock:
            _terminate_pool(self.describe_auto_scaling_groups([group_name])[0])
            original(self, group_name)

    @wrap(AutoScalingBackend, "delete_auto_scaling_group")
    def delete_auto_scaling_group(original: Callable[..., None], self: Any, group_name: str) -> None:
        with _lock:
            group = self.autoscaling_groups.get(group_name)
            if group is not None and group.warm_pool is not None:
                _terminate_pool(group)
                group.warm_pool = None  # its scale to zero must not refill the pool
            original(self, group_name)

    @wrap(AutoScalingBackend, "describe_auto_scaling_instances")
    def describe_auto_scaling_instances(
        original: Callable[..., list[Any]], self: Any, instance_ids: list[str]
    ) -> list[Any]:
        found = original(self, instance_ids)
        for group in self.autoscaling_groups.values():
            found += [s for s in _instances(group) if not instance_ids or s.instance.id in instance_ids]
        return found

    @wrap(AutoScalingBackend, "terminate_instance")
    def terminate_instance(
        original: Callable[..., Any], self: Any, instance_id: str, should_decrement: bool
    ) -> Any:
        with _lock:
            for group in self.autoscaling_groups.values():
                pooled = [s for s in _instances(group) if s.instance.id == instance_id]
                if pooled:
                    from moto.autoscaling.models import TerminateInstanceActivity

                    _instances(group).remove(pooled[0])
                    self.ec2_backend.terminate_instances([instance_id])
                    _refill(group)
                    return TerminateInstanceActivity(pooled[0].instance, group.desired_capacity)
            return original(self, instance_id, should_decrement)


def _patch_responses() -> None:
    from moto.autoscaling.responses import AutoScalingResponse
    from moto.core.responses import ActionResult

    @wrap(AutoScalingResponse, "describe_warm_pool")
    def describe_warm_pool(original: Callable[[Any], Any], self: Any) -> Any:
        group_name = self._get_param("AutoScalingGroupName")
        pool = self.autoscaling_backend.describe_warm_pool(group_name=group_name)
        group = self.autoscaling_backend.describe_auto_scaling_groups([group_name])[0]
        return ActionResult({"WarmPoolConfiguration": pool, "Instances": list(_instances(group))})


def _patch_cloudformation() -> None:
    from moto.autoscaling.models import FakeWarmPool, autoscaling_backends
    from moto.cloudformation import parsing

    def create(
        cls: Any,
        resource_name: str,
        cloudformation_json: dict[str, Any],
        account_id: str,
        region_name: str,
        **kwargs: Any,
    ) -> Any:
        props = cloudformation_json.get("Properties", {})
        backend = autoscaling_backends[account_id][region_name]
        name = props["AutoScalingGroupName"]
        backend.put_warm_pool(
            group_name=name,
            max_group_prepared_capacity=props.get("MaxGroupPreparedCapacity"),
            min_size=int(props["MinSize"]) if props.get("MinSize") is not None else None,
            pool_state=props.get("PoolState"),
            instance_reuse_policy=props.get("InstanceReusePolicy"),
        )
        pool = backend.describe_warm_pool(name)
        pool.group_name = name
        return pool

    def update(
        cls: Any,
        original_resource: Any,
        new_resource_name: str,
        cloudformation_json: dict[str, Any],
        account_id: str,
        region_name: str,
    ) -> Any:
        return create(cls, new_resource_name, cloudformation_json, account_id, region_name)

    def delete(self: Any, account_id: str, region_name: str) -> None:
        backend = autoscaling_backends[account_id][region_name]
        if (
            self.group_name in backend.autoscaling_groups
            and backend.autoscaling_groups[self.group_name].warm_pool
        ):
            backend.delete_warm_pool(self.group_name)

    FakeWarmPool.cloudformation_type = staticmethod(lambda: "AWS::AutoScaling::WarmPool")  # type: ignore[method-assign]
    FakeWarmPool.cloudformation_name_type = staticmethod(lambda: "")  # type: ignore[method-assign]
    FakeWarmPool.create_from_cloudformation_json = classmethod(create)  # type: ignore[method-assign,assignment]
    FakeWarmPool.update_from_cloudformation_json = classmethod(update)  # type: ignore[method-assign,assignment]
    FakeWarmPool.delete = delete  # type: ignore[attr-defined]
    FakeWarmPool.physical_resource_id = property(lambda self: self.group_name)  # type: ignore[attr-defined]
    for cached in (parsing.get_model_list, parsing.get_model_map, parsing.get_name_type_map):
        cached.cache_clear()  # the type map was built before the warm pool had a type


def apply() -> None:
    """Install the warm pool patches (idempotent)."""
    _patch_group()
    _patch_backend()
    _patch_responses()
    _patch_cloudformation()
