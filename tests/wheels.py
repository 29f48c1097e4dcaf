"""A tiny pure-Python wheel, written by hand in a test: a package no index has and nothing here
installed, for the job requirements' tests (no network, no build backend)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

#: The package the tests install: one module, one function.
NAME, VERSION = "tinywords", "0.1"
MODULE = "def count(text):\n    return len(text.split())\n"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build(dest: Path, name: str = NAME, version: str = VERSION, module: str = MODULE) -> Path:
    """Write ``<name>-<version>-py3-none-any.whl`` (module ``<name>``) into ``dest``; its path."""
    dest.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{info}/RECORD,,\n"
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return path
