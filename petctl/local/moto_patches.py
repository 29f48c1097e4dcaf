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
   call; moto accepts anything. ``rejectedLogEventsInfo`` as the API reference defines it:
   ``tooOldLogEventEndIndex`` exclusive (moto names the last too-old event instead) and
   ``expiredLogEventEndIndex`` for events older than the group's retention (moto has none;
   it still stores them).
5b. **DeleteObjects**: at most 1,000 keys a request (AWS answers ``MalformedXML``); moto took any
   number.
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
8. **Template caps**: CloudFormation refuses an inline ``TemplateBody`` over 51,200 bytes, a
   ``TemplateURL`` object over 1 MB, and a ``TemplateURL`` that is not an https URL of an S3 object
   in a bucket of the stack's region (CreateStack/UpdateStack API reference). moto takes any body,
   and fetches any URL from its own S3 (the bucket name guessed from the host).
9. **DeletionPolicy RetainExceptOnCreate**: AWS keeps such a resource when its stack is deleted,
   except when the operation that created it fails (a failed first create leaves nothing). moto
   knows only ``Retain``, so it deleted these resources with every stack.
10. **Instance types**: moto's ``DescribeInstanceTypes`` table lacks types AWS still describes
   that petctl answers differently (``p3.2xlarge``: an NVIDIA V100 type the Deep Learning AMI no
   longer supports; ``g4ad.xlarge``: an AMD GPU type), so the local cloud called them unknown.
   They are added with AWS's figures (GpuInfo, architecture, vCPUs, memory).
11. **Instance profiles from launch templates**: an instance launched from a launch template (by
   a group, or RunInstances) gets the template's ``IamInstanceProfile`` on AWS; moto drops it, so
   the instance would have no role (the ``mount`` shim's ``iam`` option reads it).
12. **EFS access points and file system policies** in CloudFormation (:mod:`petctl.local.moto_efs`):
   an access point's ``Ref``/``Fn::GetAtt`` and AWS's checks of its properties; a file system's
   ``FileSystemPolicy``.
13. **DescribeAutoScalingGroups IncludeInstances=false**: AWS leaves each group's instances out
   (its advice for large groups, whose full answer may be throttled); moto listed them anyway.
14. **GetEbsDefaultKmsKeyId** (:mod:`petctl.local.moto_ebs`): moto sets the account's default EBS
   key but could not read it back.
15. **Lifecycle hooks declared on a group** (:mod:`petctl.local.moto_hooks`): moto ignored a group's
   ``LifecycleHookSpecificationList``, so the job's worker group had no hooks.
16. **A subnet's MapPublicIpOnLaunch in CloudFormation**: ``AWS::EC2::Subnet`` takes it (CloudFormation
   User Guide, AWS::EC2::Subnet); moto dropped it, so setup's public subnets read as private and
   run-job could not refuse a type with several EFA network cards there (EC2 gives an instance
   launched with several interfaces no public IPv4).

Each patch wraps one moto method with :func:`petctl.local.patching.wrap`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petctl.local import moto_ebs, moto_efs, moto_hooks, moto_warm_pool
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
        body = original(self)
        # moto's rejectedLogEventsInfo: tooOldLogEventEndIndex is the last too-old event's index
        # (AWS: exclusive, one past it) and there is no expiredLogEventEndIndex (the retention).
        now = time.time() * 1000
        group = self.logs_backend.groups.get(self._get_param("logGroupName"))
        retention = getattr(group, "retention_in_days", None)
        stamps = [int(e.get("timestamp", 0)) for e in events]
        info: dict[str, int] = {}
        too_old = [i for i, t in enumerate(stamps) if t < now - 14 * 86_400_000]
        if too_old:
            info["tooOldLogEventEndIndex"] = too_old[-1] + 1
        expired = [i for i, t in enumerate(stamps) if retention and t < now - retention * 86_400_000]
        if expired:
            info["expiredLogEventEndIndex"] = expired[-1] + 1
        too_new = [i for i, t in enumerate(stamps) if t > now + 2 * 3_600_000]
        if too_new:
            info["tooNewLogEventStartIndex"] = too_new[0]
        doc = json.loads(body or "{}")
        doc.pop("rejectedLogEventsInfo", None)
        if info:
            doc["rejectedLogEventsInfo"] = info
        return json.dumps(doc)


