"""Read the job spec and fetch the job's code into the node work dir (``code_kind`` of docs/contracts.md)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from petctl_agent.spec import JobSpec, SpecError


def read_url(url: str, s3_client_factory: Any = None) -> bytes:
    """Read ``s3://bucket/key``, ``file:///path`` or a plain path."""
    u = urlparse(url)
    if u.scheme == "s3":
        if s3_client_factory is None:
            from petctl_agent.cloud import aws

            s3_client_factory = lambda: aws.client("s3")  # noqa: E731
        obj = s3_client_factory().get_object(Bucket=u.netloc, Key=u.path.lstrip("/"))
        return obj["Body"].read()
    path = u.path if u.scheme == "file" else url
    with open(path, "rb") as f:
        return f.read()


def load_spec(url: str, s3_client_factory: Any = None) -> JobSpec:
    """Fetch and validate the job spec at ``url`` (S3, ``file://`` or a local path)."""
    try:
        raw = read_url(url, s3_client_factory)
    except Exception as e:  # noqa: BLE001 - every way of not getting it is the same error to the user
        raise SpecError(f"cannot read the job spec at {url}: {e}") from e
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise SpecError(f"job spec at {url} is not JSON: {e}") from e
    return JobSpec.from_dict(data)


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
