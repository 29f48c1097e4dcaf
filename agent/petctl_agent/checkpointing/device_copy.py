"""A state's tensors copied into a snapshot slot's mapping (:meth:`.writing.Writing.write`).

CPU tensors are copied as they always were, one after another, before the write returns. CUDA
tensors are copied by the GPU's copy engines, asynchronously, straight into the slot:

- the slot's mapping (``MAP_SHARED`` of a ``/dev/shm`` file, kept between writes) is page-locked
  once, on its first copy from a device (``cudaHostRegister(addr, size, 0)``, through
  ``torch.cuda.cudart()``, with that device current), and unregistered when it is closed, after any
  copy into it has ended (:func:`release`, which :func:`.mapping.close_map` calls first): a
  registration left on a freed range would make the next registration there fail, and would keep
  the file's pages pinned;
- per device, a side stream of this module's waits for the current stream (so the copies follow
  the kernels that made the state); each tensor's bytes go ``dst.copy_(src, non_blocking=True)``
  into its place in the mapping, with no ``.contiguous()`` for a contiguous tensor (a
  non-contiguous one, rare in a state dict, goes through a temporary of its own size, made on the
  side stream); an event is recorded on the side stream after the last copy, and the current
  stream waits for it. So the training's next kernels on that stream -- its optimizer step's
  in-place updates among them -- run only once the copy has read the tensors: the GPU's next work
  waits for the copy, the host does not. Work that training puts on other streams of its own is
  not ordered after the copy;
- the copy returns once it is enqueued, with a ``ready`` callable that blocks until its events
  complete: the writer calls it before the CRCs and the header (:meth:`.writing.Writing._finish`).

When the registration fails (``RLIMIT_MEMLOCK``, a platform that cannot pin a shared file's pages)
the CUDA tensors are copied as the CPU ones are (synchronously, through pageable memory), this is
said once on stderr, and no registration is tried again in this process: never a failed snapshot.
The failed call's error is consumed (``cudaGetLastError``): torch's next kernel-launch check would
raise it as its own.

The CUDA calls go through a runtime object (:class:`CudaRuntime`; :func:`use_runtime` swaps it):
a test gives one whose streams, events and registrations only record what is asked of them, on
CPU tensors, and checks the order of those calls and the bytes. Torch is imported only to copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from petctl_agent.checkpointing import mapping


class CudaRuntime:
    """What the copy asks of CUDA, through torch. A test's runtime has the same methods."""

    def device_of(self, t: Any) -> Any | None:
        """The device a tensor's copy goes through the side stream of; None: copied as a CPU one."""
        return t.device if t.is_cuda else None

    def current_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.Stream(device)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """The copies made inside go on ``stream``."""
        import torch

        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        import torch

        return torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins on a core

    def register(self, addr: int, size: int, device: Any) -> int:
        import torch

        with torch.cuda.device(device):
            return int(torch.cuda.cudart().cudaHostRegister(addr, size, 0))

    def unregister(self, addr: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostUnregister(addr))

    def clear_error(self) -> None:
        """Consume this thread's last CUDA error (torch's cudart bindings have no
        ``cudaGetLastError``): through every libcudart this process has mapped (a wheel's is
        ``libcudart-<hash>.so.N``; opening a loaded library again gives the loaded one)."""
        paths: set[str] = set()
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)  # address perms offset dev inode path
                    path = parts[5].strip().removesuffix(" (deleted)") if len(parts) == 6 else ""
                    if "libcudart" in os.path.basename(path):
                        paths.add(path)
        except OSError:
            return
        for path in paths:
            try:
                ctypes.CDLL(path).cudaGetLastError()
            except (OSError, AttributeError):
                pass


class _Pinned:
    """A mapping registered with CUDA: by whom, and the events of the copies into it."""

    def __init__(self, mm: mmap.mmap, runtime: Any) -> None:
        self.ref = weakref.ref(mm)
        self.runtime = runtime
        self.pending: list[Any] = []  # events of copies into it that may still run
        self.finalizer: weakref.finalize | None = None


_runtime: Any = None
_lock = threading.Lock()
#: address -> the registration of the mapping there. A forked child (a DataLoader worker) has a
#: copy, and none of the mappings (``MADV_DONTFORK``) nor a usable CUDA: it never touches them
#: (nor the lock, which a thread of the parent may have held at the fork), as its pid is not ``_pid``
_pinned: dict[int, _Pinned] = {}
#: the process that made the registrations
_pid = os.getpid()
#: device -> this module's side stream on it
_sides: dict[Any, Any] = {}
#: a registration failed in this process: none is tried again
_refused = False


def use_runtime(runtime: Any | None) -> Any:
    """Copy through ``runtime`` from now on (None: CUDA's, through torch); the previous one.
    Forgets the side streams and a refusal; the registrations made stay until their mappings close."""
    global _runtime, _refused
    previous, _runtime, _refused = _runtime, runtime, False
    _sides.clear()
    return previous


def _rt() -> Any:
    global _runtime
    if _runtime is None:
        _runtime = CudaRuntime()
    return _runtime


def registered(mm: mmap.mmap) -> bool:
    """Is ``mm`` page-locked (registered with CUDA) by this module?"""
    reg = _pinned.get(mapping.address(mm) or 0)
    return reg is not None and reg.ref() is mm


