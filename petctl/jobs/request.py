"""A job request as the user gives it, and its validation: everything is checked here, before
any file is read for upload or any AWS call is made."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from petctl import naming
from petctl.errors import ConfigError
from petctl.instance_types import InstanceTypeInfo
from petctl.storage import parse_s3_url
from petctl.templates import etcd

# NVIDIA GPU families the default image supports: the Deep Learning Base OSS Nvidia Driver AMI
# (Amazon Linux 2023) lists G4dn, G5, G6, Gr6, G6e, G6f, G7, G7e, P4d/P4de, P5/P5e/P5en, P6. This is
# the image's list; whether a type has a GPU at all comes from EC2 (check_instance_types).
DLAMI_GPU_FAMILY = re.compile(r"^(g4dn|g5|g6|gr6|gr6f|g6e|g6f|g7|g7e|p4d|p4de|p5|p5e|p5en|p6-b\d+)$")
DEFAULT_INSTANCE_TYPE = "c6i.large"
DEFAULT_RDZV_INSTANCE_TYPE = "t3.small"
#: The rendezvous server's type by the job's --max, when --rdzv-instance-type is not given: etcd
#: spends about 0.5 ms of CPU on each lease keepalive, one per node a second (docs/rendezvous.md,
#: "At scale": measured at 1,000 nodes), so N nodes need N/2000 cores. A t3.small's baseline is
#: 0.4 vCPU (20 % of each of its 2; above it, burstable credits run out or cost extra): up to 200
#: nodes (0.1 core) it has room to spare; beyond, non-burstable types with room for twice the load.
RDZV_SIZES = ((200, DEFAULT_RDZV_INSTANCE_TYPE), (2000, "c6i.large"), (4000, "c6i.xlarge"))
RDZV_LARGEST = "c6i.2xlarge"
DEFAULT_DRAIN_TIMEOUT = 120
# A spot node gets a 2-minute interruption notice: its drain must end inside it.
DEFAULT_SPOT_DRAIN_TIMEOUT = 90
INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\d[a-z0-9-]*\.[a-z0-9]+$")

# One torch per job. The default is the version CI tests the agent with; the range is where the
# agent's torch internals were checked (the agent verifies them again at start, torch_compat).
DEFAULT_TORCH_VERSION = "2.13.0"
SUPPORTED_TORCH = ((2, 9), (2, 13))  # inclusive, major.minor
TORCH_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
DEFAULT_MAX_RESTARTS = 10
#: the agent's node/churn.py MAX_NODE_FAILURES (the spec's max_node_failures)
DEFAULT_MAX_NODE_FAILURES = 10
DEFAULT_JOIN_TIMEOUT = 1800
MAX_WARM_POOL = 100


@dataclass
class JobRequest:
    target: str
    args: list[str] = field(default_factory=list)
    min_nodes: int = 1
    max_nodes: int = 1
    size: int | None = None
    name: str | None = None
    instance_type: str = DEFAULT_INSTANCE_TYPE
    #: None: by --max (default_rdzv_instance_type), set by validate_request
    rdzv_instance_type: str | None = None
    nproc_per_node: str = "auto"
    spot: bool = False
    ami: str | None = None
    drain_timeout: int | None = None  # DEFAULT_(SPOT_)DRAIN_TIMEOUT, set by validate_request
    env: dict[str, str] = field(default_factory=dict)
    torch_version: str = DEFAULT_TORCH_VERSION
    max_restarts: int = DEFAULT_MAX_RESTARTS
    max_node_failures: int = DEFAULT_MAX_NODE_FAILURES
    join_timeout: int = DEFAULT_JOIN_TIMEOUT
    rdzv_backend: str = "petctl-etcd"  # petctl_agent.spec.RDZV_BACKENDS
    root_device_name: str | None = None  # of --ami, looked up by resolve_ami()
    #: Stopped instances, pre-booted with the job's environment, that a scale-up takes first.
    warm_pool: int = 0
    #: The job's own copy of the official etcd release tarball (s3:// or https://) and its
    #: SHA-256, for a rendezvous subnet without internet access; None: the pinned official one.
    rdzv_etcd_url: str | None = None
    rdzv_etcd_sha256: str | None = None
    #: ``--requirements FILE`` (None: the project's top requirements.txt, if any)
    requirements: str | None = None
    #: ``--no-requirements``: install none, not even the project's requirements.txt
    no_requirements: bool = False
    #: ``--live``: each node's workers are torchft replica groups that never restart on a change;
    #: the rendezvous instance runs the job's lighthouse beside etcd
    live: bool = False
    #: ``--no-placement-group``: EFA workers without a cluster placement group (which is on by default
    #: for EFA types: one zone, close together)
    no_placement_group: bool = False


def default_rdzv_instance_type(max_nodes: int) -> str:
    """The rendezvous server's type for a job of at most ``max_nodes`` nodes (:data:`RDZV_SIZES`)."""
    return next((t for most, t in RDZV_SIZES if max_nodes <= most), RDZV_LARGEST)


