"""What a snapshot's header says: its format, the state's structure as JSON, and its own CRC.

A slot's header (``<name>.<slot>.json``, docs/agent.md "Memory snapshots") holds the step and its
epoch, world size and rank, a generation and a nonce, the state's structure (dicts, lists, tuples,
numbers, strings; tensors as references: :func:`encode_structure`, :func:`decode_structure`),
each tensor's dtype, shape, offset and CRC-32C, and a CRC-32C of the header itself
(:func:`header_crc`). A state it cannot represent raises :class:`Unsupported` (the caller uses the
EFS path). :class:`Complete` is a slot whose header is present and intact; :func:`same_snapshot`
tells whether a slot still holds it. Torch is imported only to encode or decode.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from petctl_agent.checkpointing import crcs
from petctl_agent.checkpointing.timeline import epoch_of

FORMAT = "petctl-snapshot-2"
SLOTS = ("a", "b")
#: every tensor's bytes start at a multiple of this in the data file
ALIGN = 64


class Unsupported(ValueError):
    """The state holds something a snapshot cannot represent (the caller uses the EFS path)."""


def encode_structure(x: Any, tensors: list[Any]) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
            raise Unsupported(f"tensor subclass {type(x).__name__} (sharded state: use the EFS path)")
        if x.is_sparse or x.is_quantized or x.device.type == "meta" or x.is_nested:
            raise Unsupported(f"{x.layout} / {x.device.type} tensor")
        tensors.append(x)
        return {"T": len(tensors) - 1}
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return {"F": repr(x)}  # nan/inf survive, JSON stays strict
    if type(x) is list:
        return {"L": [encode_structure(v, tensors) for v in x]}
    if type(x) is tuple:
        return {"U": [encode_structure(v, tensors) for v in x]}
    if type(x) in (dict, OrderedDict):
        out: dict[str, Any] = {
            "D" if type(x) is dict else "O": [
                [encode_structure(k, tensors), encode_structure(v, tensors)] for k, v in x.items()
            ]
        }
        meta = getattr(x, "_metadata", None)  # nn.Module.state_dict()'s per-module versions
        if meta is not None:
            out["M"] = encode_structure(meta, tensors)
        return out
    if isinstance(x, torch.dtype):
        return {"Y": str(x)}
    raise Unsupported(f"{type(x).__name__} value in the state")


def decode_structure(x: Any, tensors: list[Any]) -> Any:
    if not isinstance(x, dict):
        return x
    if "T" in x:
        return tensors[x["T"]]
    if "F" in x:
        return float(x["F"])
    if "L" in x:
        return [decode_structure(v, tensors) for v in x["L"]]
    if "U" in x:
        return tuple(decode_structure(v, tensors) for v in x["U"])
    if "D" in x or "O" in x:
        items = [
            (decode_structure(k, tensors), decode_structure(v, tensors)) for k, v in x.get("D", x.get("O"))
        ]
        d: Any = dict(items) if "D" in x else OrderedDict(items)
        if "M" in x:
            d._metadata = decode_structure(x["M"], tensors)
        return d
    if "Y" in x:
        return dtype_from_name(x["Y"])
    raise ValueError(f"bad structure node {sorted(x)}")


def dtype_from_name(name: str) -> Any:
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name}")
    return dt


def header_crc(header: dict[str, Any]) -> int:
    body = {k: v for k, v in header.items() if k != "header_crc"}
    return crcs.crc(json.dumps(body, sort_keys=True).encode())


def same_layout(known: list[dict[str, Any]], metas: list[dict[str, Any]]) -> bool:
    keys = ("dtype", "shape", "offset", "nbytes")
    return len(known) == len(metas) and all(
        isinstance(k.get("crc32c"), int) and all(k.get(x) == m[x] for x in keys) for k, m in zip(known, metas)
    )


def same_snapshot(header: dict[str, Any] | None, c: Complete) -> bool:
    """Does the slot still hold ``c`` (the seqlock's check after a read)?"""
    return (
        header is not None
        and header.get("gen") == c.header.get("gen")
        and header.get("nonce") == c.header.get("nonce")
    )


@dataclass(frozen=True)
class Complete:
    """A complete snapshot on disk: its slot and header."""

    slot: str
    header: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def gen(self) -> int:
        return int(self.header["gen"])

    @property
    def epoch(self) -> int:
        """The epoch of the generation that wrote it (:mod:`.timeline`; 0: none recorded)."""
        return epoch_of(self.header)

    @property
    def key(self) -> tuple[int, int]:
        """``(epoch, step)``: which history, and where in it (:func:`.timeline.key`)."""
        return (self.epoch, self.step)
