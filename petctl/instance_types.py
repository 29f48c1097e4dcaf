"""What EC2 says about an instance type (``DescribeInstanceTypes``), as plain data.

GPU or CPU is decided from these facts, not from the type's name: a type is a GPU type when EC2
lists GPUs for it (``GpuInfo.Gpus``). EFA likewise: ``NetworkInfo.EfaSupported``, how many network
cards (``MaximumNetworkCards``) and EFA interfaces (``EfaInfo.MaximumEfaInterfaces``) it takes. A fractional GPU type (``gr6f``, ``g6f``: a partition of an
L4) reports ``Count`` 0 and ``LogicalGpuCount`` 1, so the count alone would misread it as CPU.
Standard library only: the gateway builds these, the pure plan reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class InstanceTypeInfo:
    name: str
    architectures: tuple[str, ...] = ()
    vcpus: int = 0
    memory_mib: int = 0
    #: Whole GPUs (``Count``) and GPU devices (``LogicalGpuCount``; a partition counts as one).
    gpus: int = 0
    logical_gpus: int = 0
    gpu_manufacturer: str | None = None
    gpu_name: str | None = None
    #: Inferentia or Trainium (``NeuronInfo`` or ``InferenceAcceleratorInfo``).
    neuron: bool = False
    #: Elastic Fabric Adapter (``NetworkInfo.EfaSupported``), the type's network cards
    #: (``MaximumNetworkCards``) and the most EFA interfaces it takes (``EfaInfo.MaximumEfaInterfaces``).
    efa: bool = False
    network_cards: int = 1
    max_efa_interfaces: int = 0

    @property
    def efa_interfaces(self) -> int:
        """EFA interfaces a worker of this type gets: one per network card, as far as the type
        takes EFA interfaces (p5.48xlarge: 32, p4d.24xlarge: 4, g5.48xlarge: 1); 0 without EFA."""
        if not self.efa:
            return 0
        return max(1, min(self.network_cards, self.max_efa_interfaces or 1))

    @property
    def gpu(self) -> bool:
        return self.gpu_manufacturer is not None or self.gpus > 0 or self.logical_gpus > 0

    @property
    def nvidia(self) -> bool:
        return self.gpu and (self.gpu_manufacturer or "").upper() == "NVIDIA"

    @property
    def x86(self) -> bool:
        return "x86_64" in self.architectures

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceTypeInfo:
        """The cached form back (``KeyError``/``TypeError``/``ValueError`` on a damaged one)."""
        return cls(
            name=str(d["name"]),
            architectures=tuple(str(a) for a in d["architectures"]),
            vcpus=int(d["vcpus"]),
            memory_mib=int(d["memory_mib"]),
            gpus=int(d["gpus"]),
            logical_gpus=int(d["logical_gpus"]),
            gpu_manufacturer=None if d["gpu_manufacturer"] is None else str(d["gpu_manufacturer"]),
            gpu_name=None if d["gpu_name"] is None else str(d["gpu_name"]),
            neuron=bool(d["neuron"]),
            # required: an entry cached before these facts existed is damaged, so looked up again
            # (read as "no EFA" it would hide a p5's EFA for the cache's week)
            efa=bool(d["efa"]),
            network_cards=int(d["network_cards"]),
            max_efa_interfaces=int(d["max_efa_interfaces"]),
        )

    @classmethod
    def from_ec2(cls, d: dict[str, Any]) -> InstanceTypeInfo:
        """One entry of DescribeInstanceTypes' ``InstanceTypes``."""
        gpus = (d.get("GpuInfo") or {}).get("Gpus") or []
        net = d.get("NetworkInfo") or {}
        return cls(
            name=d["InstanceType"],
            architectures=tuple((d.get("ProcessorInfo") or {}).get("SupportedArchitectures") or ()),
            vcpus=int((d.get("VCpuInfo") or {}).get("DefaultVCpus") or 0),
            memory_mib=int((d.get("MemoryInfo") or {}).get("SizeInMiB") or 0),
            gpus=sum(int(g.get("Count") or 0) for g in gpus),
            logical_gpus=sum(int(g.get("LogicalGpuCount") or g.get("Count") or 0) for g in gpus),
            gpu_manufacturer=(gpus[0].get("Manufacturer") or "unknown") if gpus else None,
            gpu_name=gpus[0].get("Name") if gpus else None,
            neuron=bool(d.get("NeuronInfo") or d.get("InferenceAcceleratorInfo")),
            efa=bool(net.get("EfaSupported")),
            network_cards=int(net.get("MaximumNetworkCards") or 1),
            max_efa_interfaces=int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces") or 0),
        )
