"""``dnf``: installs nothing; every package a boot script installs has a local stand-in."""

from __future__ import annotations

import shlex

from .base import Refused, log

#: dnf packages the boot scripts install, and what stands in for each locally.
DNF_PACKAGES = {
    "amazon-efs-utils": "the mount shim (mount -t efs onto the local EFS directory)",
    "python3.11": "the python3.11 shim (venvs of this machine's Python)",
    "python3.11-pip": "the pip shim of those venvs",
    "openssl": "this machine's openssl (a host tool of every instance)",
    "tar": "this machine's tar (a host tool of every instance)",
    "gzip": "this machine's gzip (a host tool of every instance)",
}


def dnf(args: list[str]) -> None:
    """``dnf install -y PKG…``: nothing is installed; each package must have a local stand-in."""
    rest = [a for a in args if a not in ("-y", "--assumeyes", "-q", "--quiet")]
    if "-y" not in args and "--assumeyes" not in args:
        raise Refused(
            f"only 'dnf install -y PKG...' is emulated (a boot has no one to answer a prompt): {args}"
        )
    if not rest or rest[0] != "install" or len(rest) < 2:
        raise Refused(f"only 'dnf install -y PKG...' is emulated, not: dnf {shlex.join(args)}")
    unknown = [p for p in rest[1:] if p not in DNF_PACKAGES]
    if unknown:
        raise Refused(
            f"no local stand-in for package(s) {', '.join(unknown)}: add one to petctl/local/shims/dnf.py "
            f"(DNF_PACKAGES) and docs/local.md"
        )
    for p in rest[1:]:
        log("dnf", f"{p}: not installed; provided by {DNF_PACKAGES[p]}")