def family(instance_type: str) -> str:
    return instance_type.split(".", 1)[0]


def instance_types(req: JobRequest) -> list[str]:
    return [t.strip() for t in req.instance_type.split(",") if t.strip()]


def sanitize_tag_value(value: str) -> str:
    """A tag value AWS accepts everywhere (EC2, Auto Scaling, CloudFormation): letters, digits,
    spaces and ``_.:/=+-@``, at most 128 characters (other characters become '-')."""
    return (re.sub(r"[^\w .:/=+\-@]", "-", value, flags=re.ASCII).strip()[:128]) or "unknown"


def default_job_name(req: JobRequest, profile: str = "") -> str:
    """``<script stem>-<4 hex>``, the same for the same request: a dry run names the job the real
    run will make, and running the same command twice finds the first job instead of a twin."""
    target = req.target if req.target.startswith("s3://") else str(Path(req.target).resolve())
    stem = Path(req.target.rstrip("/")).stem
    stem = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-") or "job"
    if not stem[0].isalpha():
        stem = "job-" + stem
    fields = {k: v for k, v in asdict(req).items() if k not in ("name", "target", "root_device_name")}
    if not req.warm_pool:
        del fields["warm_pool"]  # jobs named before warm pools existed keep their names
    for name in ("rdzv_etcd_url", "rdzv_etcd_sha256", "requirements"):
        if fields[name] is None:
            del fields[name]  # and those named before an etcd copy or requirements could be given
    if not req.no_requirements:
        del fields["no_requirements"]
    if not req.live:
        del fields["live"]  # jobs named before live mode existed keep their names
    if not req.no_placement_group:
        del fields["no_placement_group"]  # and those named before placement groups
    digest = hashlib.sha1(json.dumps([profile, target, fields], sort_keys=True).encode()).hexdigest()[:4]
    return f"{stem[:30].rstrip('-')}-{digest}"


def validate_request(req: JobRequest) -> JobRequest:
    """Check sizes, name and target before anything is created."""
    size = req.min_nodes if req.size is None else req.size
    if req.min_nodes < 1:
        raise ConfigError(f"--min {req.min_nodes} is invalid: a job needs at least 1 node")
    if req.max_nodes < req.min_nodes:
        raise ConfigError(f"--max {req.max_nodes} is smaller than --min {req.min_nodes}")
    if not req.min_nodes <= size <= req.max_nodes:
        raise ConfigError(f"--size {size} is outside [--min {req.min_nodes}, --max {req.max_nodes}]")
    req.size = size
    if req.name is not None and not naming.JOB_NAME_RE.match(req.name):
        raise ConfigError(
            f"job name {req.name!r} is invalid: 2-40 characters, lower-case letters, digits and '-', "
            f"starting with a letter"
        )
    types = instance_types(req)
    if not types or len(types) > 20:
        raise ConfigError(
            f"--instance-type {req.instance_type!r}: give 1 to 20 comma-separated instance types"
        )
    for t in types:
        if not INSTANCE_TYPE_RE.match(t):
            raise ConfigError(f"--instance-type {t!r} is not an EC2 instance type like c6i.large")
        if len(types) > 1 and types.count(t) > 1:
            raise ConfigError(f"--instance-type lists {t} twice")
    if req.rdzv_instance_type is None:
        req.rdzv_instance_type = default_rdzv_instance_type(req.max_nodes)
    if not INSTANCE_TYPE_RE.match(req.rdzv_instance_type):
        raise ConfigError(
            f"--rdzv-instance-type {req.rdzv_instance_type!r} is not an EC2 instance type like t3.small"
        )
    _check_etcd_copy(req)
    if req.nproc_per_node != "auto" and not (req.nproc_per_node.isdigit() and int(req.nproc_per_node) >= 1):
        raise ConfigError(
            f"--nproc-per-node {req.nproc_per_node!r} is invalid: use 'auto' or a positive integer"
        )
    if req.ami is not None and not re.match(r"^ami-[0-9a-f]{8,17}$", req.ami):
        raise ConfigError(f"--ami {req.ami!r} is not an AMI id like ami-0abc12345")
    _check_warm_pool(req, types)
    if req.drain_timeout is None:
        req.drain_timeout = DEFAULT_SPOT_DRAIN_TIMEOUT if req.spot else DEFAULT_DRAIN_TIMEOUT
    if req.drain_timeout < 30 or req.drain_timeout > 7200:
        raise ConfigError(f"--drain-timeout {req.drain_timeout} is out of range: use 30 to 7200 seconds")
    m = TORCH_VERSION_RE.match(req.torch_version)
    lo, hi = SUPPORTED_TORCH
    if not m or not lo <= (int(m.group(1)), int(m.group(2))) <= hi:
        raise ConfigError(
            f"--torch-version {req.torch_version!r} is not supported: use a release like "
            f"{DEFAULT_TORCH_VERSION} from {lo[0]}.{lo[1]}.0 to {hi[0]}.{hi[1]}.x"
        )
    if not 0 <= req.max_restarts <= 1000:
        raise ConfigError(f"--max-restarts {req.max_restarts} is out of range: use 0 to 1000")
    if not 1 <= req.max_node_failures <= 1000:
        raise ConfigError(f"--max-node-failures {req.max_node_failures} is out of range: use 1 to 1000")
    if not 60 <= req.join_timeout <= 7 * 86400:
        raise ConfigError(
            f"--join-timeout {req.join_timeout} is out of range: use 60 to 604800 seconds (7 days)"
        )
    if req.target.startswith("s3://"):
        parse_s3_url(req.target)
        if req.target.endswith("/"):
            raise ConfigError(f"{req.target} is a prefix: give the URL of the script itself")
    else:
        p = Path(req.target)
        if not p.exists():
            raise ConfigError(f"{req.target} does not exist: give a script, a directory or an s3:// URL")
        if p.is_dir() and not req.args:
            raise ConfigError(
                f"{req.target} is a directory: give the script inside it as the first argument after --"
            )
        if p.is_dir() and not (p / req.args[0]).is_file():
            raise ConfigError(f"{req.args[0]} is not a file inside {req.target}")
    return req


