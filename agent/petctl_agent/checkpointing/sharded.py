"""Sharded checkpoints (any ``DTensor``/``ShardedTensor`` in the state, e.g. FSDP2 state dicts).

Every rank writes its own shard with ``torch.distributed.checkpoint`` into a hidden temp
directory, which rank 0 renames to ``ckpt-<step:010d>.dcp`` once all are written. It loads at
any world size (DCP reshards), into the state dict the caller passes. The DCP coordination
(plans, metadata) runs on the checkpoint group (:mod:`petctl_agent.checkpointing.group`): same timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from petctl_agent.checkpointing import collectives, iohook
from petctl_agent.checkpointing.atomic import fsync_dir
from petctl_agent.checkpointing.files import (
    CKPT_RE,
    UnsafeCheckpointError,
    prune,
    refused_global,
    unsafe_allowed,
    unsafe_message,
    write_pointer,
)
from petctl_agent.checkpointing.group import barrier, ckpt_group
from petctl_agent.distributed import dist_on, dist_rank, dist_world

#: the top-level key of every rank's own entry (``checkpointing/userstate.py``); here because a
#: sharded load gives it a slot to fill
PER_RANK = "per_rank"


class NeedsStateError(TypeError):
    """The checkpoint is sharded: loading it needs the state dict to load into."""


class MissingStateError(NeedsStateError):
    """The sharded checkpoint holds entries that the state to load into lacks: DCP fills only the
    keys of the dict it is given, so they would be dropped without an error (e.g. the moments of
    an optimizer whose ``state_dict()`` was taken before its first step)."""


def _check_keys(path: Path, metadata: Any, into: dict[str, Any]) -> None:
    """Raise :class:`MissingStateError` when the checkpoint ``path`` (its DCP ``metadata``) holds an
    entry that ``into`` does not name; add the slot for the per-rank entry (userstate.PER_RANK)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = set(metadata.state_dict_metadata)
    if PER_RANK in saved and PER_RANK not in into:
        into[PER_RANK] = b""  # the slot DCP replaces with the saved value (userstate.own reads it)
    flat = set(flatten_state_dict(into)[0])
    absent = sorted(flat - saved)
    if absent:  # DCP would raise, and the agreed load would take it for a torn step and go older
        raise MissingStateError(
            f"{path.name} has no entry for {absent[0]!r} of the state to load into ({len(absent)} in "
            "all): save it under that key, or leave it out of the state to resume"
        )
    # only under the top-level keys asked for: a state that leaves out a whole key ("optim") is a
    # partial load on purpose
    tops = {k.split(".", 1)[0] for k in flat}
    missing = sorted(k for k in saved - flat if k.split(".", 1)[0] in tops)
    if missing:
        raise MissingStateError(
            f"{path.name} holds {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} that the state "
            f"to load into lacks (first: {missing[0]!r}), which DCP would drop without an error: pass "
            "the model and optimizer themselves, resume({'model': model, 'optim': opt}) (docs/agent.md, "
            "'Checkpoints')"
        )


