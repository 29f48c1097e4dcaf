"""Every torch internal the agent relies on, in one list, checked before the agent joins anything.

torch's elastic internals (``_state_holder``, ``_op_executor``, ``_invoke_run``, …)
are private and change between releases. An agent started on a torch that lacks
one of them must fail at once, in one line naming the torch version and the
missing member -- not in the middle of a rendezvous, holding the others up.

Add an entry here whenever agent code starts using another private torch member
(``cd agent/petctl_agent; grep -n '\\._[a-z]' elastic/*.py distributed.py``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

_AGENT_API = "torch.distributed.elastic.agent.server.api"
_LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_ETCD_BACKEND = "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend"
_ETCD_STORE = "torch.distributed.elastic.rendezvous.etcd_store"
_MP_API = "torch.distributed.elastic.multiprocessing.api"


@dataclass(frozen=True)
class Member:
    """``module:Obj.attr`` that must exist.

    ``kind``: ``attr`` = a class/module attribute (``getattr``); ``self`` = an
    instance attribute assigned in ``Obj.__init__`` (found in its source as ``self.<attr>``);
    ``field`` = an attribute of a default-constructed ``Obj()``.
    """

    module: str
    obj: str
    attr: str = ""
    kind: str = "attr"

    @property
    def name(self) -> str:
        return f"{self.module}.{self.obj}" + (f".{self.attr}" if self.attr else "")


def _m(module: str, obj: str, attrs: str = "", kind: str = "attr") -> list[Member]:
    return [Member(module, obj, a, kind) for a in attrs.split()] or [Member(module, obj)]


#: what elastic/ (the agent and its mixins, handlers.py, membership.py), rendezvous/ and
#: distributed.py (under agent/petctl_agent/) use beyond torch's public API, whatever the
#: rendezvous backend
REQUIRED_BASE: tuple[Member, ...] = tuple(
    _m(_AGENT_API, "SimpleElasticAgent",
       "_invoke_run _rendezvous _initialize_workers _restart_workers _monitor_workers "
       "_exit_barrier _stop_workers _start_workers _shutdown")
    + _m(_AGENT_API, "SimpleElasticAgent", "_remaining_restarts _worker_group", kind="self")
    + _m(_AGENT_API, "WorkerSpec") + _m(_AGENT_API, "WorkerGroup") + _m(_AGENT_API, "RunResult")
    + _m(_AGENT_API, "WorkerState", "HEALTHY UNHEALTHY FAILED SUCCEEDED")
    + _m(_LOCAL_AGENT, "LocalElasticAgent", "_start_workers _stop_workers _monitor_workers _shutdown")
    + _m(_LOCAL_AGENT, "LocalElasticAgent", "_start_method _pcontext", kind="self")
    + _m(_ETCD_STORE, "EtcdStore")
    + _m(_MP_API, "_terminate_process_handler")
    + _m("torch.distributed.elastic.multiprocessing", "DefaultLogsSpecs")
    + _m("torch.distributed.elastic.multiprocessing", "Std")
    + _m("torch.distributed", "ProcessGroupGloo", "create_device")
    + _m("torch.distributed", "ProcessGroupGloo._Options", "_devices", kind="field")
)  # fmt: skip

#: what the agent additionally uses with torch's ``etcd-v2`` handler (the fallback backend):
#: drop these when the fallback goes
REQUIRED_ETCD_V2: tuple[Member, ...] = tuple(
    _m(_DYNAMIC, "DynamicRendezvousHandler", "_stop_heartbeats num_nodes_waiting next_rendezvous shutdown")
    + _m(_DYNAMIC, "DynamicRendezvousHandler", "_state_holder _op_executor _heartbeat_lock _this_node",
         kind="self")
    + _m(_DYNAMIC, "_BackendRendezvousStateHolder", "state")
    + _m(_DYNAMIC, "_BackendRendezvousStateHolder", "_backend _token _dirty _state", kind="self")
    + _m(_DYNAMIC, "_RendezvousState", "round complete participants wait_list", kind="field")
    + _m(_DYNAMIC, "_DistributedRendezvousOpExecutor", "run")
    + _m(_DYNAMIC, "_RendezvousExitOp") + _m(_DYNAMIC, "_RendezvousJoinOp")
    + _m(_DYNAMIC, "_Action", "FINISH REMOVE_FROM_PARTICIPANTS REMOVE_FROM_WAIT_LIST")
    + _m(_DYNAMIC, "create_handler")
    + _m(_ETCD_BACKEND, "EtcdRendezvousBackend") + _m(_ETCD_BACKEND, "_create_etcd_client")
)  # fmt: skip

#: everything, for every backend (what the internals test resolves)
REQUIRED: tuple[Member, ...] = REQUIRED_BASE + REQUIRED_ETCD_V2


def required_for(backend: str) -> tuple[Member, ...]:
    """The members the agent uses with rendezvous ``backend`` (petctl-etcd, etcd-v2, etcd)."""
    return REQUIRED if backend == "etcd-v2" else REQUIRED_BASE


def _resolve(path: str, obj: str) -> object:
    target: object = importlib.import_module(path)
    for part in obj.split("."):
        target = getattr(target, part)
    return target


def _has(m: Member) -> bool:
    try:
        target = _resolve(m.module, m.obj)
        if not m.attr:
            return True
        if m.kind == "attr":
            return hasattr(target, m.attr)
        if m.kind == "field":
            return hasattr(target(), m.attr)  # type: ignore[operator]
        # "self": assigned in __init__ of the class or one of its torch bases
        pattern = re.compile(rf"self\.{re.escape(m.attr)}\b\s*(:[^=\n]*)?=[^=]")
        for cls in getattr(target, "__mro__", ()):
            init = cls.__dict__.get("__init__")
            if init is None or not cls.__module__.startswith("torch"):
                continue
            try:
                source = inspect.getsource(init)
            except (OSError, TypeError):
                return True  # no source shipped: cannot tell, do not block the job on it
            if pattern.search(source):
                return True
        return False
    except Exception:  # noqa: BLE001 - import errors, renamed classes: all mean "missing"
        return False


def missing_members(required: tuple[Member, ...] = REQUIRED) -> list[str]:
    """Names of the required torch internals the installed torch lacks (empty = all there)."""
    return [m.name for m in required if not _has(m)]


def torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def version_mismatch(wanted: str, installed: str) -> bool:
    """Does ``installed`` differ from the spec's ``wanted``? A ``wanted`` without a local part
    (``2.13.0``) matches every build of that release (``2.13.0+cpu``, ``2.13.0+cu128``)."""
    if not wanted:
        return False
    if "+" in wanted:
        return wanted != installed
    return wanted != installed.split("+", 1)[0]


def check(wanted_version: str = "", required: tuple[Member, ...] = REQUIRED) -> str | None:
    """One-line reason this torch cannot run the agent, or None when it can."""
    installed = torch_version()
    if version_mismatch(wanted_version, installed):
        return f"torch {installed} is installed but the job spec pins torch_version {wanted_version}"
    missing = missing_members(required)
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else ""
        return f"torch {installed} lacks {missing[0]}, which the petctl agent relies on{more}"
    return None
