"""What a training script hands to ``ckpt.step``/``ckpt.resume``, made safe to save and to restore.

Three things a plain state dict gets wrong without an error, and what this module does about them:

- **Live objects.** A top-level value that is a ``torch.nn.Module`` or a ``torch.optim.Optimizer``
  is saved as its state dict and restored *into the object*. For a model with sharded (DTensor)
  parameters, e.g. FSDP2, that goes through ``torch.distributed.checkpoint.state_dict``
  (``get_model_state_dict``/``get_optimizer_state_dict`` to save and to make the dict DCP fills,
  ``set_*`` to apply it): a fresh optimizer's ``state_dict()`` holds no moments, and DCP fills
  only the keys of the dict it is given, so the moments would come back as nothing.
  ``get_optimizer_state_dict`` initialises them first.
- **Per-rank values.** The replicated path saves rank 0's state and DCP saves a replicated value
  once, so a value that differs by rank (an RNG state, a data position) would come back as one
  rank's on every rank. Values under the top-level key :data:`PER_RANK` are gathered from every
  rank at the save, stored together (a few KiB each), and each rank gets its own back at the
  restore (``None`` for a rank that had no entry: a newcomer, or a rank past the saved world).
- **Per-rank values outside** :data:`PER_RANK`. Every save compares, across ranks, a digest of
  each value that a replica must hold identically: numbers other than floats, strings, and
  non-floating tensors of at most :data:`_CHECKED_BYTES` (an RNG state is a ``uint8`` tensor).
  A difference raises :class:`PerRankStateError` on every rank, naming the key. Floating values
  are not compared: replicas' floats may differ in the last bits, and DDP itself takes buffers
  (BatchNorm statistics) from rank 0.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from typing import Any

from petctl_agent.checkpointing.sharded import PER_RANK, is_sharded
from petctl_agent.distributed import dist_on, dist_rank

__all__ = ["PER_RANK", "PerRankStateError", "check_replicated", "for_load", "for_save", "own"]
#: non-floating tensors up to this size are compared across ranks at every save
_CHECKED_BYTES = 1 << 20


class PerRankStateError(ValueError):
    """A value that differs between ranks sits outside ``state["per_rank"]``: it would come back
    as one rank's on every rank."""


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    from petctl_agent.checkpointing.group import ckpt_group

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=ckpt_group())
    return out