def _patch_delete_objects_cap() -> None:
    from moto.s3.exceptions import MalformedXML
    from moto.s3.responses import S3Response

    @wrap(S3Response, "_bucket_response_delete_keys")
    def delete_keys(original: Callable[..., Any], self: Any, bucket_name: str, *args: Any, **kw: Any) -> Any:
        if self.body and self.body.count(b"<Object>") > 1000:  # AWS: MalformedXML over 1,000 keys
            raise MalformedXML()
        return original(self, bucket_name, *args, **kw)


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
        # AWS never hands a new instance an address an interface of the subnet holds (the job's
        # pinned rendezvous address); moto does not count interfaces' addresses as used.
        held = {
            eni.private_ip_address
            for eni in getattr(self.ec2_backend, "enis", {}).values()
            if getattr(eni.subnet, "id", None) == self.id
        }
        ip = _random_host(str(self.cidr), lambda a: a in self._subnet_ips or a in held)
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


#: An S3 object URL CloudFormation takes: virtual-hosted (``bucket.s3.region.amazonaws.com/key``)
#: or path style (``s3.region.amazonaws.com/bucket/key``); no region means us-east-1.
_S3_VIRTUAL = re.compile(
    r"^(?P<bucket>[a-z0-9][a-z0-9.-]*)\.s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com(?:\.cn)?$"
)
_S3_PATH = re.compile(r"^s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com(?:\.cn)?$")


def _patch_template_limits() -> None:
    from urllib.parse import urlparse

    from moto.cloudformation.exceptions import ValidationError
    from moto.cloudformation.responses import CloudFormationResponse
    from moto.s3.models import s3_backends

    from petctl.templates.rendering import TEMPLATE_BODY_MAX_BYTES, TEMPLATE_URL_MAX_BYTES

    def check_body(self: Any) -> None:
        body = self._get_param("TemplateBody")
        if body is not None and len(body.encode("utf-8")) > TEMPLATE_BODY_MAX_BYTES:
            raise ValidationError(
                message=f"1 validation error detected: Value at 'templateBody' failed to satisfy constraint: "
                f"Member must have length less than or equal to {TEMPLATE_BODY_MAX_BYTES}"
            )

    for action in ("create_stack", "update_stack", "create_change_set", "validate_template"):

        @wrap(CloudFormationResponse, action)
        def checked(original: Callable[[Any], Any], self: Any) -> Any:
            check_body(self)
            return original(self)

    @wrap(CloudFormationResponse, "_get_stack_from_s3_url")
    def from_s3(original: Callable[[Any, str], str], self: Any, template_url: str) -> str:
        url = urlparse(template_url)
        host = url.hostname or ""
        virtual, path = _S3_VIRTUAL.match(host), _S3_PATH.match(host)
        if url.scheme != "https" or not (virtual or path):
            raise ValidationError(message="TemplateURL must be a supported URL (https, an Amazon S3 object)")
        if virtual:
            bucket_name, key, url_region = virtual["bucket"], url.path.lstrip("/"), virtual["region"]
        else:
            bucket_name, _, key = url.path.lstrip("/").partition("/")
            url_region = path["region"] if path else None
        backend = s3_backends[self.current_account][self.partition]
        try:
            bucket = backend.get_bucket(bucket_name)
            obj = backend.get_object(bucket_name, key)
        except Exception:  # noqa: BLE001 - NoSuchBucket, NoSuchKey
            obj = None
        if obj is None:
            raise ValidationError(
                message="TemplateURL must reference a valid S3 object to which you have access."
            )
        if bucket.region_name != self.region or (url_region or "us-east-1") != bucket.region_name:
            raise ValidationError(
                message=f"TemplateURL {template_url}: the bucket must be in the stack's region ({self.region}) "
                f"and addressed through it; it is in {bucket.region_name}"
            )
        if len(obj.value) > TEMPLATE_URL_MAX_BYTES:
            raise ValidationError(message=f"Template may not exceed {TEMPLATE_URL_MAX_BYTES} bytes in size.")
        return obj.value.decode("utf-8")