def is_sharded(obj: Any, _depth: int = 0) -> bool:
    """Does ``obj`` (nested dicts/lists) hold a DTensor or ShardedTensor?

    Only looks for the classes when their modules are loaded: no sharded tensor can
    exist otherwise, and plain scripts do not pay for importing them.
    """
    kinds = []
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and hasattr(dt, "DTensor"):
        kinds.append(dt.DTensor)
    st = sys.modules.get("torch.distributed._shard.sharded_tensor")
    if st is not None and hasattr(st, "ShardedTensor"):
        kinds.append(st.ShardedTensor)
    if not kinds:
        return False
    kinds_t = tuple(kinds)

    def walk(o: Any, depth: int) -> bool:
        if isinstance(o, kinds_t):
            return True
        if depth > 32:
            return False
        if isinstance(o, dict):
            return any(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return any(walk(v, depth + 1) for v in o)
        return False

    return walk(obj, _depth)


def save_sharded(state: dict[str, Any], step: int, d: Path, keep: int) -> Path | None:
    """Every rank writes its shard; rank 0 publishes the directory and ``latest``. Collective."""
    import torch.distributed.checkpoint as dcp

    name = f"ckpt-{step:010d}.dcp"
    tmp = d / f".{name}.tmp"
    group = ckpt_group() if dist_on() else None
    rank0 = dist_rank() == 0
    if rank0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a writer killed earlier at this step
        tmp.mkdir()
    barrier()
    dcp.save(
        state,
        storage_writer=iohook.wrap_dcp(dcp.FileSystemWriter(str(tmp), sync_files=True)),
        process_group=group,
    )
    out: Path | None = None
    if rank0:
        fsync_dir(tmp)
        final = d / name
        if final.exists():  # saved this step before (a retry): replace it
            trash = d / f".{name}.old.tmp"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(d)
        write_pointer(d, {"file": name, "step": step, "format": "dcp", "world_size": dist_world()})
        prune(d, keep, name)
        out = final
    barrier()
    return out


# What a DCP ``.metadata`` pickle may name: DCP's own metadata records and the torch values in them.
_META_MODULES = ("torch.distributed.checkpoint.metadata",)
_META_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _safe_metadata_load(f: Any, path: Path) -> Any:
    """``pickle.load`` of DCP's ``.metadata`` with only DCP's record types (and dtypes) allowed.

    torch's reader calls plain ``pickle.load`` there: a crafted ``.metadata`` would run code.
    """
    import pickle

    import torch

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            obj = None
            if module in _META_MODULES or (module, name) in _META_GLOBALS:
                obj = super().find_class(module, name)
                if module in _META_MODULES and not isinstance(obj, type):
                    obj = None  # classes (dataclasses, enums) only
            elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                obj = getattr(torch, name)
            if obj is None:
                raise UnsafeCheckpointError(unsafe_message(path, f"{module}.{name} in .metadata"))
            return obj

    return _Unpickler(f).load()


def _safe_dcp(path: Path, refused: list[str]) -> tuple[Any, Any]:
    """A DCP reader and load planner that unpickle nothing outside the allow-lists.

    DCP wraps what they raise in a ``CheckpointException``: each refusal's message is also
    appended to ``refused`` so that the caller can raise it as itself.
    """
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                try:
                    metadata = _safe_metadata_load(f, path)
                except UnsafeCheckpointError as e:
                    refused.append(str(e))
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        # DefaultLoadPlanner.load_bytes is torch.load(weights_only=False) of each non-tensor value
        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001 - only a weights_only refusal is ours to judge
                what = refused_global(e)
                if what is None:
                    raise
                refused.append(unsafe_message(path, what))
                raise UnsafeCheckpointError(refused[-1]) from None
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeReader(str(path)), SafePlanner()


def load_sharded(
    path: Path, into: dict[str, Any] | None, unsafe_load: bool | None = None
) -> tuple[dict[str, Any], int]:
    """Load the DCP checkpoint ``path`` in place into ``into`` (collective): ``(into, step)``.

    Safe by default: ``.metadata`` is unpickled with DCP's record types only and each
    non-tensor value with ``weights_only=True``; ``unsafe_load`` (or
    ``$PETCTL_CHECKPOINT_UNSAFE_LOAD``) restores torch's full unpickling.

    Raises:
        UnsafeCheckpointError: something in it needs a full unpickle and the caller did not opt in.
        RuntimeError: DCP's load failed otherwise (a shard file missing or truncated, ...): DCP
            raises it on every rank together, as a ``CheckpointException`` -- a ``BaseException``
            that a caller's ``except Exception`` (the agreed fallback to an older step) would miss.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if into is None:
        raise NeedsStateError(
            f"{path.name} is a sharded (torch.distributed.checkpoint) checkpoint: pass the state "
            "dict to load into, e.g. resume({'model': model.state_dict(), ...})"
        )
    group = ckpt_group() if dist_on() else None
    refused: list[str] = []
    if unsafe_allowed(unsafe_load):
        reader, planner = dcp.FileSystemReader(str(path)), None
    else:
        reader, planner = _safe_dcp(path, refused)
    verdict: list[str] | None = None
    try:
        _check_keys(path, reader.read_metadata(), into)
    except (MissingStateError, UnsafeCheckpointError) as e:
        verdict = [type(e).__name__, str(e)]
    except Exception:  # noqa: BLE001 - an unreadable .metadata: DCP's load below says so, on every rank
        pass
    # agreed before DCP's collectives: a rank whose .metadata read failed (EFS: EIO) would enter
    # them while the others raised
    first = collectives.first_said(verdict)
    if first is not None:
        raise (MissingStateError if first[0] == MissingStateError.__name__ else UnsafeCheckpointError)(
            first[1]
        )
    try:
        dcp.load(into, storage_reader=iohook.wrap_dcp(reader), planner=planner, process_group=group)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if refused:
            raise UnsafeCheckpointError(refused[0]) from None
        m = re.search(r"[^:;\n]* which a safe \(weights_only\) load refuses[^;\n]*", str(e))
        if m:  # refused on another rank: every rank fails with the same line
            raise UnsafeCheckpointError(m.group(0).strip()) from None
        if isinstance(e, CheckpointException):
            raise RuntimeError(f"{path.name}: {_dcp_failure(e)}") from e
        raise
    return into, int(CKPT_RE.match(path.name).group(1))


def _dcp_failure(e: BaseException) -> str:
    """One line for a ``CheckpointException`` (its ``str`` is every failed rank's traceback): the
    failed ranks and the first one's exception, e.g. ``DCP load failed on rank(s) [1]:
    RuntimeError: PytorchStreamReader failed reading zip archive: ...``."""
    failures = getattr(e, "failures", None) or {}
    ranks = sorted(failures)
    first = failures[ranks[0]][0] if ranks else e
    what = str(first).strip().splitlines()[0] if str(first).strip() else ""
    if len(what) > 300:
        what = what[:300] + "..."
    return f"DCP load failed on rank(s) {ranks}: {type(first).__name__}: {what}"
