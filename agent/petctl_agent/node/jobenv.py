"""The job's own packages: its requirements, installed once per node into a cached environment.

The environment is a venv of the agent's Python, made without pip, whose ``site-packages`` comes
first and whose ``.pth`` adds the agent's own site directories after it (``site.addsitedir``, so
their ``.pth`` files run too). The workers run its ``python``: they see the job's packages, and
behind them torch and ``petctl_agent`` exactly as the agent sees them. Why a venv and not a
``--target`` directory on ``PYTHONPATH``: pip installing with ``--target`` does not see what is
installed already (it would install torch again), and ``PYTHONPATH`` entries run no ``.pth``
files (namespace packages, some plugins); a venv's ``sys.executable`` also stays in the job's
environment when a script starts a subprocess of Python.

pip runs in that environment (``<env>/bin/python -m pip``, the agent's pip through the ``.pth``)
with ``-c`` a constraints file that pins torch and petctl's own dependencies as installed: a
requirement can add packages and shadow others, never move what the agent runs on. Relative paths
in the requirements are the project's (pip runs in the node's copy of it), as under ``cd project &&
pip install -r requirements.txt``.

Cached: ``<envs>/<key>``, where the key hashes the requirements (the spec's text and digest), the
constraints and the Python version, and ``.petctl-env.json`` marks a finished install. A restart of
the agent, or of a warm-pool instance taken into service, finds it and installs nothing. A failed
install leaves no environment behind; its error is pip's own first ``ERROR:`` line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from petctl_agent.spec import JobSpec

log = logging.getLogger("petctl_agent")

#: What marks a finished environment (and what it holds: the packages pip installed, the time).
DONE = ".petctl-env.json"
#: petctl's extras whose dependencies the workers run on (pinned as installed, with torch); the
#: CLI's own (click, jinja2, ...) are not pinned: no worker imports them.
PINNED_EXTRAS = ("agent", "live")
#: The longest pip error line a reason carries.
ERROR_MAX = 300


class RequirementsError(Exception):
    """The job's requirements could not be installed; ``str()`` is pip's own error line."""


@dataclass(frozen=True)
class JobEnv:
    """A ready environment: its python, the seconds the install took (0 when cached)."""

    path: Path
    python: Path
    seconds: float
    cached: bool
    installed: tuple[str, ...]


def _name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1) if m else ""


def _extra(req: str) -> str | None:
    m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
    return m.group(1) if m else None


def constraints() -> str:
    """``NAME==VERSION`` lines: torch and petctl's own dependencies that the workers run on
    (those of :data:`PINNED_EXTRAS`), each as installed where the agent runs; what is not
    installed is not pinned."""
    names = ["torch"]
    try:
        reqs = metadata.requires("petctl") or []
    except metadata.PackageNotFoundError:
        reqs = []
    for r in reqs:
        extra = _extra(r)
        if extra in PINNED_EXTRAS:
            names.append(_name(r))
    lines, seen = [], set()
    for name in names:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if not key or key in seen:
            continue
        seen.add(key)
        try:
            lines.append(f"{key}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "".join(line + "\n" for line in lines)


def env_key(spec: JobSpec, pins: str) -> str:
    """The environment's cache key: the requirements, the constraints and the Python."""
    h = hashlib.sha256()
    for part in (spec.requirements, spec.requirements_sha256, spec.requirements_path, pins, sys.version):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def pip_error(output: str) -> str:
    """pip's own line that says what failed: its first ``ERROR:`` line (the one naming the
    package), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    picked = next((ln for ln in lines if ln.startswith("ERROR:")), lines[-1] if lines else "")
    return (picked or "pip failed without a message")[:ERROR_MAX]


def _site_dirs() -> list[str]:
    """The agent's site directories, in its own order (a venv's, and what its .pth files added)."""
    dirs = [p for p in sys.path if p and p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    for d in site.getsitepackages():
        if d not in dirs:
            dirs.append(d)
    return [d for d in dirs if os.path.isdir(d)]


def _make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    sp = next((path / "lib").glob("python3*/site-packages"))
    lines = [f"import site; site.addsitedir({d!r})\n" for d in _site_dirs()]
    (sp / "_petctl_agent.pth").write_text("".join(lines))
    return path / "bin" / "python"


def ensure(spec: JobSpec, code_dir: Path, envs: Path) -> JobEnv | None:
    """The job's environment, installed now unless cached; None when the job has no requirements.
    Raises :class:`RequirementsError` with pip's line when the install fails. Concurrent agents
    sharing ``envs`` (the local cloud: one per job) take turns; the second finds it done."""
    if not spec.requirements.strip():
        return None
    pins = constraints()
    key = env_key(spec, pins)
    path = envs / key
    envs.mkdir(parents=True, exist_ok=True)
    with open(envs / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = path / DONE
        if done.is_file():
            info = json.loads(done.read_text())
            log.info("job requirements: cached environment %s (installed in %.1fs)", path, info["seconds"])
            return JobEnv(path, path / "bin" / "python", 0.0, True, tuple(info.get("installed", [])))
        shutil.rmtree(path, ignore_errors=True)  # a half-made one (the node stopped mid-install)
        t0 = time.monotonic()
        try:
            python = _make_venv(path)
            (path / "constraints.txt").write_text(pins)
            if spec.requirements_path and spec.code_kind == "dir":
                reqfile = (code_dir / spec.requirements_path).resolve()
            else:
                reqfile = path / "requirements.txt"
                reqfile.write_text(spec.requirements)
            cmd = [
                str(python), "-m", "pip", "install", "--disable-pip-version-check",
                "--no-warn-script-location", "--progress-bar", "off",
                "-c", str(path / "constraints.txt"), "-r", str(reqfile),
            ]  # fmt: skip
            log.info("job requirements: installing into %s: %s", path, " ".join(cmd[3:]))
            cwd = code_dir if spec.code_kind == "dir" else path
            res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            for line in (res.stdout + res.stderr).splitlines():
                log.info("pip: %s", line)
            if res.returncode != 0:
                raise RequirementsError(pip_error(res.stderr or res.stdout))
            installed = tuple(re.findall(r"^Successfully installed (.*)$", res.stdout, re.M)[-1:])
            installed = tuple(installed[0].split()) if installed else ()
        except RequirementsError:
            shutil.rmtree(path, ignore_errors=True)
            raise
        except (OSError, subprocess.CalledProcessError, StopIteration) as e:
            shutil.rmtree(path, ignore_errors=True)
            raise RequirementsError(f"cannot make the job's environment in {path}: {e}") from e
        seconds = round(time.monotonic() - t0, 2)
        done.write_text(json.dumps({"seconds": seconds, "installed": list(installed), "key": key}))
        log.info("job requirements: installed %s in %.1fs", " ".join(installed) or "nothing new", seconds)
        return JobEnv(path, python, seconds, False, installed)
