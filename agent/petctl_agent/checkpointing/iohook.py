"""The checkpoint layer's file I/O hook: what the place the agent runs in adds to its reads and
writes under the checkpoint directory.

On AWS nothing sets ``PETCTL_IO_HOOK``: :func:`open` is ``open()``, :func:`wrap` and
:func:`wrap_dcp` return what they are given; the cost is one environment lookup per file. The
local cloud sets it for every unit of an instance (beside ``PETCTL_EFS_EMULATION``, its rate file)
to ``petctl.local.efs_pacing``, which paces the files under its EFS directory at AWS's EFS
throughput; its own page cache would make a checkpoint's round trip through EFS free otherwise.

``PETCTL_IO_HOOK`` names an importable module that provides the three functions with these
signatures. It is imported with :func:`importlib.import_module` at the first file the layer opens:
a dependency the environment names, never a static import, so the agent still imports nothing of
``petctl`` (scripts/import_graph.py) and runs where ``petctl`` is not installed. A module that
cannot be imported or lacks one of them is one line on stderr, then plain I/O.

Only what goes through here is hooked: the checkpoint layer's files (:mod:`.files`,
:mod:`.atomic`, DCP's streams in :mod:`.sharded`). A user script's own ``open()`` is not.
Standard library only.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import os
import sys
from types import ModuleType
from typing import Any

ENV = "PETCTL_IO_HOOK"
_FUNCTIONS = ("open", "wrap", "wrap_dcp")


@functools.lru_cache(maxsize=8)
def _load(name: str) -> ModuleType | None:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import means plain I/O, said once
        print(
            f"petctl checkpoint: {ENV}={name} cannot be imported ({e}); file I/O is not hooked",
            file=sys.stderr,
        )
        return None
    missing = [f for f in _FUNCTIONS if not callable(getattr(module, f, None))]
    if missing:
        print(
            f"petctl checkpoint: {ENV}={name} lacks {', '.join(missing)}; file I/O is not hooked",
            file=sys.stderr,
        )
        return None
    return module


def hook() -> ModuleType | None:
    """The module ``PETCTL_IO_HOOK`` names, or None (on AWS: unset)."""
    name = os.environ.get(ENV)
    return _load(name) if name else None


def open(path: str | os.PathLike, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001
    """``open()``, through the hook when one is set."""
    h = hook()
    if h is None:
        return builtins.open(path, mode, *args, **kwargs)
    return h.open(path, mode, *args, **kwargs)


def wrap(f: Any, path: str | os.PathLike, mode: str) -> Any:
    """``f`` (a file opened on ``path`` with ``mode``), as the hook wraps it; ``f`` itself without one."""
    h = hook()
    return f if h is None else h.wrap(f, path, mode)


def wrap_dcp(storage: Any) -> Any:
    """A DCP ``FileSystemWriter``/``FileSystemReader``, as the hook wraps it; itself without one."""
    h = hook()
    return storage if h is None else h.wrap_dcp(storage)