def check_instance_types(req: JobRequest, facts: dict[str, InstanceTypeInfo]) -> bool:
    """Refuse types the job's image cannot run, from what EC2 says about them (``facts``, looked
    up by ``lookups.instance_facts``: every worker type and the rendezvous type); True when the
    workers are GPU types. Pure: no AWS call."""
    types = instance_types(req)
    for t in types:
        info = facts[t]
        if req.ami is None and (not info.x86 or info.neuron or (info.gpu and not info.nvidia)):
            what = (
                f"{'/'.join(info.architectures) or 'not x86_64'} (Graviton)"
                if not info.x86
                else "Inferentia/Trainium"
                if info.neuron
                else f"{info.gpu_manufacturer} GPU"
            )
            raise ConfigError(
                f"--instance-type {t}: {what} types need an image petctl does not pick for you; pass --ami, "
                f"or use an x86 CPU or NVIDIA GPU type"
            )
        if req.ami is None and info.gpu and not DLAMI_GPU_FAMILY.match(family(t)):
            raise ConfigError(
                f"--instance-type {t}: the Deep Learning AMI does not support {family(t)}; use a G4dn, G5, "
                f"G6, G6e, P4d, P5 or newer type, or pass --ami with an image that does"
            )
    if len({facts[t].gpu for t in types}) > 1:
        gpu = ",".join(t for t in types if facts[t].gpu)
        raise ConfigError(
            f"--instance-type {req.instance_type}: mixes GPU ({gpu}) and CPU types, which need different "
            f"images; list only one kind"
        )
    arch = rdzv_architecture(req, facts)
    if req.live:
        _check_live(req, facts, arch)
    return facts[types[0]].gpu


def _check_live(req: JobRequest, facts: dict[str, InstanceTypeInfo], rdzv_arch: str) -> None:
    """``--live`` runs torchft on the workers and its lighthouse on the rendezvous server: torchft
    ships x86_64 wheels only (0.2.0 has none for aarch64), so both must be x86_64."""
    arm = [t for t in instance_types(req) if not facts[t].x86]
    if arm:
        raise ConfigError(
            f"--live: --instance-type {arm[0]} is {'/'.join(facts[arm[0]].architectures) or 'not x86_64'}, and "
            f"torchft (live membership) has x86_64 wheels only; use an x86_64 type, or drop --live"
        )
    if rdzv_arch != "x86_64":
        raise ConfigError(
            f"--live: --rdzv-instance-type {req.rdzv_instance_type} is {rdzv_arch}, and the job's lighthouse "
            f"(torchft) has x86_64 wheels only; use an x86_64 type like t3.small, or drop --live"
        )
    if req.rdzv_backend != "petctl-etcd":
        raise ConfigError(
            f"--live goes with the default rendezvous (petctl-etcd), not --rdzv-backend {req.rdzv_backend}: "
            f"live workers never use torch's rendezvous"
        )


