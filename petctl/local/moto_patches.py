"""Changes to moto's behaviour inside the local cloud daemon (never imported elsewhere).

1. **Private IPs**: moto hands out subnet addresses sequentially (``.4``, ``.5``, …)
   and reuses freed ones at once. In the local cloud an instance's private IP is
   the loopback address its processes bind to, so two local clouds on one machine
   (parallel test runs) would collide, and a new instance could get the address
   of one that is still draining. Addresses are therefore drawn at random and
   claimed machine-wide with an ``flock``\\ ed file per address (released when the
   daemon exits), and never reused within a daemon's life.
2. **Lifecycle actions**: moto does not implement ``CompleteLifecycleAction`` or
   ``RecordLifecycleActionHeartbeat``. The reconciler emulates the termination
   hook, so these calls are answered from it: success for an instance that is
   draining (which ends its wait), ``ValidationError`` otherwise, as AWS does.
3. **Log stream prefix**: moto's ``FilterLogEvents`` ignores ``logStreamNamePrefix`` and
   returns every stream of the group, so ``petctl logs J`` showed other jobs' lines. It is
   honoured as AWS does (and naming both ``logStreamNames`` and the prefix is refused).
5. **PutLogEvents limits**: at most 10,000 events and 1,048,576 bytes a batch (messages'
   UTF-8 bytes plus 26 per event), 256 KB an event, non-empty messages. AWS refuses the
   call; moto accepts anything.
4. **EFS mount targets**: a file system has mount targets in one VPC at a time; AWS answers
   ``MountTargetConflict`` for a second VPC, and refuses a mount target of a One Zone file
   system outside its zone. moto allows both.
6. **Network interfaces**: AWS detaches an interface attached after launch (not deleted on
   termination) when its instance terminates, and refuses to attach an interface that is in use or
   at a device index the instance already uses. moto keeps the interface attached to the
   terminated instance (a replacement rendezvous instance could never take it over) and attaches
   anything anywhere.
7. **Warm pools**: moto keeps a warm pool's settings only; :mod:`petctl.local.moto_warm_pool`
   gives it instances, AWS's sizing and lifecycle states, and CloudFormation support.
9. **Instance profiles from launch templates**: an instance launched from a launch template (by
   a group, or RunInstances) gets the template's ``IamInstanceProfile`` on AWS; moto drops it, so
   the instance would have no role (the ``mount`` shim's ``iam`` option reads it).
8. **EFS access points and file system policies** in CloudFormation (:mod:`petctl.local.moto_efs`):
   an access point's ``Ref``/``Fn::GetAtt`` and AWS's checks of its properties; a file system's
   ``FileSystemPolicy``.

Each patch wraps one moto method with :func:`petctl.local.patching.wrap`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.local import moto_efs, moto_warm_pool
from petctl.local.patching import wrap

_claims: dict[str, int] = {}  # ip -> fd holding its flock
_claims_lock = threading.Lock()

#: Set by the reconciler: (instance_id, action) -> error message or None. ``action`` is
#: ``"complete"`` or ``"heartbeat"``.
lifecycle_handler: Callable[[str, str, dict[str, Any]], str | None] | None = None


def claim_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"petctl-local-ips-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def claim_ip(ip: str) -> bool:
    """Claim ``ip`` for this daemon's lifetime; False if another daemon holds it."""
    with _claims_lock:
        if ip in _claims:
            return False  # already used by this daemon: never hand it out twice
        fd = os.open(claim_dir() / ip, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        _claims[ip] = fd
        return True


def _random_host(cidr: str, taken: Callable[[str], bool]) -> str | None:
    net = ipaddress.ip_network(cidr, strict=False)
    if net.version != 4 or net.num_addresses < 8:
        return None
    # AWS reserves the first four addresses and the last one of every subnet.
    lo, hi = int(net.network_address) + 4, int(net.broadcast_address) - 1
    for _ in range(512):
        ip = str(ipaddress.IPv4Address(random.randint(lo, hi)))
        if not taken(ip) and claim_ip(ip):
            return ip
    return None


def _patch_log_stream_prefix() -> None:
    import json

    from moto.logs.exceptions import InvalidParameterException
    from moto.logs.responses import LogsResponse

    @wrap(LogsResponse, "filter_log_events")
    def filter_log_events(original: Callable[[Any], str], self: Any) -> str:
        prefix = self._get_param("logStreamNamePrefix")
        if not prefix:
            return original(self)
        if self._get_param("logStreamNames"):
            raise InvalidParameterException(
                "Cannot specify both logStreamNames and logStreamNamePrefix in the same request"
            )
        group_name = self._get_param("logGroupName")
        group = self.logs_backend.groups.get(group_name)
        names = sorted(n for n in (group.streams if group else {}) if n.startswith(prefix))
        if not names:  # moto reads an empty list as "every stream"
            return json.dumps({"events": [], "searchedLogStreams": []})
        events, next_token, searched = self.logs_backend.filter_log_events(
            group_name,
            names,
            self._get_param("startTime"),
            self._get_param("endTime"),
            self._get_param("limit"),
            self._get_param("nextToken"),
            self._get_param("filterPattern"),
            self._get_param("interleaved", False),
        )
        return json.dumps({"events": events, "nextToken": next_token, "searchedLogStreams": searched})


def _patch_efs_mount_targets() -> None:
    from moto.efs.exceptions import BadRequest, MountTargetConflict
    from moto.efs.models import EFSBackend

    @wrap(EFSBackend, "create_mount_target")
    def create_mount_target(
        original: Callable[..., Any],
        self: Any,
        file_system_id: str,
        subnet_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        fs = self.file_systems_by_id.get(file_system_id)
        try:
            subnet = self.ec2_backend.get_subnet(subnet_id)
        except Exception:  # noqa: BLE001 - moto's own error for a bad subnet
            subnet = None
        if fs is not None and subnet is not None:
            vpcs = {
                mt.subnet_vpc_id
                for mt in self.mount_targets_by_id.values()
                if mt.file_system_id == file_system_id
            }
            if vpcs and subnet.vpc_id not in vpcs:
                raise MountTargetConflict(
                    f"File system '{file_system_id}' already has mount targets in VPC {sorted(vpcs)[0]}; "
                    f"all of a file system's mount targets must be in one VPC"
                )
            zone = getattr(fs, "availability_zone_name", None)
            if zone and subnet.availability_zone != zone:
                raise BadRequest(
                    f"One Zone file system '{file_system_id}' lives in {zone}; subnet {subnet_id} is in "
                    f"{subnet.availability_zone}"
                )
        return original(self, file_system_id, subnet_id, *args, **kwargs)


def _patch_put_log_events_limits() -> None:
    from moto.logs.exceptions import InvalidParameterException
    from moto.logs.responses import LogsResponse

    @wrap(LogsResponse, "put_log_events")
    def put_log_events(original: Callable[[Any], str], self: Any) -> str:
        events = self._get_param("logEvents") or []
        if len(events) > 10_000:
            raise InvalidParameterException(f"Too many log events in the batch: {len(events)} (max 10000)")
        sizes = [len((e.get("message") or "").encode("utf-8")) + 26 for e in events]
        if any(size > 256 * 1024 for size in sizes):
            raise InvalidParameterException("Log event too large: the maximum is 262144 bytes")
        if any(not e.get("message") for e in events):
            raise InvalidParameterException("Log event message must not be empty")
        if sum(sizes) > 1_048_576:
            raise InvalidParameterException(f"Upload too large: {sum(sizes)} bytes exceeds 1048576 bytes")
        return original(self)


def _patch_network_interfaces() -> None:
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.elastic_network_interfaces import NetworkInterfaceBackend
    from moto.ec2.models.instances import Instance

    @wrap(Instance, "terminate")
    def terminate(original: Callable[[Any], Any], self: Any) -> Any:
        # Secondary interfaces only: the primary one (device 0) is the instance's own.
        kept = [nic for idx, nic in self.nics.items() if int(idx) != 0 and not nic.delete_on_termination]
        result = original(self)
        for nic in kept:
            if nic.instance is self:
                self.detach_eni(nic)
        return result

    @wrap(NetworkInterfaceBackend, "attach_network_interface")
    def attach_network_interface(
        original: Callable[..., Any], self: Any, eni_id: str, instance_id: str, device_index: int
    ) -> Any:
        eni = self.get_network_interface(eni_id)
        instance = self.get_instance(instance_id)
        if eni.instance is not None:
            raise EC2ClientError("InvalidParameterValue", f"Interface: [{eni_id}] in use.")
        if int(device_index) in instance.nics:
            raise EC2ClientError(
                "InvalidParameterValue",
                f"Instance '{instance_id}' already has an interface attached at device index '{device_index}'.",
            )
        return original(self, eni_id, instance_id, device_index)


def _patch_private_ips() -> None:
    from moto.ec2.models import elastic_network_interfaces as eni_mod
    from moto.ec2.models.subnets import Subnet

    @wrap(Subnet, "get_available_subnet_ip")
    def get_available_subnet_ip(original: Callable[..., str], self: Any, instance: Any) -> str:
        ip = _random_host(str(self.cidr), lambda a: a in self._subnet_ips)
        if ip is None:
            return original(self, instance)
        self._subnet_ips[ip] = instance
        return ip

    @wrap(eni_mod, "random_private_ip")
    def random_private_ip(original: Callable[..., str], cidr: str | None = None, ipv6: bool = False) -> str:
        if cidr and not ipv6:
            ip = _random_host(cidr, lambda a: False)
            if ip:
                return ip
        return original(cidr, ipv6)


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


def _patch_launch_template_instance_profile() -> None:
    from moto.ec2.models.instances import InstanceBackend

    @wrap(InstanceBackend, "run_instances")
    def run_instances(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        reservation = original(self, *args, **kwargs)
        if kwargs.get("launch_template"):
            profile = (
                self._get_template_from_args(kwargs["launch_template"]).data.get("IamInstanceProfile") or {}
            )
            if profile.get("Arn") or profile.get("Name"):
                for instance in reservation.instances:
                    if instance.id not in self.iam_instance_profile_associations:
                        self.associate_iam_instance_profile(
                            instance.id,
                            iam_instance_profile_name=profile.get("Name"),
                            iam_instance_profile_arn=profile.get("Arn"),
                        )
        return reservation


def apply() -> None:
    """Install the patches (idempotent)."""
    _patch_private_ips()
    _patch_lifecycle_actions()
    _patch_network_interfaces()
    _patch_put_log_events_limits()
    _patch_log_stream_prefix()
    _patch_efs_mount_targets()
    _patch_launch_template_instance_profile()
    moto_warm_pool.apply()
    moto_efs.apply()
