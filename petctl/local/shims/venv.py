"""``python3.11 -m venv DIR``: the instance's environment is a link to its job's cached one, made
once per job from this machine's Python, with a ``bin/pip`` of the pip shim (:mod:`.pip`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

from .base import SCRIPT, Failed, Refused, inside_root, locked, log, state_dir


def _site_dirs() -> list[str]:
    import sysconfig

    dirs = []
    for key in ("purelib", "platlib"):
        d = sysconfig.get_paths()[key]
        if d not in dirs:
            dirs.append(d)
    return dirs


def python(args: list[str]) -> None:
    """``python3.11 -m venv DIR``: DIR becomes a link to this job's cached environment
    (``<state>/venvs/<job>/<name>``), made once per job from this machine's Python."""
    if len(args) != 3 or args[:2] != ["-m", "venv"]:
        raise Refused(f"only 'python3.11 -m venv DIR' is emulated, not: python3.11 {shlex.join(args)}")
    target = inside_root(args[2], "venv directory")
    job = os.environ.get("PETCTL_LOCAL_JOB") or "no-job"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job + target.name):
        raise Refused(f"cannot key a cache on job {job!r} / {target.name!r}")
    cache = state_dir() / "venvs" / job / target.name
    fd = locked(cache.with_name(f".{target.name}.lock"))
    try:
        pip = cache / "bin" / "pip"
        pip_shim = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(str(SCRIPT))} pip {shlex.quote(str(cache))} "$@"\n'
        if not (cache / ".petctl-local-venv").exists():
            made = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(cache)], check=True)
            site = next((cache / "lib").glob("python3*/site-packages"))
            # This machine's packages (torch, boto3, …) sit behind the environment's own site-packages:
            # what pip installs into it comes first.
            (site / "_petctl_local.pth").write_text("".join(d + "\n" for d in _site_dirs()))
            pip.write_text(pip_shim)
            pip.chmod(0o755)
            (cache / ".petctl-local-venv").write_text(json.dumps({"python": sys.version.split()[0]}))
            log(
                "python3.11",
                f"made {cache} ({time.monotonic() - made:.1f}s; Python {sys.version.split()[0]})",
            )
        elif pip.read_text() != pip_shim:
            # The job's environment outlives a move of the shims (it is kept in the state dir): its
            # pip shim must name the shims' entry of now. Rewritten only when it differs, as another
            # instance may be running it.
            pip.write_text(pip_shim)
    finally:
        os.close(fd)
    if target.is_symlink():
        if target.resolve() != cache.resolve():
            raise Failed(f"Error: {target} exists and is another environment", 1)
    else:
        if target.exists():
            if not target.is_dir() or any(target.iterdir()):
                raise Failed(
                    f"Error: {target} exists and is not empty (the local cloud links it to {cache})", 1
                )
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(cache, target_is_directory=True)
    log("python3.11", f"{args[2]} -> {cache}")
