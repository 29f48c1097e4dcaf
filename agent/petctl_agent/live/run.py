"""The training loop's face: wrap the model and the optimizer, and call one method per step.

    from petctl_agent.live.run import start

    run = start(model, optimizer)               # joins the job's quorum (a live peer's state)
    while run.step < steps:
        run.optimizer.zero_grad()               # starts this step's quorum
        loss_fn(run.model(x), y).backward()     # gradients averaged across replica groups
        run.optimizer.step()                    # applied only if every replica group agrees
        if not run.step_done():                 # the node drains: it leaves here, at a boundary
            break

Each node is one replica group (its own torchrun, its own store). Survivors keep their processes
across every change: torchft rebuilds only the cross-node process group each quorum, a newcomer
pulls the weights and optimizer state from a live peer, and a step that failed is discarded.
Data-parallel only: sharded state inside a group keeps petctl's restart path.

Configuration is the agent's output to its workers (environment):

- ``PETCTL_LIVE_LIGHTHOUSE``: the lighthouse (``http://host:port``), required;
- ``PETCTL_LIVE_REPLICA_ID``: this node's replica group name (default: hostname and pid);
- ``PETCTL_LOCAL_ADDR``: the node's address, the only one anything here listens on
  (default 127.0.0.1);
- ``PETCTL_LIVE_TIMEOUT``: seconds a collective may take (default 10). A hung (stopped, not
  dead) peer is dropped within this plus the lighthouse's heartbeat timeout plus one step;
- ``PETCTL_LIVE_MIN_REPLICAS``: replica groups a step needs to commit (default 1);
- ``PETCTL_LIVE_BACKEND``: the cross-replica collectives, ``nccl`` or ``gloo``; default: NCCL
  when the model's parameters are on a GPU, else gloo (NCCL allows one rank per GPU, so two
  replica groups sharing one GPU, as on a one-GPU test machine, need ``gloo``);
- ``PETCTL_CHECKPOINT_DIR`` and ``PETCTL_LIVE_CHECKPOINT_SECONDS`` (300; 0: never): where and how
  often the quorum's first group writes the state for a loss of every group at once
  (:mod:`.durable`); a worker that starts loads it before its first quorum;
- ``PETCTL_DRAIN_FILE``: when it exists, the group leaves at the next step boundary (SIGTERM does
  the same);
- ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun's): with several workers on a node, each is its
  own replica group, ``<replica id>-<local rank>``.

Why each worker is its own replica group, not each node: torchft's cross-replica process group
pairs only the same group rank of every group (``manager.py``: the store prefix
``/torchft/<quorum>/<group rank>``), so plain DDP inside a multi-rank group would leave a node's
ranks unsynchronised; groups that span ranks are for HSDP-style sharding, which keeps the restart
path. Each worker hosts its own group's store, on the node's address.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from petctl_agent import knobs
from petctl_agent.live import upstream
from petctl_agent.live.durable import Durable
from petctl_agent.live.lighthouse import is_wildcard
from petctl_agent.workarounds import switched_off


@dataclass(frozen=True)
class LiveConfig:
    lighthouse: str
    replica_id: str
    host: str
    timeout_s: float
    drain_file: str | None
    min_replicas: int = 1
    backend: str = ""  # "" : by the model's device (pick_backend)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LiveConfig:
        env = os.environ if env is None else env
        lighthouse = env.get("PETCTL_LIVE_LIGHTHOUSE")
        if not lighthouse:
            raise RuntimeError(
                "PETCTL_LIVE_LIGHTHOUSE is not set: live mode needs the job's lighthouse "
                "(http://host:port of `python -m petctl_agent.live.lighthouse`)"
            )
        host = knobs.local_addr(env) or "127.0.0.1"
        if is_wildcard(host):
            raise RuntimeError(f"PETCTL_LOCAL_ADDR={host!r}: give the node's own address, not a wildcard")
        replica_id = env.get("PETCTL_LIVE_REPLICA_ID") or f"{socket.gethostname()}-{os.getpid()}"
        if int(env.get("LOCAL_WORLD_SIZE") or 1) > 1:
            replica_id = f"{replica_id}-{env.get('LOCAL_RANK') or 0}"
        return cls(
            lighthouse=lighthouse,
            replica_id=replica_id,
            host=host,
            timeout_s=float(env.get("PETCTL_LIVE_TIMEOUT") or 10),
            drain_file=knobs.drain_file(env),
            min_replicas=int(env.get("PETCTL_LIVE_MIN_REPLICAS") or 1),
            backend=_backend_name(env.get("PETCTL_LIVE_BACKEND") or ""),
        )


def _backend_name(name: str) -> str:
    if name not in ("", "gloo", "nccl"):
        raise RuntimeError(f"PETCTL_LIVE_BACKEND={name!r}: use nccl or gloo (or leave it unset)")
    return name


def pick_backend(cfg: LiveConfig, model: torch.nn.Module) -> str:
    """``cfg.backend``, else NCCL for a model on a GPU and gloo for one on the CPU."""
    if cfg.backend:
        return cfg.backend
    p = next(model.parameters(), None)
    return "nccl" if p is not None and p.is_cuda else "gloo"


class LiveRun:
    """One worker's membership in the live job: its wrapped model and optimizer, and its manager.

    Build it with :func:`start`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: LiveConfig):
        from torchft.manager import Manager
        from torchft.optim import OptimizerWrapper

        self.cfg = cfg
        self._leave_signalled = False
        self._left = False
        self._world, self._world_since = -1, 0  # the quorum's size as last reported, and since when
        # The worker hosts its replica group's store (the group is this one worker). TCPStore has
        # no bind-address option and listens on the wildcard address; a socket bound here keeps
        # it on the node's address (as petctl_agent.distributed does).
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.bind((cfg.host, 0))
        sock.listen(64)
        store_port = sock.getsockname()[1]
        self._own_store = TCPStore(
            cfg.host, store_port, 1, True, wait_for_workers=False, master_listen_fd=sock.detach()
        )
        timeout = timedelta(seconds=cfg.timeout_s)
        names = ("LIVE_COMM_HOOK", "LIVE_BIND", "LIVE_QUORUM_RETRIES", "LIVE_LEAVE", "LIVE_QUORUM_IDS")
        on = {n: not switched_off(n, os.environ) for n in names}  # off only to show the gap
        self._workarounds = on
        transfer_timeout = timedelta(seconds=120)  # a newcomer's pull of the whole state
        self.backend = pick_backend(cfg, model)
        if on["LIVE_BIND"]:
            self._pg = upstream.BoundProcessGroupGloo(cfg.host, timeout)
            self._transport = upstream.BoundHTTPTransport(cfg.host, transfer_timeout)
            binding = upstream.bound_manager_server(cfg.host)
        else:
            from torchft.checkpointing import HTTPTransport
            from torchft.process_group import ProcessGroupGloo

            self._pg = ProcessGroupGloo(timeout=timeout)
            self._transport = HTTPTransport(timeout=transfer_timeout, num_chunks=0)
            binding = contextlib.nullcontext()
        if self.backend == "nccl":
            # torchft's reconfigurable NCCL group (aborts a timed-out collective with NCCL >= 2.25);
            # its bootstrap uses the store on the node's address, the data path NCCL's interfaces
            from torchft.process_group import ProcessGroupNCCL

            self._pg = ProcessGroupNCCL(timeout=timeout)
        with binding:
            self.manager = Manager(
                pg=self._pg,
                load_state_dict=self._load,
                state_dict=self._state,
                min_replica_size=cfg.min_replicas,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=30),
                connect_timeout=timedelta(seconds=10),
                rank=0,
                world_size=1,
                store_addr=cfg.host,
                store_port=store_port,
                lighthouse_addr=cfg.lighthouse,
                replica_id=cfg.replica_id,
                hostname=cfg.host,
                checkpoint_transport=self._transport,
                quorum_retries=upstream.QUORUM_RETRIES if on["LIVE_QUORUM_RETRIES"] else 0,
            )
        if on["LIVE_QUORUM_IDS"]:
            self.manager._client = upstream.QuorumIds(self.manager._client)
        self._model = model
        self._optim = optimizer
        if on["LIVE_COMM_HOOK"]:
            self.model = upstream.DistributedDataParallel(self.manager, model)
        else:
            from torchft.ddp import DistributedDataParallel

            self.model = DistributedDataParallel(self.manager, model)
        self.optimizer = OptimizerWrapper(self.manager, optimizer)
        # the state on the shared filesystem, for a loss of every group at once (durable.py)
        self._durable = Durable.from_env(os.environ)
        #: the step the shared filesystem's copy gave back (None: none); the first quorum heals it
        #: from live peers if they hold a newer one
        self.loaded_step = self._durable.load(model, optimizer, self.manager)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _state(self) -> dict:
        return {"model": self._model.state_dict(), "optim": self._optim.state_dict()}

    def _load(self, sd: dict) -> None:
        self._model.load_state_dict(sd["model"])
        self._optim.load_state_dict(sd["optim"])

    def _on_sigterm(self, *_):
        self._leave_signalled = True

    @property
    def step(self) -> int:
        """Steps committed by the job so far (a newcomer takes its peers' count)."""
        return self.manager.current_step()

    @property
    def replicas(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def _drain_requested(self) -> bool:
        f = self.cfg.drain_file
        return self._leave_signalled or bool(f and os.path.exists(f))

    def step_done(self) -> bool:
        """Call once per step after ``optimizer.step()``; False: this worker has left the job.

        A drain (``PETCTL_DRAIN_FILE`` exists, or SIGTERM) is acted on here, at a step boundary:
        the step just taken is committed on every replica group, and the survivors' next quorum
        no longer waits for this one (:meth:`leave`).
        """
        if self._left:
            return False
        self._report_progress()
        if self._durable.due():
            if self.manager.participating_rank() == 0:  # one copy: the quorum's first group writes it
                self._durable.save(self._model, self._optim, self.manager)
            else:
                self._durable.skip()
        if self._drain_requested():
            self.leave()
            return False
        return True

    def _report_progress(self) -> None:
        """The step and the quorum's size in ``$PETCTL_PROGRESS_FILE`` (local rank 0; atomic): the
        node's status (last step, world size) and the job's training progress."""
        f = knobs.progress_file()
        if not f or os.environ.get("LOCAL_RANK", "0") != "0":
            return
        step, world = int(self.step), int(self.replicas)
        if world != self._world:  # the step this quorum size first committed: the same on every member
            self._world, self._world_since = world, step
        body = json.dumps({"step": step, "world_size": world, "since": self._world_since, "t": time.time()})
        tmp = f"{f}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as out:
                out.write(body)
            os.replace(tmp, f)
        except OSError:
            pass  # progress is advisory

    def leave(self) -> None:
        """Leave the job now, between steps: stop heartbeating before anything slower.

        torchft 0.2.0 has no leave call: the lighthouse drops a replica only when its heartbeat
        ages out (``src/lighthouse.rs``, ``quorum_compute``), and until then the survivors' quorum
        waits for it as a straggler (the join timeout, 60 s by default). Heartbeats come from the
        manager's server thread, which lives as long as the process unless shut down, and a
        draining worker may live on (its last checkpoint, the agent's lifecycle action, a slow
        gloo teardown at exit). Shutting the manager down first makes the survivors' wait the
        heartbeat timeout from this moment.
        """
        if self._left:
            return
        self._left = True
        if self._workarounds["LIVE_LEAVE"]:
            self.manager.shutdown(wait=False)

    def close(self) -> None:
        self.leave()


def start(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, env: Mapping[str, str] | None = None
) -> LiveRun:
    """Join the live job with this model and optimizer (see the module's docstring)."""
    return LiveRun(model, optimizer, LiveConfig.from_env(env))
