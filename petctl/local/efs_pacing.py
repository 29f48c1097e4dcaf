"""EFS's throughput limits, paid by the agent's checkpoint reads and writes under the local cloud's EFS.

The local cloud's EFS is a directory on this machine's disk (page cache), so without this a
checkpoint's round trip through EFS costs nothing there. This module is the agent's file I/O hook
(``petctl_agent.checkpointing.iohook``: ``open``, ``wrap``, ``wrap_dcp``), which the local cloud
names in ``PETCTL_IO_HOOK`` for every process of an instance, beside ``PETCTL_EFS_EMULATION``
(:mod:`petctl.local.efs_rate`): the path of a JSON file

    {"client": "<instance id>", "efs_root": "<state>/efs", "state_dir": "<state>/efs-rate",
     "client_read_bps": B, "client_write_bps": B, "fs_read_bps": B, "fs_write_bps": B,
     "read_latency_s": S, "write_latency_s": S}

A read or write of ``n`` bytes of a file under ``<efs_root>/<fs-id>/`` then takes at least
``n / rate`` in two token buckets at once: the client's (every process of that instance) and the
file system's (every instance of the local cloud). Each bucket is one small file under
``state_dir`` holding its theoretical arrival time (GCRA on ``CLOCK_MONOTONIC``, which every process
of the machine shares), updated under ``flock``; transfers are paced in chunks of ``CHUNK`` bytes so
that concurrent clients share a bucket fairly. A transfer is booked from when its I/O began, so it
takes max(the local I/O, n / rate), as on EFS where the network is the bottleneck. Opening a file
costs the per-operation latency once. Idle time earns no credit: nothing goes faster than its rate.

It runs inside the agent's worker and persister processes, so it stays small: torch is never
imported, and besides the standard library only :mod:`petctl.local.efs_rate` (the variable's name,
with the package's standard-library face). On AWS it is never imported: nothing sets the hook.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import functools
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

from petctl.local.efs_rate import ENV

CHUNK = 4 << 20
#: A bucket state further ahead than this is stale (another boot's clock): it starts afresh.
_STALE_S = 600.0
_TAT = struct.Struct("d")


@functools.lru_cache(maxsize=8)
def _config(path: str) -> dict[str, Any] | None:
    try:
        cfg = json.loads(Path(path).read_text())
        cfg["efs_root"] = os.path.realpath(cfg["efs_root"])
        for k in ("client_read_bps", "client_write_bps", "fs_read_bps", "fs_write_bps"):
            cfg[k] = float(cfg[k])
        str(cfg["client"])
        str(cfg["state_dir"])
        return cfg
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"petctl checkpoint: {ENV}={path} is unreadable ({e}); EFS I/O is not paced", file=sys.stderr)
        return None


def config() -> dict[str, Any] | None:
    """The emulation's settings, or None (on AWS, or with the local cloud's switch off)."""
    path = os.environ.get(ENV)
    return _config(path) if path else None


def _file_system(cfg: dict[str, Any], path: str | os.PathLike) -> str | None:
    """The file system id ``path`` lies in, or None if it is not under the emulated EFS."""
    p = os.path.abspath(path)
    real = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
    root = cfg["efs_root"]
    if not real.startswith(root + os.sep):
        return None
    return real[len(root) + 1 :].split(os.sep, 1)[0] or None


class _Bucket:
    """One rate shared by every process that names the same state file."""

    def __init__(self, state: Path, rate: float) -> None:
        self.state, self.rate = state, rate

    def reserve(self, n: int, since: float) -> float:
        """Book ``n`` bytes moved from ``since`` on; the monotonic time by which they have gone through."""
        if self.rate <= 0:
            return 0.0
        self.state.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, _TAT.size, 0)
            now = time.monotonic()
            tat = _TAT.unpack(raw)[0] if len(raw) == _TAT.size else now
            if tat > now + _STALE_S:
                tat = now
            tat = max(tat, min(since, now))
            tat += n / self.rate
            os.pwrite(fd, _TAT.pack(tat), 0)
            return tat
        finally:
            os.close(fd)


class _Pacer:
    """The two buckets one transfer direction of one file goes through."""

    def __init__(self, cfg: dict[str, Any], fs_id: str, kind: str) -> None:
        d = Path(cfg["state_dir"])
        self.buckets = (
            _Bucket(d / f"client-{cfg['client']}.{kind}", cfg[f"client_{kind}_bps"]),
            _Bucket(d / f"fs-{fs_id}.{kind}", cfg[f"fs_{kind}_bps"]),
        )
        self.latency = float(cfg.get(f"{kind}_latency_s") or 0.0)

    def op(self) -> None:
        if self.latency > 0:
            time.sleep(self.latency)

    def pay(self, n: int, since: float | None = None) -> None:
        """Take at least ``n / rate`` from ``since`` (when the I/O began; default now) in each bucket."""
        since = time.monotonic() if since is None else since
        while n > 0:
            k = min(n, CHUNK)
            done = max(b.reserve(k, since) for b in self.buckets)
            since = done
            wait = done - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            n -= k


def _pacer(path: str | os.PathLike, kind: str) -> _Pacer | None:
    cfg = config()
    if cfg is None:
        return None
    fs_id = _file_system(cfg, path)
    return _Pacer(cfg, fs_id, kind) if fs_id else None


def charge(path: str | os.PathLike, nbytes: int, kind: str) -> None:
    """Pay for one operation moving ``nbytes`` to (``"write"``) or from (``"read"``) ``path``."""
    p = _pacer(path, kind)
    if p is not None:
        p.op()
        p.pay(int(nbytes))


class _Paced:
    """A file object whose reads or writes are paced; everything else is the file's own."""

    def __init__(self, f: Any, read: _Pacer | None, write: _Pacer | None) -> None:
        self._f, self._r, self._w = f, read, write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Paced:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return self._paid_lines()

    def _paid_lines(self) -> Any:
        t0 = time.monotonic()
        for line in self._f:
            self._paid(self._r, len(line), t0)
            yield line
            t0 = time.monotonic()

    @staticmethod
    def _paid(p: _Pacer | None, n: int | None, since: float) -> None:
        if p is not None and n:
            p.pay(n, since)

    def write(self, b: Any) -> int:
        t0 = time.monotonic()
        n = self._f.write(b)
        self._paid(self._w, n, t0)
        return n

    def read(self, size: int = -1) -> Any:
        t0 = time.monotonic()
        out = self._f.read(size)
        self._paid(self._r, len(out), t0)
        return out

    def read1(self, size: int = -1) -> Any:
        t0 = time.monotonic()
        out = self._f.read1(size)
        self._paid(self._r, len(out), t0)
        return out

    def readinto(self, b: Any) -> int | None:
        t0 = time.monotonic()
        n = self._f.readinto(b)
        self._paid(self._r, n, t0)
        return n

    def readinto1(self, b: Any) -> int | None:
        t0 = time.monotonic()
        n = self._f.readinto1(b)
        self._paid(self._r, n, t0)
        return n

    def readline(self, size: int = -1) -> Any:
        t0 = time.monotonic()
        out = self._f.readline(size)
        self._paid(self._r, len(out), t0)
        return out


def wrap(f: Any, path: str | os.PathLike, mode: str) -> Any:
    """``f`` (opened on ``path`` with ``mode``), paced if ``path`` is on the emulated EFS."""
    reading = "r" in mode or "+" in mode
    writing = any(c in mode for c in "wax+")
    r = _pacer(path, "read") if reading else None
    w = _pacer(path, "write") if writing else None
    if r is None and w is None:
        return f
    (w or r).op()
    return _Paced(f, r, w)


def open(path: str | os.PathLike, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001
    """``open()``, paced when ``path`` is on the emulated EFS."""
    return wrap(builtins.open(path, mode, *args, **kwargs), path, mode)


class _PacedFileSystem:
    """DCP's ``FileSystem`` with its streams paced (everything else is the wrapped one's)."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        with self._fs.create_stream(path, mode) as stream:
            yield wrap(stream, path, mode)


def wrap_dcp(storage: Any) -> Any:
    """A DCP ``FileSystemWriter``/``FileSystemReader`` whose files are paced on the emulated EFS."""
    if config() is not None and hasattr(storage, "fs"):
        storage.fs = _PacedFileSystem(storage.fs)
    return storage