def _patch_retain_except_on_create() -> None:
    from moto.cloudformation.models import Stack

    @wrap(Stack, "delete")
    def delete(original: Callable[[Any], None], self: Any) -> None:
        created = self.status not in ("CREATE_IN_PROGRESS", "CREATE_FAILED", "ROLLBACK_IN_PROGRESS")
        created = created and not self.status.startswith("ROLLBACK")
        for resource in self.resource_map._resource_json_map.values():
            if resource.get("DeletionPolicy") == "RetainExceptOnCreate" and created:
                resource["DeletionPolicy"] = "Retain"  # moto's delete keeps exactly these
        original(self)


#: Instance types AWS describes and moto 5.2 does not: name -> (base entry, changes). Figures from
#: the EC2 instance type specifications (accelerated computing): p3.2xlarge 8 vCPUs, 61 GiB, one
#: V100 16 GiB; g4ad.xlarge 4 vCPUs, 16 GiB, one Radeon Pro V520 8 GiB.
EXTRA_INSTANCE_TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "p3.2xlarge": (
        "g4dn.2xlarge",
        {
            "VCpuInfo": {"DefaultVCpus": 8, "DefaultCores": 4, "DefaultThreadsPerCore": 2},
            "MemoryInfo": {"SizeInMiB": 62464},
            "GpuInfo": {
                "Gpus": [
                    {"Name": "V100", "Manufacturer": "NVIDIA", "Count": 1, "MemoryInfo": {"SizeInMiB": 16384}}
                ],
                "TotalGpuMemoryInMiB": 16384,
            },
            "CurrentGeneration": False,
        },
    ),
    "g4ad.xlarge": (
        "g4dn.xlarge",
        {
            "VCpuInfo": {"DefaultVCpus": 4, "DefaultCores": 2, "DefaultThreadsPerCore": 2},
            "MemoryInfo": {"SizeInMiB": 16384},
            "GpuInfo": {
                "Gpus": [
                    {
                        "Name": "Radeon Pro V520",
                        "Manufacturer": "AMD",
                        "Count": 1,
                        "MemoryInfo": {"SizeInMiB": 8192},
                    }
                ],
                "TotalGpuMemoryInMiB": 8192,
            },
        },
    ),
}


def _patch_instance_types() -> None:
    from moto.ec2.models import instance_types as it

    for name, (base, changes) in EXTRA_INSTANCE_TYPES.items():
        if name in it.INSTANCE_TYPES:
            continue
        it.INSTANCE_TYPES[name] = {**it.INSTANCE_TYPES[base], **changes, "InstanceType": name}
        it.InstanceTypeBackend.instance_types.append(it.InstanceType(name))


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


def _patch_subnet_public_ip() -> None:
    from moto.ec2.models.subnets import Subnet

    # a classmethod: wrap() would install a plain function, so the underlying function is wrapped
    original = Subnet.create_from_cloudformation_json.__func__  # type: ignore[attr-defined]
    if getattr(original, "_petctl_patched", False):
        return

    def create(cls: Any, resource_name: str, cloudformation_json: Any, *args: Any, **kwargs: Any) -> Any:
        subnet = original(cls, resource_name, cloudformation_json, *args, **kwargs)
        value = (cloudformation_json.get("Properties") or {}).get("MapPublicIpOnLaunch")
        if value is not None:  # a bool, or "true"/"false" from a parameter
            subnet.map_public_ip_on_launch = str(value).lower() == "true"
        return subnet

    create._petctl_patched = True  # type: ignore[attr-defined]
    Subnet.create_from_cloudformation_json = classmethod(create)  # type: ignore[method-assign,assignment]


def apply() -> None:
    """Install the patches (idempotent)."""
    _patch_instance_types()
    _patch_retain_except_on_create()
    _patch_template_limits()
    _patch_private_ips()
    _patch_lifecycle_actions()
    _patch_include_instances()
    _patch_network_interfaces()
    _patch_put_log_events_limits()
    _patch_delete_objects_cap()
    _patch_log_stream_prefix()
    _patch_efs_mount_targets()
    _patch_launch_template_instance_profile()
    _patch_subnet_public_ip()
    moto_warm_pool.apply()
    moto_efs.apply()
    moto_ebs.apply()
    moto_hooks.apply()
