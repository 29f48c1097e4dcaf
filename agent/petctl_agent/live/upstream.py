"""The torchft 0.2.0 gaps petctl closes, each beside the upstream line it works around.

1. **A peer that dies inside the gradient all-reduce crashes every survivor.**
   ``torchft/ddp.py``, ``DistributedDataParallel._comm_hook``: ``assert fut._fut``. After a
   failed all-reduce the manager hands back a ``_DummyWork`` (whose future has no ``_fut``) or a
   ``_ManagedWork`` whose callback chain was never built, so the assert (or an AttributeError)
   raises inside backward. :func:`comm_hook` waits on the work (which records the error in the
   manager instead of raising) and hands back the bucket itself: its values are garbage, but
   ``should_commit`` then says no and the step is discarded on every replica.
2. **The manager binds ``[::]``.** ``torchft/manager.py``: ``bind = f"[::]:{port}"``; the
   checkpoint server (``checkpointing/http_transport.py``: ``server_address = ("", 0)`` on an
   IPv6 socket) and gloo (``process_group.py``: ``BaseProcessGroupGloo(store, rank, world_size,
   self._timeout)``, its device from the hostname) listen on every interface too.
   :func:`bound_manager_server`, :class:`BoundHTTPTransport` and :class:`BoundProcessGroupGloo`
   put all three on the node's address.
3. **Quorum retries default to 0** (``Manager(quorum_retries=0)``; ``src/manager.rs``
   ``_quorum_with_retries`` gives up after that many), so a lighthouse that restarts fails the
   quorum and the training loop with it. :data:`QUORUM_RETRIES` keeps asking for about a minute.

4. **A restarted lighthouse numbers its quorums from 1 again**, and the manager rebuilds its
   process group only when the id changes (``manager.py``: ``if quorum_id != self._quorum_id``).
   A survivor whose new quorum had an old id kept its old group (a collective waited out the
   10 s timeout) or met its peers under a store prefix the old group's keys still filled (the
   mesh connected to dead addresses, and a survivor's worker exited on a quorum timeout).
   :class:`QuorumIds` gives the manager ids that are unique across restarts.

A planned leave (the fifth gap: there is no leave call) lives in :mod:`petctl_agent.live.run`.
"""

import contextlib
import socket
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torchft.checkpointing.http_transport as _http_transport
import torchft.manager as _tf_manager
from torch.distributed import ProcessGroup as BaseProcessGroup
from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo
from torchft.checkpointing import HTTPTransport
from torchft.ddp import DistributedDataParallel as _TorchftDDP
from torchft.http import _IPv6HTTPServer
from torchft.process_group import ProcessGroupGloo

#: Quorum retries after a failed lighthouse call. Each failure sleeps ``quorum_timeout /
#: (retries + 1)`` (at least 100 ms) before the next try (``src/manager.rs``), so with the 30 s
#: quorum timeout of :mod:`~petctl_agent.live.run` a retry comes every ~0.5 s for ~30 s or more:
#: long enough for the rendezvous instance to restart its lighthouse.
QUORUM_RETRIES = 60


def comm_hook(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that survives a failed all-reduce (gap 1; see the module's docstring)."""
    work = manager.allreduce(bucket.buffer())
    # _ManagedWork.wait() and _DummyWork.wait() never raise: an error is recorded in the manager
    # (report_error), which makes should_commit() refuse the step on every replica.
    work.wait()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class DistributedDataParallel(_TorchftDDP):
    """torchft's DDP with :func:`comm_hook` in place of ``ddp.py``'s asserting hook."""

    @staticmethod
    # no "from __future__ import annotations" in this module: DDP checks this annotation
    def _comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return comm_hook(state, bucket)


class _Quorum:
    """A torchft ``QuorumResult`` with :class:`QuorumIds`'s id in place of the lighthouse's."""

    def __init__(self, raw, quorum_id: int) -> None:
        self._raw = raw
        self.quorum_id = quorum_id

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class QuorumIds:
    """The manager's client, with quorum ids that stay unique across lighthouse restarts (gap 4).

    The manager (re)builds its group when the id changes and meets its peers under the store
    prefix ``/torchft/<id>/<group rank>``. A restarted lighthouse counts from 1 again, so its
    ids name old groups: a member kept a group of other members (a collective then waited out
    its timeout), or met its peers under a prefix whose keys the old group left in the store
    (the mesh connected to dead addresses). Here a member keeps its id while the quorum is the
    same (the lighthouse id and the members) and it is not behind; otherwise every member of the
    quorum takes ``lighthouse id << 32 | crc32(members, max step)``, the same on each. Within one
    lighthouse an unchanged quorum commits every step on every member, so a member that must
    heal under an unchanged quorum missed steps its peers took after a restart: it rebuilds too.
    The lighthouse id stays readable as ``id >> 32``. Left: after a restart in which no step was
    committed, a member that rebuilt meets one that did not; that step fails, and the next quorum
    (a new lighthouse id after a failed commit) rebuilds every member.
    """

    def __init__(self, client) -> None:
        self._client = client
        self._same: tuple | None = None
        self._id = -1

    def _quorum(self, *args, **kwargs):
        q = self._client._quorum(*args, **kwargs)
        same = (q.quorum_id, tuple(sorted(q.replica_ids)))
        if same != self._same or q.heal:
            crc = zlib.crc32(("\n".join(same[1]) + f"\n{q.max_step}").encode())
            self._same, self._id = same, (q.quorum_id << 32) | crc
        return _Quorum(q, self._id)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@contextlib.contextmanager
def bound_manager_server(host: str):
    """While open, ``torchft.manager.Manager`` builds its ManagerServer on ``host`` (gap 2)."""
    real = _tf_manager.ManagerServer

    def on_host(**kw):
        port = kw["bind"].rpartition(":")[2]
        kw["bind"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return real(**kw)

    _tf_manager.ManagerServer = on_host
    try:
        yield
    finally:
        _tf_manager.ManagerServer = real


class BoundHTTPTransport(HTTPTransport):
    """torchft's checkpoint server (a newcomer pulls the state from it) on ``host`` only."""

    def __init__(self, host: str, timeout: timedelta, num_chunks: int = 0) -> None:
        self._host = host
        family = _family(host)

        class OnHost(_IPv6HTTPServer):
            address_family = family

            def __init__(self, _addr, handler):
                super().__init__((host, 0), handler)

        real = _http_transport._IPv6HTTPServer
        _http_transport._IPv6HTTPServer = OnHost
        try:
            super().__init__(timeout=timeout, num_chunks=num_chunks)
        finally:
            _http_transport._IPv6HTTPServer = real

    def address(self) -> str:
        # upstream names socket.gethostname(), which need not resolve to this address
        port = self._server.socket.getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/checkpoint/"


class BoundProcessGroupGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group with its device on ``host`` (gap 2)."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._host = host

    def _create_pg(self, store, rank: int, world_size: int) -> BaseProcessGroup:
        # As upstream's _create_pg, but with options naming the device instead of the timeout
        # alone (which makes gloo pick its interface from the hostname).
        opts = BaseProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [BaseProcessGroupGloo.create_device(hostname=self._host)]
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
        backend = BaseProcessGroupGloo(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.GLOO, backend)
        return pg
