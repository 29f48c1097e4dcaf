"""Why a node's workers failed, in the worker's own words, and whether it will only happen again.

torch says little: a worker that exits non-zero without an error file (a script not decorated
with ``@record``, a fresh interpreter when ``FORKSERVER`` is off, or a framework that prints its
traceback and calls ``sys.exit(1)``, as hydra's ``@hydra.main`` does) is ``ProcessFailure.message``
"To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html", and a forkserver
worker's error file holds a dict whose text is the whole call stack. Neither says what went wrong.

:func:`worker_errors` takes, for each failed local rank, the exception line of the worker's own
traceback: from torch's error file (``record`` writes it around the forkserver's ``run_script``)
when there is one, else from the end of the rank's ``stderr.log`` (the last ``Traceback`` block's
exception line, else the last ``Xxx: message`` line, else the last line), with the frame it was
raised in (``File "...", line N, in f``: the "point" of :class:`RepeatWatch`).
:func:`describe` says it in one line, with the ranks and this node's instance id.

:class:`RepeatWatch`: the same failure at the same point (same error line, same frame, same last
step, same world size) twice in a row with no membership change in between is deterministic: a
third try would fail the same way. The agent then stops the job instead of spending the rest of
its restart budget.

torch-free (unit-tested without processes).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petctl_agent.elastic.decisions import TERMINATED_BY_TORCH

#: How much of a rank's stderr is read for its error (its end).
STDERR_TAIL = 64 * 1024
#: How long the error line in a reason may be.
LINE_MAX = 240
#: A Python exception line: ``FileNotFoundError: [Errno 2] ...``, ``torch.OutOfMemoryError: ...``,
#: ``KeyboardInterrupt``, ``AssertionError`` (no message). Not indented.
EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$"
)
#: A traceback frame: ``  File "/x/train.py", line 12, in main``.
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')
#: What torch's error file says when a worker wrote none (never a reason).
TORCH_NO_TRACEBACK = "To enable traceback see"
#: torch's ``error_file_data`` placeholders when there is no error file.
TORCH_PLACEHOLDERS = ("<NONE>", "<N/A>")
#: Errors of reading a file another node was still writing (a ``torch.save`` is not atomic).
TORN_FILE = re.compile(
    r"failed finding central directory|PytorchStreamReader failed|unexpected EOF|Ran out of input"
    r"|invalid load key|file is not a zip file|truncated",
    re.IGNORECASE,
)
TORN_HINT = (
    " [a file that is incomplete or torn: one written by several nodes at once? "
    "save from global rank 0 only, or to a temporary name and os.replace it; docs/agent.md, "
    '"Shared working directory"]'
)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


@dataclass(frozen=True)
class WorkerError:
    """One failed local rank: its global rank, exit code, exception line and where it was raised."""

    rank: int
    local_rank: int
    exitcode: int | None
    line: str | None
    where: str | None = None

    @property
    def signalled(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0

    @property
    def stopped_by_torch(self) -> bool:
        """A sibling torch terminated after another local rank failed (not a failure of its own)."""
        return self.exitcode in TERMINATED_BY_TORCH


def _clip(line: str, limit: int = LINE_MAX) -> str:
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def from_traceback(lines: list[str]) -> tuple[str | None, str | None]:
    """``(exception line, innermost frame)`` of the last traceback in ``lines``; a chained
    exception's last traceback is the one that ended the process. ``(None, None)``: none."""
    start = max(
        (i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=-1
    )
    if start < 0:
        return None, None
    where = None
    for ln in lines[start + 1 :]:
        m = FRAME.match(ln)
        if m:
            where = f"{m.group('file')}:{m.group('line')} in {m.group('fn').strip()}"
            continue
        if ln[:1] in (" ", "\t") or not ln.strip():
            continue  # the frame's code line, its ^^^ markers
        return ln.strip(), where
    return None, where


def from_error_file(data: Any) -> tuple[str | None, str | None]:
    """The exception line and frame from torch's error file data (``ProcessFailure.error_file_data``,
    written by ``record``: ``{"message": {"message": "Xxx: msg", "extraInfo": {"py_callstack":
    ...}}}``). ``(None, None)`` when it holds no exception of the worker."""
    msg = data.get("message") if isinstance(data, Mapping) else None
    if isinstance(msg, Mapping):
        text = msg.get("message")
        stack = (
            (msg.get("extraInfo") or {}).get("py_callstack")
            if isinstance(msg.get("extraInfo"), Mapping)
            else None
        )
    else:
        text, stack = msg, None
    line, where = from_traceback(stack.splitlines()) if isinstance(stack, str) else (None, None)
    if (
        isinstance(text, str)
        and text.strip() not in ("", *TORCH_PLACEHOLDERS)
        and TORCH_NO_TRACEBACK not in text
    ):
        first = next(ln for ln in text.strip().splitlines() if ln.strip())
        return first.strip(), where
    return line, where


def read_tail(path: str | os.PathLike | None, size: int = STDERR_TAIL) -> list[str]:
    """The last ``size`` bytes of ``path`` as lines (the first, maybe cut, dropped); [] if unreadable."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(0, end - size))
            data = f.read()
    except OSError:
        return []
    lines = re.split(r"\r\n|\r|\n", data.decode("utf-8", "replace"))
    return lines[1:] if end > size else lines


def from_output(lines: list[str]) -> tuple[str | None, str | None]:
    """The error in a worker's stderr: the last traceback's exception line, else the last
    ``Xxx: message`` line, else the last non-empty line (``sys.exit("bad config")``)."""
    line, where = from_traceback(lines)
    if line:
        return line, where
    for ln in reversed(lines):
        if ln[:1] not in (" ", "\t") and EXCEPTION_LINE.match(ln.strip()):
            return ln.strip(), None
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), None)
    return last, None


def worker_error(
    rank: int, local_rank: int, exitcode: int | None, error_data: Any, stderr: str | os.PathLike | None
) -> WorkerError:
    """One failed rank's :class:`WorkerError`: its error file first, else its stderr's end. A
    rank killed by a signal (negative exit code) says which signal, never a line of its output."""
    if exitcode is not None and exitcode < 0:
        return WorkerError(rank, local_rank, exitcode, None)
    line, where = from_error_file(error_data)
    if not line:
        line, where2 = from_output(read_tail(stderr))
        where = where or where2
    return WorkerError(rank, local_rank, exitcode, _clip(line) if line else None, where)


def worker_errors(failures: Mapping[int, Any], stderrs: Mapping[int, str] | None = None) -> list[WorkerError]:
    """:class:`WorkerError` of each failure of torch's ``RunResult.failures`` (global rank ->
    ``ProcessFailure``); ``stderrs``: local rank -> its ``stderr.log`` (``PContext.stderrs``)."""
    out = []
    for rank, f in sorted(failures.items()):
        local = int(getattr(f, "local_rank", -1))
        out.append(
            worker_error(
                int(rank),
                local,
                getattr(f, "exitcode", None),
                getattr(f, "error_file_data", None),
                (stderrs or {}).get(local),
            )
        )
    return out


def own(errors: Iterable[WorkerError]) -> list[WorkerError]:
    """The failures of their own: without the siblings torch terminated after one failed."""
    errors = list(errors)
    mine = [e for e in errors if not e.stopped_by_torch]
    return mine or errors


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe(errors: Iterable[WorkerError], instance_id: str | None = None) -> str:
    """One line: each distinct failure with its ranks, this node's instance and the exception
    line (``rank 0 on i-0abc exit 1: FileNotFoundError: [Errno 2] ...``). The siblings torch
    terminated after another rank failed are left out; a signal says its name."""
    errors = own(errors)
    if not errors:
        return "unknown"
    groups: dict[tuple[Any, ...], list[int]] = {}
    for e in errors:
        groups.setdefault((e.exitcode, e.line), []).append(e.rank)
    on = f" on {instance_id}" if instance_id else ""
    parts = []
    for (code, line), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        if code is not None and code < 0:
            parts.append(
                f"{who}{on} killed by {_signal_name(code)}" + (" (out of memory?)" if code == -9 else "")
            )
        else:
            text = line or "no error output"
            hint = TORN_HINT if line and TORN_FILE.search(line) else ""
            parts.append(f"{who}{on} exit {code}: {text}{hint}")
    return "; ".join(parts)


def signature(errors: Iterable[WorkerError], step: Any, world_size: Any) -> tuple[Any, ...] | None:
    """What makes two failures "the same at the same point": every failed rank's exception line
    and frame (one and the same for all of them), the last step and the world size. None: not a
    failure that can repeat deterministically (a signal, no error line, ranks failing differently)."""
    errors = own(errors)
    if not errors or any(e.signalled or not e.line for e in errors):
        return None
    kinds = {(_ADDRESS.sub("0x?", e.line or ""), e.where) for e in errors}
    if len(kinds) != 1:
        return None
    line, where = kinds.pop()
    return (line, where, step, world_size)


class RepeatWatch:
    """The previous failure's :func:`signature`, forgotten at every membership change."""

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None

    def again(self, sig: tuple[Any, ...] | None) -> bool:
        """Record this failure; True when it is the same as the one before it (and not None)."""
        repeat = sig is not None and sig == self._last
        self._last = sig
        return repeat

    def reset(self) -> None:
        """A membership change (a join, a loss, a drain) happened: the next failure starts afresh."""
        self._last = None


def stderr_paths(pcontext: Any) -> dict[int, str]:
    """Local rank -> ``stderr.log`` of a torch ``PContext`` ({} when unknown or not redirected)."""
    paths = getattr(pcontext, "stderrs", None) or {}
    return {int(k): str(v) for k, v in paths.items() if v and Path(str(v)).name}
