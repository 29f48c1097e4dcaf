"""What a job uploads: the user's script or directory (tarred), and petctl's own wheel.

Nothing here talks to AWS: the gateway puts the :class:`Upload` objects."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from petctl import __version__
from petctl.errors import ConfigError, PetctlError

# Never ship these from a user's directory.
_EXCLUDE_DIRS = {
    ".git",
    "__pycache__",
    ".venv",
    "venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
}
MAX_DIR_BYTES = 512 * 1024 * 1024


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key); raises a PetctlError naming a bad URL."""
    if not url.startswith("s3://") or "/" not in url[5:] or not url[5:].split("/", 1)[0]:
        raise ConfigError(f"{url!r} is not an S3 URL like s3://bucket/path")
    bucket, key = url[5:].split("/", 1)
    return bucket, key


@dataclass
class Upload:
    """One object to put in S3: from a local file, or from bytes."""

    key: str
    path: str | None = None
    data: bytes | None = None
    description: str = ""

    def size(self) -> int:
        if self.data is not None:
            return len(self.data)
        return os.path.getsize(self.path) if self.path else 0


def tar_directory(directory: Path) -> bytes:
    """A gzipped tar of ``directory`` (relative paths), skipping VCS and cache dirs."""
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for root, dirs, files in os.walk(directory):
            dirs[:] = sorted(d for d in dirs if d not in _EXCLUDE_DIRS)
            for f in sorted(files):
                full = Path(root) / f
                if full.is_symlink() and not full.exists():
                    continue
                total += full.stat().st_size
                if total > MAX_DIR_BYTES:
                    raise PetctlError(
                        f"{directory} is larger than {MAX_DIR_BYTES // 2**20} MiB; put data on EFS or S3, "
                        f"not in the code directory"
                    )
                tar.add(full, arcname=str(full.relative_to(directory)))
    return buf.getvalue()


# -- petctl's own distribution ------------------------------------------------


def dist_wheel() -> Path:
    """A wheel of the running petctl, so instances run the same version as this CLI.

    Order: ``$PETCTL_DIST`` (a prebuilt wheel); a wheel repacked from an installed
    (non-editable) distribution; a wheel built from the source checkout, cached by
    content hash under ``$PETCTL_HOME/dist``.
    """
    override = os.environ.get("PETCTL_DIST")
    if override:
        p = Path(override)
        if not p.is_file():
            raise PetctlError(f"PETCTL_DIST={override} is not a file; point it at a petctl wheel or unset it")
        return p
    from petctl import config

    cache = config.home() / "dist"
    source = _source_root()
    if source is not None:
        return _build_from_source(source, cache)
    return _repack_installed(cache)


def _source_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "setup.py").is_file() and (root / "agent").is_dir() else None


_SOURCE_PARTS = ("setup.py", "pyproject.toml", "README.md", "petctl", "agent", "cfn_templates")


def _source_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for sub in _SOURCE_PARTS:
        p = root / sub
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(x for x in p.rglob("*") if x.is_file() and "__pycache__" not in x.parts)
    return files


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for f in _source_files(root):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _build_from_source(root: Path, cache: Path) -> Path:
    """Build from a clean copy of the sources (a stale ``build/`` in the checkout must not leak in)."""
    out = cache / f"src-{_tree_hash(root)}"
    wheels = sorted(out.glob("petctl-*.whl")) if out.is_dir() else []
    if wheels:
        return wheels[-1]
    out.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "src"
        for f in _source_files(root):
            dest = copy / f.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        # Without build isolation first (fast, offline, uses the setuptools at hand); isolated if that fails.
        for isolation in (["--no-build-isolation"], []):
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "-q",
                *isolation,
                "-w",
                str(out),
                str(copy),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            wheels = sorted(out.glob("petctl-*.whl"))
            if proc.returncode == 0 and wheels:
                return wheels[-1]
            errors.append(proc.stderr.strip()[-300:])
    raise PetctlError(f"could not build the petctl wheel from {root}: {errors[-1]}")


def _repack_installed(cache: Path) -> Path:
    """Zip the installed distribution's files (RECORD included) back into a wheel."""
    try:
        dist = metadata.distribution("petctl")
    except metadata.PackageNotFoundError as e:
        raise PetctlError("petctl is not installed as a distribution; set PETCTL_DIST to a wheel") from e
    name = f"petctl-{__version__}-py3-none-any.whl"
    # Keyed by the installed RECORD (file hashes), not the version: a reinstall must not ship old code.
    record = hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()[:16]
    target = cache / f"installed-{record}" / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in dist.files or []:
            if str(f).startswith("..") or "__pycache__" in str(f):
                continue  # console scripts and bytecode are regenerated on install
            zf.write(f.locate(), str(f))
    os.replace(tmp, target)
    return target
