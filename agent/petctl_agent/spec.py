"""The job spec (``job.json`` version 1, docs/contracts.md): the one contract between the CLI and the agent.

Standard library only, so the CLI (``petctl``) imports it to build the spec it uploads and the
agent parses the same dataclass: the job-name rule and the checkpoint path are defined here once.
Loading a spec from S3 is :func:`petctl_agent.cloud.fetch.load_spec`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: job names: they end up in stack, group, S3 and etcd key names (docs/contracts.md "Names")
JOB_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
CODE_KINDS = ("script", "dir", "s3")
#: bounds of ``join_timeout`` (seconds): below MIN for this long -> FAILED
MIN_JOIN_TIMEOUT, MAX_JOIN_TIMEOUT = 1.0, 7 * 24 * 3600.0
#: ``rdzv_backend`` values (agent/petctl_agent/elastic/handlers.py builds each; the first is the default)
RDZV_BACKENDS = ("petctl-etcd", "etcd-v2", "etcd")
#: ``run_id``: empty (an older spec) or a token; it is written into marker files, so no paths
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{0,64}$")
#: the live job's lighthouse port on the rendezvous instance (torchft's default, 29510)
LIGHTHOUSE_PORT = 29510
#: the torchft release live mode is built and checked against (setup.py's ``live`` extra pins the
#: same; ``petctl_agent.live.upstream`` works around named lines of it); the rendezvous server
#: installs it for the lighthouse
TORCHFT_VERSION = "0.2.0"
TORCH_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?([a-z0-9.]*)?(\+[A-Za-z0-9.]+)?$")


def checkpoint_dir(job: str) -> str:
    """The job's checkpoint directory, relative to the shared filesystem mount."""
    return f"petctl/jobs/{job}/checkpoints"


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
    #: node failures (failed boots, terminal agent failures) since the job last trained that stop
    #: it (node/churn.py)
    max_node_failures: int = 10
    join_timeout: float = 1800.0
    torch_version: str = ""
    rdzv_backend: str = "petctl-etcd"
    #: the petctl that wrote the spec (informational; the agent does not act on it)
    petctl_version: str = ""
    #: a random token per ``run-job``: the job's name is reused across runs (and with it its
    #: checkpoint dir), this is not. Empty in older specs: "unknown run".
    run_id: str = ""
    #: the job's requirements (a pip requirements file's text; empty: none), installed on every
    #: node into the job's environment after torch (node/jobenv.py)
    requirements: str = ""
    #: where that file lies inside a ``dir`` project (pip then reads it there); empty: outside
    requirements_path: str = ""
    #: a digest of the requirements and, when they name the project's files, of the project
    requirements_sha256: str = ""
    #: live membership (``run-job --live``, node/live.py): each node's workers are torchft replica
    #: groups that never restart on a join, a drain or a loss; the rendezvous instance runs the
    #: job's lighthouse on ``lighthouse_port`` beside etcd
    live: bool = False
    lighthouse_port: int = LIGHTHOUSE_PORT

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
            kw["max_node_failures"] = int(kw.get("max_node_failures", 10))
            kw["join_timeout"] = float(kw.get("join_timeout", 1800))
            kw["lighthouse_port"] = int(kw.get("lighthouse_port", LIGHTHOUSE_PORT))
        except (TypeError, ValueError) as e:
            raise SpecError(f"job spec has a non-numeric count or timeout: {e}") from e
        if not isinstance(kw.get("live", False), bool):
            raise SpecError(f"live must be true or false, got {kw['live']!r}")
        if not 1 <= kw["lighthouse_port"] <= 65535:
            raise SpecError(f"lighthouse_port must be a TCP port, got {kw['lighthouse_port']}")
        if kw["max_restarts"] < 0:
            raise SpecError(f"max_restarts must be >= 0, got {kw['max_restarts']}")
        if kw["max_node_failures"] < 1:
            raise SpecError(f"max_node_failures must be >= 1, got {kw['max_node_failures']}")
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
        kw["petctl_version"] = str(kw.get("petctl_version", ""))
        for key in ("requirements", "requirements_path", "requirements_sha256"):
            if not isinstance(kw.get(key, ""), str):
                raise SpecError(f"{key} must be a string, got {kw[key]!r}")
        rp = kw.get("requirements_path", "")
        if rp and (rp.startswith("/") or ".." in rp.split("/")):
            raise SpecError(f"requirements_path must be a path inside the project, got {rp!r}")
        run_id = kw.get("run_id", "")
        if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
            raise SpecError(f"run_id must be 1-64 letters, digits, '-' or '_' (or empty), got {run_id!r}")
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

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        """Parse and validate ``job.json`` text."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SpecError(f"job spec is not JSON: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The ``job.json`` object: ``from_dict(to_dict())`` gives back an equal spec."""
        d = asdict(self)
        d["args"] = list(self.args)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def resolved_nproc(self) -> int:
        """``nproc_per_node`` with ``auto`` resolved: number of GPUs, or 1 on CPU."""
        if self.nproc_per_node != "auto":
            return int(self.nproc_per_node)
        try:
            import torch

            return max(torch.cuda.device_count(), 1)
        except Exception:  # noqa: BLE001 - no CUDA, no GPUs
            return 1


def rdzv_backend(spec_backend: str = "", override: str = "") -> str:
    """The rendezvous backend to use: ``override`` (the agent's ``$PETCTL_AGENT_RDZV_BACKEND``),
    else the spec's ``rdzv_backend``, else petctl-etcd. Raises ValueError for an unknown name."""
    name = override or spec_backend or RDZV_BACKENDS[0]
    if name not in RDZV_BACKENDS:
        raise ValueError(f"rendezvous backend {name!r} is not one of {', '.join(RDZV_BACKENDS)}")
    return name
