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


def _unwrap(model: Any) -> Any:
    """The module under DDP's (``.module``) and ``torch.compile``'s (``._orig_mod``) wrappers: a
    script resumes before it wraps, and saves after, so both must name the same keys."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            model.module if type(model).__name__ in ("DistributedDataParallel", "DataParallel") else None
        )
        if inner is None:
            return model
        model = inner


def _stateful(obj: Any) -> bool:
    """A live object whose state petctl saves and loads back into it: a module, an optimizer, or
    anything else with ``state_dict()``/``load_state_dict()`` (an LR scheduler, a GradScaler)."""
    return (
        not isinstance(obj, dict)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _model_of(key: str, opt: Any, state: dict[str, Any]) -> Any:
    """The module in ``state`` whose parameters the optimizer ``state[key]`` updates."""
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for v in state.values():
        if _is_module(v) and any(id(p) in params for p in v.parameters()):
            return _unwrap(v)
    raise ValueError(
        f"petctl checkpoint: state[{key!r}] is an optimizer but no model in the state owns its "
        "parameters: put the model beside it, e.g. {'model': model, 'optim': opt}"
    )


def _objects(state: dict[str, Any]) -> dict[str, tuple[Any, Any, bool]]:
    """``{key: (object, its model or None, sharded)}`` for the live objects at the top of ``state``
    (:func:`_stateful`; a module unwrapped, :func:`_unwrap`)."""
    out: dict[str, tuple[Any, Any, bool]] = {}
    for k, v in state.items():
        if k == PER_RANK:
            continue
        if _is_module(v):
            v = _unwrap(v)
            out[k] = (v, None, _has_dtensor(v))
        elif _is_optimizer(v):
            model = _model_of(k, v, state)
            out[k] = (v, model, _has_dtensor(model))
        elif _stateful(v):
            out[k] = (v, None, False)
    return out


def _state_of(obj: Any, model: Any, sharded: bool) -> dict[str, Any]:
    if not sharded:
        return obj.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(obj) if model is None else get_optimizer_state_dict(model, obj)


def _load_into(obj: Any, model: Any, sharded: bool, sd: Any) -> None:
    if sharded:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if model is None:
            set_model_state_dict(obj, sd)
        else:
            set_optimizer_state_dict(model, obj, sd)
        return
    if _is_module(obj) and isinstance(sd, dict):
        # saved from a DDP-wrapped model by an older call (its state_dict()): the same keys
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        sd = dict(sd)
        consume_prefix_in_state_dict_if_present(sd, "module.")
    obj.load_state_dict(sd)


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
    replicas must share differs between ranks, or some ranks have a :data:`PER_RANK` entry and
    others not (collective: one small all-gather; a second one when the digests differ). Only
    the values every rank has are compared: a rank may hold keys the others lack (a pipeline
    stage's own parameters)."""
    if not dist_on():
        return
    leaves: list[tuple[str, bytes]] = [("per_rank present", bytes([PER_RANK in state]))]
    for k, v in state.items():
        if k != PER_RANK:
            _leaves(v, f"state[{k!r}]", leaves)
    whole = hashlib.blake2b(b"".join(p.encode() + d for p, d in leaves), digest_size=16).digest()
    if len(set(_gather(whole))) == 1:
        return
    every = [dict(rank_leaves) for rank_leaves in _gather(leaves)]
    if len({ls["per_rank present"] for ls in every}) > 1:
        have = [r for r, ls in enumerate(every) if ls["per_rank present"] == b"\x01"]
        raise PerRankStateError(
            f"petctl checkpoint: state[{PER_RANK!r}] is on rank(s) {have} only: every rank must save "
            "one (None where it has nothing), or the ranks' collectives would not match"
        )
    for p, d in every[0].items():
        for r, theirs in enumerate(every[1:], 1):
            if p in theirs and theirs[p] != d:
                raise PerRankStateError(
                    f"petctl checkpoint: {p} differs between ranks 0 and {r}, and would come back as "
                    f"rank 0's on every rank: put per-rank values under state[{PER_RANK!r}] "
                    "(docs/agent.md, 'What comes back per rank')"
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


def for_load(
    into: dict[str, Any] | None, unsafe_load: bool | None = None
) -> tuple[dict[str, Any] | None, Callable[[Any], Any]]:
    """The dict to load into for ``into`` (live objects as the dicts they fill) and the function
    that finishes a load's result: it applies the loaded state dicts to the objects (raising
    :class:`~.sharded.MissingStateError` when the checkpoint has no entry for one) and gives this
    rank its own :data:`PER_RANK` value."""
    if into is None:
        return None, lambda out: own(out, unsafe_load)
    objs = _objects(into)
    fill = {k: (_state_of(*objs[k]) if k in objs else v) for k, v in into.items() if k != PER_RANK}

    def finish(out: Any) -> Any:
        out = own(out, unsafe_load)
        if out is None:
            return None
        state = out[0]
        missing = sorted(k for k in objs if k not in state)
        if missing:  # every rank loaded the same step: every rank raises
            from petctl_agent.checkpointing.sharded import MissingStateError

            raise MissingStateError(
                f"step {out[1]}'s checkpoint has no {missing[0]!r} to load into state[{missing[0]!r}] "
                f"(it holds {sorted(k for k in state if k != PER_RANK)}): save it under that key, or "
                "leave it out of the state to resume"
            )
        for k, (obj, model, sharded) in objs.items():
            _load_into(obj, model, sharded, state[k])
        return out

    return fill, finish


def own(out: Any, unsafe_load: bool | None = None) -> Any:
    """A load's ``(state, step)`` with ``state[PER_RANK]`` replaced by this rank's own entry."""
    if out is None:
        return None
    state, step = out
    if isinstance(state, dict) and PER_RANK in state:  # (absent when nothing was saved per rank)
        every = state[PER_RANK]
        if isinstance(every, bytes):  # the sharded path's one opaque value (for_save)
            import torch

            from petctl_agent.checkpointing.files import unsafe_allowed

            every = torch.load(io.BytesIO(every), weights_only=not unsafe_allowed(unsafe_load))
        if isinstance(every, dict):
            # copies of their own: a restored tensor may view a snapshot's shared mapping at an
            # offset, and torch.set_rng_state reads a state's storage from its start (a view there
            # raised "Invalid mt19937 state", or crashed the process)
            state = {**state, PER_RANK: _cpu(every.get(str(dist_rank())), clone=True)}
    return state, step