def _cpu(obj: Any, *, clone: bool = False) -> Any:
    """``obj`` with every tensor on the CPU (an object collective pickles it); ``clone``: in a
    storage of its own."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return t.clone() if clone else t
    if isinstance(obj, dict):
        return {k: _cpu(v, clone=clone) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v, clone=clone) for v in obj)
    return obj


def _is_module(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def _is_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)


def _has_dtensor(model: Any) -> bool:
    return is_sharded(list(model.parameters()))


def _model_of(key: str, opt: Any, state: dict[str, Any]) -> Any:
    """The module in ``state`` whose parameters the optimizer ``state[key]`` updates."""
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for v in state.values():
        if _is_module(v) and any(id(p) in params for p in v.parameters()):
            return v
    raise ValueError(
        f"petctl checkpoint: state[{key!r}] is an optimizer but no model in the state owns its "
        "parameters: put the model beside it, e.g. {'model': model, 'optim': opt}"
    )


def _objects(state: dict[str, Any]) -> dict[str, tuple[Any, Any, bool]]:
    """``{key: (object, its model or None, sharded)}`` for the live objects at the top of ``state``."""
    out: dict[str, tuple[Any, Any, bool]] = {}
    for k, v in state.items():
        if _is_module(v):
            out[k] = (v, None, _has_dtensor(v))
        elif _is_optimizer(v):
            model = _model_of(k, v, state)
            out[k] = (v, model, _has_dtensor(model))
    return out


def _state_of(obj: Any, model: Any, sharded: bool) -> dict[str, Any]:
    if not sharded:
        return obj.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(obj) if model is None else get_optimizer_state_dict(model, obj)


def _leaves(obj: Any, path: str, out: list[tuple[str, bytes]]) -> None:
    """``(path, digest)`` of every value in ``obj`` that replicas must hold identically."""
    import torch

    if isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}[{i}]", out)
    elif isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex() or type(obj) is not torch.Tensor:
            return  # floats may differ in the last bits; a DTensor is sharded by design
        if obj.numel() * obj.element_size() > _CHECKED_BYTES:
            return
        t = obj.detach().cpu().contiguous()
        h = hashlib.blake2b(str((t.dtype, tuple(t.shape))).encode(), digest_size=16)
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out.append((path, h.digest()))
    elif obj is None or isinstance(obj, (bool, int, str, bytes)):
        out.append((path, hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()))


def check_replicated(state: dict[str, Any]) -> None:
    """Raise :class:`PerRankStateError` on every rank when a value outside :data:`PER_RANK` that
    replicas must share differs between ranks (collective; one small all-gather, two on a
    difference)."""
    if not dist_on():
        return
    leaves: list[tuple[str, bytes]] = []
    for k, v in state.items():
        if k != PER_RANK:
            _leaves(v, f"state[{k!r}]", leaves)
    whole = hashlib.blake2b(b"".join(p.encode() + d for p, d in leaves), digest_size=16).digest()
    if len(set(_gather(whole))) == 1:
        return
    every = _gather(leaves)
    for i, (p, d) in enumerate(every[0]):
        for r, theirs in enumerate(every[1:], 1):
            if i >= len(theirs) or theirs[i] != (p, d):
                raise PerRankStateError(
                    f"petctl checkpoint: {p} differs between ranks 0 and {r}, and would come back as "
                    f"rank 0's on every rank: put per-rank values under state[{PER_RANK!r}] "
                    "(docs/agent.md, 'What comes back per rank')"
                )
    raise PerRankStateError(
        "petctl checkpoint: the state's keys differ between ranks: every rank must save the same keys "
        f"(per-rank values go under state[{PER_RANK!r}])"
    )


def for_save(state: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The dict to write for ``state``, and whether it is sharded (collective under a process
    group): live objects as their state dicts, every rank's :data:`PER_RANK` value gathered into one
    entry, and the replicated values checked (:func:`check_replicated`)."""
    objs = _objects(state)
    out = {k: (_state_of(*objs[k]) if k in objs else v) for k, v in state.items()}
    sharded = is_sharded(out)
    check_replicated(out)
    if PER_RANK in out:
        mine = _cpu(out[PER_RANK])
        every = _gather(mine) if dist_on() else [mine]
        gathered = {str(r): v for r, v in enumerate(every)}
        if sharded:
            # one opaque value: DCP writes a replicated value once, and would flatten a dict into
            # keys that a different world size's state to fill could not name
            import torch

            buf = io.BytesIO()
            torch.save(gathered, buf)
            out[PER_RANK] = buf.getvalue()
        else:
            out[PER_RANK] = gathered
    return out, sharded


def for_load(into: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Callable[[Any], Any]]:
    """The dict to load into for ``into`` (live objects as the dicts they fill; a slot for the
    gathered per-rank entry) and the function that finishes a load's result: it applies the loaded
    state dicts to the objects and gives this rank its own :data:`PER_RANK` value."""
    if into is None:
        return None, own
    objs = _objects(into)
    fill = {k: (_state_of(*objs[k]) if k in objs else v) for k, v in into.items() if k != PER_RANK}

    def finish(out: Any) -> Any:
        out = own(out)
        if out is None:
            return None
        state = out[0]
        for k, (obj, model, sharded) in objs.items():
            if k not in state:
                continue
            if not sharded:
                obj.load_state_dict(state[k])
                continue
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

            if model is None:
                set_model_state_dict(obj, state[k])
            else:
                set_optimizer_state_dict(model, obj, state[k])
        return out

    return fill, finish


def own(out: Any) -> Any:
    """A load's ``(state, step)`` with ``state[PER_RANK]`` replaced by this rank's own entry."""
    if out is None:
        return None
    state, step = out
    if isinstance(state, dict) and PER_RANK in state:
        every = state[PER_RANK]
        if isinstance(every, bytes):  # the sharded path's one opaque value (for_save)
            import torch

            from petctl_agent.checkpointing.files import unsafe_allowed

            every = torch.load(io.BytesIO(every), weights_only=not unsafe_allowed(None))
        if isinstance(every, dict):
            # copies of their own: a restored tensor may view a snapshot's shared mapping at an
            # offset, and torch.set_rng_state reads a state's storage from its start (a view there
            # raised "Invalid mt19937 state", or crashed the process)
            state = {**state, PER_RANK: _cpu(every.get(str(dist_rank())), clone=True)}
    return state, step