#: Families whose EFA does RDMA (GPUDirect RDMA from the GPU's memory): libfabric's efa provider
#: uses it with FI_EFA_USE_DEVICE_RDMA=1 (AWS: p4d, p4de, p5, p5e, p5en, p6); on other EFA types
#: (g5, g6e, ...) the variable is left unset, since the provider refuses RDMA a device lacks.
EFA_RDMA_FAMILY = re.compile(r"^(p4d|p4de|p5|p5e|p5en|p6-[a-z0-9]+|p6e-[a-z0-9]+)$")


def efa_interfaces(req: JobRequest, facts: dict[str, InstanceTypeInfo]) -> int:
    """EFA interfaces each worker gets (0: none). One launch template serves every --instance-type,
    so EFA only when every type supports it with the same number of interfaces (a type with fewer
    network cards would refuse the others' card indexes); a type without EFA is simply not EFA."""
    counts = {facts[t].efa_interfaces for t in instance_types(req)}
    return counts.pop() if len(counts) == 1 else 0


def efa_env(req: JobRequest, interfaces: int) -> dict[str, str]:
    """What an EFA job's workers get in their environment, under the user's own --env (which wins):
    libfabric's efa provider for NCCL's aws-ofi-nccl plugin (the Deep Learning AMI ships both), and
    device RDMA on the families that have it. NCCL's own tuning (NCCL_PROTO, ...) is left default."""
    if not interfaces:
        return {}
    env = {"FI_PROVIDER": "efa"}
    if all(EFA_RDMA_FAMILY.match(family(t)) for t in instance_types(req)):
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def rdzv_architecture(req: JobRequest, facts: dict[str, InstanceTypeInfo]) -> str:
    """EC2's architecture of the rendezvous instance type, ``x86_64`` or ``arm64`` (Graviton):
    it picks the Amazon Linux 2023 image and the etcd tarball. Refuses any other (Mac, 32-bit)."""
    archs = facts[req.rdzv_instance_type].architectures
    for arch in etcd.EC2_TO_ETCD_ARCH:
        if arch in archs:
            return arch
    raise ConfigError(
        f"--rdzv-instance-type {req.rdzv_instance_type} is {'/'.join(archs) or 'of no known architecture'}: "
        f"the rendezvous server runs Amazon Linux 2023 on x86_64 or arm64; use a type like t3.small or t4g.small"
    )


def _check_etcd_copy(req: JobRequest) -> None:
    """``--rdzv-etcd-url`` and ``--rdzv-etcd-sha256`` go together, and are well formed."""
    url, sha256 = req.rdzv_etcd_url, req.rdzv_etcd_sha256
    if url is None and sha256 is None:
        return
    if url is None or sha256 is None:
        raise ConfigError(
            "--rdzv-etcd-url and --rdzv-etcd-sha256 go together: give the copy's URL and the SHA-256 of "
            "its file (`sha256sum etcd-v*.tar.gz`), or neither for the official release"
        )
    if not etcd.USER_URL_RE.match(url):
        raise ConfigError(
            f"--rdzv-etcd-url {url!r} is not an s3://BUCKET/KEY or https://HOST/PATH URL of an etcd "
            f"release tarball (no spaces or quotes)"
        )
    if url.startswith("s3://"):
        parse_s3_url(url)
        if url.endswith("/"):
            raise ConfigError(f"--rdzv-etcd-url {url} is a prefix: give the URL of the tarball itself")
    req.rdzv_etcd_sha256 = sha256.strip().lower()
    if not etcd.SHA256_RE.match(req.rdzv_etcd_sha256):
        raise ConfigError(
            f"--rdzv-etcd-sha256 {sha256!r} is not a SHA-256: give the 64 hex digits `sha256sum` prints"
        )


def _check_warm_pool(req: JobRequest, types: list[str]) -> None:
    if not 0 <= req.warm_pool <= MAX_WARM_POOL:
        raise ConfigError(f"--warm-pool {req.warm_pool} is out of range: use 0 to {MAX_WARM_POOL}")
    if not req.warm_pool:
        return
    if req.spot or len(types) > 1:
        raise ConfigError(
            f"--warm-pool cannot go with {'--spot' if req.spot else 'several --instance-type values'}: "
            f"AWS does not allow a warm pool on a group with Spot instances or a mixed instances policy"
        )
    if req.warm_pool > req.max_nodes:
        raise ConfigError(
            f"--warm-pool {req.warm_pool} is more than --max {req.max_nodes}: the group never runs more "
            f"than --max nodes, so the rest of the pool would only cost; use --warm-pool {req.max_nodes} or fewer"
        )
