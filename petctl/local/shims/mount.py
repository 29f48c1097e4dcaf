"""``mount -t efs``: an EFS mount is a symlink to the local cloud's directory of that file
system. The daemon mounts with the same code what a unit's ``RequiresMountsFor=`` names."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

from .base import Failed, Refused, client, inside_root, log, root, state_dir

EFS_MOUNT_OPTIONS = {"tls", "noresvport", "_netdev", "iam", "rw"}


def mounts_file(r: Path) -> Path:
    return r / "run" / "petctl-local" / "mounts.json"


def mounted(r: Path) -> dict[str, str]:
    """Mount point (path inside the root) -> what is mounted there (``fs-…:/``)."""
    try:
        return json.loads(mounts_file(r).read_text())
    except (OSError, ValueError):
        return {}


def efs_mount(
    r: Path, state: Path, source: str, target: Path, options: set[str], efs: Any = None, az: str | None = None
) -> None:
    """Mount EFS ``source`` (``fs-id:/``) at ``target``: the target directory becomes a symlink to
    ``<state>/efs/<fs-id>``. Checks what mount.efs would: the file system exists and has a mount
    target in this instance's zone; the mount point is an existing directory, not mounted yet."""
    m = re.fullmatch(r"(fs-[0-9a-f]{8,40}):(/.*)", source)
    if not m:
        raise Refused(f"mount -t efs needs SOURCE fs-<id>:/ (got {source!r})")
    fs_id, sub = m.groups()
    if sub != "/":
        raise Refused(f"only the file system's root (fs-id:/) is mounted, not {sub!r}")
    bad = options - EFS_MOUNT_OPTIONS
    if bad:
        raise Refused(
            f"mount option(s) {', '.join(sorted(bad))} not emulated (known: {', '.join(sorted(EFS_MOUNT_OPTIONS))})"
        )
    key = "/" + str(target.relative_to(r)) if target != r else "/"
    if key in mounted(r) or target.is_symlink():
        raise Failed(f"mount: {target}: {source} already mounted or mount point busy.", 32)
    if not target.is_dir():
        raise Failed(f"mount: {target}: mount point does not exist.", 32)
    efs = efs or client("efs")
    try:
        efs.describe_file_systems(FileSystemId=fs_id)
        targets = efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]
    except Exception as e:  # noqa: BLE001 - reported as mount.efs would
        raise Failed(f"mount.efs: cannot find file system {fs_id}: {e}", 32) from e
    az = az or os.environ.get("PETCTL_LOCAL_AZ")
    if az and not any(t.get("AvailabilityZoneName") == az for t in targets):
        raise Failed(f"mount.efs: file system {fs_id} has no mount target in {az} (this instance's zone)", 32)
    if any(target.iterdir()):
        raise Failed(f"mount: {target}: mount point is not empty (the local cloud mounts by symlink)", 32)
    efs_dir = state / "efs" / fs_id
    efs_dir.mkdir(parents=True, exist_ok=True)
    target.rmdir()
    target.symlink_to(efs_dir, target_is_directory=True)
    table = mounted(r)
    table[key] = source
    mounts_file(r).parent.mkdir(parents=True, exist_ok=True)
    mounts_file(r).write_text(json.dumps(table, indent=2))


def fstab_entry(r: Path, mountpoint: Path) -> tuple[str, str, set[str]] | None:
    """(source, type, options) of the instance's /etc/fstab line for ``mountpoint``."""
    try:
        lines = (r / "etc" / "fstab").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) >= 4 and not f[0].startswith("#") and f[1] == str(mountpoint):
            return f[0], f[2], set(f[3].split(","))
    return None


def mount(args: list[str]) -> None:
    """``mount -t efs [-o OPTS] fs-id:/ DIR``."""
    fstype, options, pos = None, "", []
    it = iter(args)
    for a in it:
        if a == "-t":
            fstype = next(it, None)
        elif a == "-o":
            options = next(it, "")
        elif a.startswith("-"):
            raise Refused(f"option {a} not emulated: only 'mount -t efs [-o OPTS] fs-id:/ DIR'")
        else:
            pos.append(a)
    if fstype != "efs" or len(pos) != 2:
        raise Refused(f"only 'mount -t efs [-o OPTS] fs-id:/ DIR' is emulated, not: mount {shlex.join(args)}")
    r = root()
    target = inside_root(pos[1], "mount point")
    efs_mount(r, state_dir(), pos[0], target, {o for o in options.split(",") if o})
    log("mount", f"{pos[0]} on {pos[1]} -> {state_dir() / 'efs' / pos[0].split(':')[0]}")
