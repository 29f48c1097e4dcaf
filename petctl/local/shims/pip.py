"""``<venv>/bin/pip install``: a wheel file is really installed into the job's cached environment
(:mod:`.venv`); every other requirement must already be satisfied by this machine's packages, as
the local cloud reaches no package index."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from .base import Failed, Refused, inside_root, locked, log

#: Where a pip --index-url may point (the boot scripts' CPU torch index, and PyPI's).
PIP_INDEXES = ("https://download.pytorch.org/whl/cpu", "https://pypi.org/simple")


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _pinned(req: Any) -> bool:
    return any(s.operator in ("==", "===") for s in req.specifier)


def _check_requirement(req: Any, what: str) -> str:
    """``req`` must already be satisfied on this machine (there is no package index here)."""
    have = _installed_version(req.name)
    if have is None:
        raise Failed(
            f"ERROR: No matching distribution found for {req} (the local cloud has no package index: "
            f"install it into {sys.prefix} first)",
            1,
        )
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        raise Failed(
            f"ERROR: {req} is not what this machine has ({req.name} {have}) and the local cloud has no "
            f"package index"
            + (": run the job with --torch-version matching it" if req.name.lower() == "torch" else ""),
            1,
        )
    return have


def _wheel_requirements(wheel: Path, extras: set[str]) -> list[Any]:
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise Failed(f"ERROR: {wheel} is not a valid wheel (no .dist-info/METADATA)", 1)
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras or {""}):
                reqs.append(r)
    return reqs


def pip(args: list[str]) -> None:
    """``<venv>/bin/pip install [--quiet] [--upgrade] [--no-deps] [--index-url URL] REQ…``.

    A wheel file is really installed into the (per-job, cached) environment, once per wheel
    content; every other requirement, and every dependency of the wheel's requested extras, must
    already be satisfied by this machine's packages (no index is reached). An unpinned torch is
    refused, like any requirement this machine cannot satisfy."""
    from packaging.requirements import InvalidRequirement, Requirement

    if not args:
        raise Refused("pip needs the environment it belongs to")
    env, args = Path(args[0]), args[1:]
    if not args or args[0] != "install":
        raise Refused(f"only 'pip install …' is emulated, not: pip {shlex.join(args)}")
    reqs, index, no_deps = [], None, False
    it = iter(args[1:])
    for a in it:
        if a in ("--quiet", "-q", "--upgrade", "-U", "--no-cache-dir"):
            continue
        if a == "--no-deps":
            no_deps = True
            continue
        if a == "--index-url":
            index = next(it, "")
            if index not in PIP_INDEXES:
                raise Refused(f"--index-url {index} not known (known: {', '.join(PIP_INDEXES)})")
        elif a.startswith("-"):
            raise Refused(f"pip option {a} not emulated")
        else:
            reqs.append(a)
    if not reqs:
        raise Refused("pip install needs a requirement")
    wheels, plain = [], []
    for raw in reqs:
        m = re.fullmatch(r"(.+\.whl)(?:\[([A-Za-z0-9_,.-]+)\])?", raw)
        if m:
            wheels.append((Path(m.group(1)), set(filter(None, (m.group(2) or "").split(",")))))
            continue
        try:
            plain.append(Requirement(raw))
        except InvalidRequirement as e:
            raise Refused(f"not a requirement or a wheel file: {raw!r} ({e})") from e
    # petctl's rule: torch is never installed unpinned, neither named alone nor as a dependency of
    # a wheel (its pin must be on the same command line, so resolving can never move it).
    torch_pinned = any(r.name.lower() == "torch" and _pinned(r) for r in plain)
    for r in plain:
        if r.name.lower() == "torch" and not _pinned(r):
            raise Refused(f"an unpinned torch ({r}) is never installed: pin torch==<version>")
    for wheel, extras in wheels:
        _install_wheel(env, wheel, extras, torch_pinned, no_deps)
    for req in plain:
        have = _check_requirement(req, "pip install")
        log(
            "pip",
            f"{req}: this machine's {req.name} {have}" + (f" (index {index} not used)" if index else ""),
        )


def _install_wheel(
    env: Path, wheel: Path, extras: set[str], torch_pinned: bool, no_deps: bool = False
) -> None:
    inside_root(str(wheel), "wheel")
    if not wheel.is_file():
        raise Failed(f"ERROR: Could not install packages: [Errno 2] No such file or directory: '{wheel}'", 1)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    what = f"{wheel.name}[{','.join(sorted(extras))}]"
    for req in [] if no_deps else _wheel_requirements(wheel, extras):
        if req.name.lower() == "torch" and not torch_pinned:
            raise Refused(f"{what} depends on torch ({req}): pin torch==<version> on the same command line")
        _check_requirement(req, what)
    marker = env / ".petctl-local-wheel"
    fd = locked(env / ".pip.lock")
    try:
        if marker.exists() and marker.read_text() == digest:
            log("pip", f"{wheel.name} ({digest[:12]}) already in this job's environment")
            return
        t0 = time.monotonic()
        cmd = [
            str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
            "--ignore-installed", "--disable-pip-version-check", "--no-warn-script-location", str(wheel),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise Failed(f"ERROR: installing {wheel.name} failed:\n{res.stdout}{res.stderr}", res.returncode)
        marker.write_text(digest)
        log("pip", f"installed {wheel.name} ({digest[:12]}) into {env} in {time.monotonic() - t0:.1f}s")
    finally:
        os.close(fd)