def copy_into(
    mm: mmap.mmap | None, tensors: list[Any], metas: list[dict[str, Any]]
) -> Callable[[], None] | None:
    """Copy each tensor's bytes into ``mm`` at its meta's ``offset`` (``nbytes`` of them): the CUDA
    ones enqueued (the module's docstring), the rest copied now. Returns ``ready`` (blocks until the
    enqueued copies have ended; raises what the device failed with) or None when nothing is in flight."""
    rt = _rt()
    host: list[int] = []
    devices: dict[Any, list[int]] = {}
    for i, (t, m) in enumerate(zip(tensors, metas)):
        if m["nbytes"]:
            dev = rt.device_of(t)
            (host if dev is None else devices.setdefault(dev, [])).append(i)
    events = []
    for dev, idx in devices.items():  # enqueued first: the copy engines run while the CPU copies
        reg = _pin(rt, mm, dev) if mm is not None else None
        if reg is not None:
            events.append(_enqueue(rt, mm, reg, dev, [(tensors[i], metas[i]) for i in idx]))
        else:
            host += idx
    _copy_now(mm, [(tensors[i], metas[i]) for i in sorted(host)])
    if not events:
        return None

    def ready() -> None:
        for e in events:
            e.synchronize()

    return ready


def _copy_now(mm: mmap.mmap | None, pairs: list[tuple[Any, dict[str, Any]]]) -> None:
    """The synchronous copy: a CPU tensor's, or a device's through pageable memory."""
    import torch

    for t, m in pairs:
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=m["nbytes"], offset=m["offset"])
        dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        del dst  # the mmap cannot close while a tensor exports it


def _enqueue(rt: Any, mm: mmap.mmap, reg: _Pinned, dev: Any, pairs: list[tuple[Any, dict[str, Any]]]) -> Any:
    """The copies of one device's tensors on its side stream (into ``mm``, registered as ``reg``);
    the event recorded after them."""
    import torch

    side = _sides.get(dev)
    if side is None:
        side = _sides[dev] = rt.new_stream(dev)
    current = rt.current_stream(dev)
    side.wait_stream(current)  # after the kernels that made the state
    event = rt.new_event()
    try:
        with rt.on_stream(side):
            for t, m in pairs:
                src = t.detach()
                if not src.is_contiguous():
                    src = src.contiguous()  # a temporary of the tensor's size, on the side stream
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=m["nbytes"], offset=m["offset"])
                dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
                del dst, src
    finally:  # also after a copy that failed to enqueue: the mapping closes only after the others
        event.record(side)
        current.wait_event(event)  # the next update of a tensor waits until the copy has read it
        reg.pending = [e for e in reg.pending if not e.query()] + [event]
    return event


def _pin(rt: Any, mm: mmap.mmap, dev: Any) -> _Pinned | None:
    """``mm``'s registration (once per mapping: made now, if not yet); None: copy through
    pageable memory."""
    global _refused, _pid
    addr = mapping.address(mm)
    if addr is None:
        return None
    with _lock:
        reg = _pinned.get(addr)
    if reg is not None and reg.ref() is mm:
        return reg
    if _refused:
        return None
    if reg is not None:  # a mapping gone from there without close_map (its finalizer is due)
        _gone(addr, reg)
    err = rt.register(addr, -(-len(mm) // mmap.PAGESIZE) * mmap.PAGESIZE, dev)  # its whole pages
    if err:
        rt.clear_error()  # else torch's next kernel-launch check raises it as its own
        _refused = True
        print(
            f"petctl snapshot: cudaHostRegister of the snapshot slot failed (CUDA error {err}): "
            "copying from the GPU through pageable memory, synchronously, from now on",
            file=sys.stderr,
        )
        return None
    reg = _Pinned(mm, rt)
    # a mapping dropped without close_map (never the store's own): unregistered once it is gone
    reg.finalizer = weakref.finalize(mm, _gone, addr, reg)
    reg.finalizer.atexit = False  # at exit the driver drops the process's registrations itself
    with _lock:
        _pid = os.getpid()
        _pinned[addr] = reg
    return reg


def release(mm: mmap.mmap) -> None:
    """Before ``mm`` is closed (:func:`.mapping.close_map`): wait for the copies into it, then
    unregister it. Nothing for a mapping never registered; in a forked child, nothing at all
    (the registrations are the parent's, and CUDA is not the child's to call)."""
    if not _pinned or os.getpid() != _pid:
        return
    addr = mapping.address(mm)
    with _lock:
        reg = _pinned.get(addr or 0)
        if reg is None or reg.ref() is not mm:
            return
    _gone(addr, reg)


def _gone(addr: int, reg: _Pinned) -> None:
    if os.getpid() != _pid:  # a forked child: the parent's registration (a finalizer run in it)
        return
    with _lock:
        if _pinned.get(addr) is not reg:
            return
        del _pinned[addr]
    if reg.finalizer is not None:
        reg.finalizer.detach()
    for e in reg.pending:
        try:
            e.synchronize()  # the DMA into the pages ends before they are unpinned
        except Exception:  # noqa: BLE001 - a failed device: its copy is not running either
            pass
    if reg.runtime.unregister(addr):
        reg.runtime.clear_error()


mapping.before_close.append(release)
