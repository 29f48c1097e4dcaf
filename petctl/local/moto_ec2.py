"""EC2 in moto as AWS runs it for the local cloud: addresses, interfaces, instance types, profiles.

Part of :mod:`petctl.local.moto_patches` (its items 1, 6, 10, 11 and 16):

* **Private IPs**: moto hands out subnet addresses sequentially (``.4``, ``.5``, …) and reuses freed
  ones at once. In the local cloud an instance's private IP is the loopback address its processes
  bind to, so two local clouds on one machine (parallel test runs) would collide, and a new instance
  could get the address of one that is still draining. Addresses are therefore drawn at random and
  claimed machine-wide with an ``flock``\\ ed file per address (released when the daemon exits), and
  never reused within a daemon's life.
* **Network interfaces**: AWS detaches an interface attached after launch (not deleted on
  termination) when its instance terminates, and refuses to attach an interface that is in use or
  at a device index the instance already uses. moto keeps the interface attached to the terminated
  instance (a replacement rendezvous instance could never take it over) and attaches anything
  anywhere.
* **Instance types**: moto's ``DescribeInstanceTypes`` table lacks types AWS still describes that
  petctl answers differently (``p3.2xlarge``, ``g4ad.xlarge``); they are added with AWS's figures.
* **Instance profiles from launch templates**: an instance launched from a launch template gets the
  template's ``IamInstanceProfile`` on AWS; moto dropped it.
* **A subnet's MapPublicIpOnLaunch in CloudFormation**: ``AWS::EC2::Subnet`` takes it; moto dropped
  it, so setup's public subnets read as private.
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

from petctl.local.patching import wrap

_claims: dict[str, int] = {}  # ip -> fd holding its flock
_claims_lock = threading.Lock()


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
    """Install the EC2 patches (idempotent)."""
    _patch_instance_types()
    _patch_private_ips()
    _patch_network_interfaces()
    _patch_launch_template_instance_profile()
    _patch_subnet_public_ip()
