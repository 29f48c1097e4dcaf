"""Fetch the job's code into the node work dir (``code_kind`` of docs/contracts.md)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

from petctl_agent.spec import JobSpec, SpecError, read_url


def fetch_code(spec: JobSpec, dest: str | os.PathLike, s3_client_factory: Any = None) -> Path:
    """Download/copy the code and return the path of the script to run.

    - ``script``: ``code_url`` is the file itself.
    - ``s3``: a user ``s3://`` URL; a URL ending in ``/`` is a prefix and ``script`` is appended.
    - ``dir``: ``code_url`` is a ``.tar.gz`` unpacked into ``dest``; ``script`` is a path inside it.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    url = spec.code_url
    if spec.code_kind == "s3" and url.endswith("/"):
        url = url + spec.script
    try:
        data = read_url(url, s3_client_factory)
    except Exception as e:  # noqa: BLE001
        raise SpecError(f"cannot fetch the job code from {url}: {e}") from e
    if spec.code_kind == "dir":
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
            tf.extractall(dest, filter="data")  # 'data' refuses absolute paths, .., devices
        target = (dest / spec.script).resolve()
        if not target.is_file() or dest.resolve() not in target.parents:
            raise SpecError(f"script {spec.script!r} not found inside the code archive {url}")
        return target
    target = dest / Path(spec.script).name
    tmp = target.with_suffix(target.suffix + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target
