"""The local EFS's throughput limits: AWS's figures for a Regional file system in Elastic mode.

The local cloud's EFS is a directory (``<state>/efs/<fs-id>/``), as fast as this machine's page
cache. Every unit of an instance gets ``PETCTL_EFS_EMULATION``, the path of
``instances/<id>/efs-rate.json``: the instance's client id and the rates below, and
``PETCTL_IO_HOOK=petctl.local.efs_pacing``: the agent's checkpoint layer hands its files to that
module (``petctl_agent.checkpointing.iohook``), which paces their reads and writes under the EFS
directory: per client (all processes of one instance) and per file system (all instances).

Defaults (docs/local.md has the sources): 1,500 MiB/s per client, read and write; per file
system 60 GiB/s of reads and 5 GiB/s of writes (us-east-1, the local cloud's region); a read
costs 0.25 ms and a write 2.7 ms of latency per file opened. Knobs, read from the daemon's
environment: ``PETCTL_LOCAL_EFS_THROTTLE=0`` turns it off; ``PETCTL_LOCAL_EFS_CLIENT_MIBPS``,
``PETCTL_LOCAL_EFS_READ_MIBPS``, ``PETCTL_LOCAL_EFS_WRITE_MIBPS`` (per file system),
``PETCTL_LOCAL_EFS_READ_LATENCY_MS``, ``PETCTL_LOCAL_EFS_WRITE_LATENCY_MS`` override the figures.
Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: The variable :mod:`petctl.local.efs_pacing` reads: the instance's rate file.
ENV = "PETCTL_EFS_EMULATION"
#: The agent's file I/O hook (``ENV`` of ``petctl_agent.checkpointing.iohook``; petctl may not import
#: the agent's checkpoint layer, so the name is written twice) and the module the local cloud names.
HOOK_ENV = "PETCTL_IO_HOOK"
HOOK = "petctl.local.efs_pacing"
SWITCH = "PETCTL_LOCAL_EFS_THROTTLE"
MIB = 1 << 20

CLIENT_MIBPS = 1500.0  # per client, read and write: Regional, Elastic (performance table)
FS_READ_MIBPS = 60 * 1024.0  # per file system, us-east-1 (quotas page)
FS_WRITE_MIBPS = 5 * 1024.0
READ_LATENCY_MS = 0.25  # "as low as" (performance table)
WRITE_LATENCY_MS = 2.7


class EfsRateError(ValueError):
    """A knob that is not a number (one line, naming it and what to do)."""


@dataclass(frozen=True)
class EfsRates:
    client_mibps: float = CLIENT_MIBPS
    fs_read_mibps: float = FS_READ_MIBPS
    fs_write_mibps: float = FS_WRITE_MIBPS
    read_latency_ms: float = READ_LATENCY_MS
    write_latency_ms: float = WRITE_LATENCY_MS


_KNOBS = {
    "PETCTL_LOCAL_EFS_CLIENT_MIBPS": "client_mibps",
    "PETCTL_LOCAL_EFS_READ_MIBPS": "fs_read_mibps",
    "PETCTL_LOCAL_EFS_WRITE_MIBPS": "fs_write_mibps",
    "PETCTL_LOCAL_EFS_READ_LATENCY_MS": "read_latency_ms",
    "PETCTL_LOCAL_EFS_WRITE_LATENCY_MS": "write_latency_ms",
}


def rates_from_env(env: Mapping[str, str] | None = None) -> EfsRates | None:
    """The rates the daemon applies, or None when ``PETCTL_LOCAL_EFS_THROTTLE=0`` turns them off.

    Raises:
        EfsRateError: a knob is set to something other than a number (rates must be > 0).
    """
    env = os.environ if env is None else env
    switch = (env.get(SWITCH) or "1").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None
    if switch not in ("1", "true", "yes", "on"):
        raise EfsRateError(f"{SWITCH}={env.get(SWITCH)!r}: use 1 (AWS's EFS limits, the default) or 0 (off)")
    values = asdict(EfsRates())
    for name, field in _KNOBS.items():
        raw = env.get(name)
        if not raw:
            continue
        try:
            v = float(raw)
        except ValueError:
            v = -1.0
        low_ok = field.endswith("_ms") and v >= 0
        if not (v > 0 or low_ok) or v != v or v == float("inf"):
            what = "a number >= 0" if field.endswith("_ms") else "a number > 0"
            raise EfsRateError(f"{name}={raw!r}: use {what}, or {SWITCH}=0 to turn the EFS limits off")
        values[field] = v
    return EfsRates(**values)


def write_config(state_dir: Path, instance_id: str, rates: EfsRates) -> Path:
    """Write ``instances/<id>/efs-rate.json`` for the agent's pacing; its path."""
    cfg = {
        "client": instance_id,
        "efs_root": str(state_dir / "efs"),
        "state_dir": str(state_dir / "efs-rate"),
        "client_read_bps": rates.client_mibps * MIB,
        "client_write_bps": rates.client_mibps * MIB,
        "fs_read_bps": rates.fs_read_mibps * MIB,
        "fs_write_bps": rates.fs_write_mibps * MIB,
        "read_latency_s": rates.read_latency_ms / 1000,
        "write_latency_s": rates.write_latency_ms / 1000,
    }
    path = state_dir / "instances" / instance_id / "efs-rate.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, path)
    return path


def instance_env(state_dir: Path, instance_id: str, rates: EfsRates | None) -> dict[str, str]:
    """What a unit of ``instance_id`` gets: ``{ENV: config path, HOOK_ENV: HOOK}``, or nothing when
    off (the hook unset: the agent's plain I/O)."""
    if rates is None:
        return {}
    return {ENV: str(write_config(state_dir, instance_id, rates)), HOOK_ENV: HOOK}
