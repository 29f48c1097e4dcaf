"""The job spec (``job.json`` version 1, docs/contracts.md): parse, validate, load."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlparse

JOB_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
CODE_KINDS = ("script", "dir", "s3")
#: bounds of ``join_timeout`` (seconds): below MIN for this long -> FAILED
MIN_JOIN_TIMEOUT, MAX_JOIN_TIMEOUT = 1.0, 7 * 24 * 3600.0
#: ``rdzv_backend`` values (agent/elastic.py RDZV_BACKENDS; the first is the default)
RDZV_BACKENDS = ("petctl-etcd", "etcd-v2", "etcd")
TORCH_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?([a-z0-9.]*)?(\+[A-Za-z0-9.]+)?$")


class SpecError(ValueError):
    """The job spec is missing, unreadable or invalid (message names the field and value)."""


@dataclass(frozen=True)
class JobSpec:
    """A validated job spec. Optional fields default to "feature off" (empty string)."""

    job_name: str
    min_nodes: int
    max_nodes: int
    code_url: str
    script: str
    version: int = 1
    user: str = ""
    region: str = ""
    nproc_per_node: str | int = "auto"
    code_kind: str = "script"
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str = ""
    status_url: str = ""
    log_group: str = ""
    worker_group: str = ""
    rdzv_group: str = ""
    lifecycle_hook: str = ""
    drain_timeout: float = 60.0
    rdzv_port: int = 2379
    max_restarts: int = 10
    join_timeout: float = 1800.0
    torch_version: str = ""
    rdzv_backend: str = "petctl-etcd"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        """Validate a decoded ``job.json``; unknown keys are ignored (forward compatible)."""
        if not isinstance(d, dict):
            raise SpecError(f"job spec must be a JSON object, got {type(d).__name__}")
        version = d.get("version", 1)
        if version != 1:
            raise SpecError(f"unsupported job spec version {version!r} (this agent reads version 1)")
        missing = [
            k for k in ("job_name", "min_nodes", "max_nodes", "code_url", "script") if d.get(k) in (None, "")
        ]
        if missing:
            raise SpecError(f"job spec is missing required field(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        name = kw["job_name"]
        if not isinstance(name, str) or not JOB_NAME_RE.match(name):
            raise SpecError(f"job_name {name!r} must match {JOB_NAME_RE.pattern}")
        try:
            kw["min_nodes"], kw["max_nodes"] = int(kw["min_nodes"]), int(kw["max_nodes"])
            kw["drain_timeout"] = float(kw.get("drain_timeout", 60))
            kw["rdzv_port"] = int(kw.get("rdzv_port", 2379))
            kw["max_restarts"] = int(kw.get("max_restarts", 10))
            kw["join_timeout"] = float(kw.get("join_timeout", 1800))
        except (TypeError, ValueError) as e:
            raise SpecError(f"job spec has a non-numeric count or timeout: {e}") from e
        if kw["max_restarts"] < 0:
            raise SpecError(f"max_restarts must be >= 0, got {kw['max_restarts']}")
        if not MIN_JOIN_TIMEOUT <= kw["join_timeout"] <= MAX_JOIN_TIMEOUT:
            raise SpecError(
                f"join_timeout must be between {MIN_JOIN_TIMEOUT:.0f} and {MAX_JOIN_TIMEOUT:.0f} seconds, "
                f"got {kw['join_timeout']:g}"
            )
        tv = kw.get("torch_version", "")
        if not isinstance(tv, str) or (tv and not TORCH_VERSION_RE.match(tv)):
            raise SpecError(f"torch_version must be a version like '2.13.0' (or empty), got {tv!r}")
        rb = kw.get("rdzv_backend", "") or RDZV_BACKENDS[0]
        if rb not in RDZV_BACKENDS:
            raise SpecError(f"rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got {rb!r}")
        kw["rdzv_backend"] = rb
        if not 1 <= kw["min_nodes"] <= kw["max_nodes"]:
            raise SpecError(
                f"need 1 <= min_nodes <= max_nodes, got min={kw['min_nodes']} max={kw['max_nodes']}"
            )
        if kw["drain_timeout"] < 0:
            raise SpecError(f"drain_timeout must be >= 0, got {kw['drain_timeout']}")
        if kw.get("code_kind", "script") not in CODE_KINDS:
            raise SpecError(f"code_kind {kw['code_kind']!r} must be one of {', '.join(CODE_KINDS)}")
        npn = kw.get("nproc_per_node", "auto")
        if npn != "auto":
            try:
                npn = int(npn)
            except (TypeError, ValueError):
                raise SpecError(f"nproc_per_node must be 'auto' or a positive integer, got {npn!r}") from None
            if npn < 1:
                raise SpecError(f"nproc_per_node must be 'auto' or a positive integer, got {npn!r}")
            kw["nproc_per_node"] = npn
        args = kw.get("args", [])
        if not isinstance(args, list | tuple) or not all(isinstance(a, str) for a in args):
            raise SpecError(f"args must be a list of strings, got {args!r}")
        kw["args"] = tuple(args)
        env = kw.get("env", {})
        if not isinstance(env, dict):
            raise SpecError(f"env must be an object of strings, got {env!r}")
        kw["env"] = {str(k): str(v) for k, v in env.items()}
        return cls(**kw)

    def resolved_nproc(self) -> int:
        """``nproc_per_node`` with ``auto`` resolved: number of GPUs, or 1 on CPU."""
        if self.nproc_per_node != "auto":
            return int(self.nproc_per_node)
        try:
            import torch

            return max(torch.cuda.device_count(), 1)
        except Exception:  # noqa: BLE001 - no CUDA, no GPUs
            return 1


def rdzv_backend(spec_backend: str = "") -> str:
    """The rendezvous backend to use: ``$PETCTL_AGENT_RDZV_BACKEND``, else the spec's
    ``rdzv_backend``, else petctl-etcd. Raises ValueError for an unknown name."""
    name = os.environ.get("PETCTL_AGENT_RDZV_BACKEND", "") or spec_backend or RDZV_BACKENDS[0]
    if name not in RDZV_BACKENDS:
        raise ValueError(f"rendezvous backend {name!r} is not one of {', '.join(RDZV_BACKENDS)}")
    return name


def read_url(url: str, s3_client_factory: Any = None) -> bytes:
    """Read ``s3://bucket/key``, ``file:///path`` or a plain path."""
    u = urlparse(url)
    if u.scheme == "s3":
        factory = s3_client_factory or (lambda: _boto3_client("s3"))
        obj = factory().get_object(Bucket=u.netloc, Key=u.path.lstrip("/"))
        return obj["Body"].read()
    path = u.path if u.scheme == "file" else url
    with open(path, "rb") as f:
        return f.read()


def load_spec(url: str, s3_client_factory: Any = None) -> JobSpec:
    """Fetch and validate the job spec at ``url`` (S3, ``file://`` or a local path)."""
    try:
        raw = read_url(url, s3_client_factory)
    except Exception as e:  # noqa: BLE001 - every way of not getting it is the same error to the user
        raise SpecError(f"cannot read the job spec at {url}: {e}") from e
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise SpecError(f"job spec at {url} is not JSON: {e}") from e
    return JobSpec.from_dict(data)


def _boto3_client(service: str, region: str | None = None) -> Any:
    """boto3 client honouring AWS_ENDPOINT_URL (boto3 does) with short timeouts and few retries."""
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 3, "mode": "standard"})
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.client(service, region_name=region, config=cfg)
