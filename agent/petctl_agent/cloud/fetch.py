"""Read the job spec and fetch the job's code into the node work dir (``code_kind`` of docs/contracts.md)."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from petctl_agent.spec import JobSpec, SpecError

log = logging.getLogger("petctl_agent")


#: S3 answers that no retry changes: the object or bucket is not there, or this role may not read it
PERMANENT_S3 = {"NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidObjectState", "404", "403", "NotFound"}


def _retry_seconds() -> float:
    """How long a transient read error is retried (``PETCTL_FETCH_RETRY_SECONDS``, default 300)."""
    return float(os.environ.get("PETCTL_FETCH_RETRY_SECONDS") or 300)


def transient(e: BaseException) -> bool:
    """Is ``e`` an error a later try may not meet: S3's 5xx, throttling, a timeout, a reset or
    refused connection? Not: the object or bucket missing, access denied, a local file missing."""
    code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(e, "response") else None
    if code is not None:
        return str(code) not in PERMANENT_S3
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # no botocore: only the S3 path raises those
        return False
    return isinstance(e, (BotoConnectionError, HTTPClientError))


def read_url(url: str, s3_client_factory: Any = None, sleep: Any = time.sleep) -> bytes:
    """Read ``s3://bucket/key``, ``file:///path`` or a plain path.

    An S3 read that fails transiently (:func:`transient`) is tried again, with backoff from 1 s to
    30 s, for up to ``PETCTL_FETCH_RETRY_SECONDS`` (300 s): botocore's own retries end within
    seconds, and a failed fetch is a terminal failure of the node (its group replaces it and the
    failure counts towards the job's stop), which a minute of S3 trouble must not cost.
    """
    u = urlparse(url)
    if u.scheme != "s3":
        path = u.path if u.scheme == "file" else url
        with open(path, "rb") as f:
            return f.read()
    if s3_client_factory is None:
        from petctl_agent.cloud import aws

        s3_client_factory = lambda: aws.client("s3")  # noqa: E731
    deadline = time.monotonic() + _retry_seconds()
    delay = 1.0
    while True:
        try:
            obj = s3_client_factory().get_object(Bucket=u.netloc, Key=u.path.lstrip("/"))
            return obj["Body"].read()
        except Exception as e:  # noqa: BLE001 - classified below; the permanent ones raise at once
            left = deadline - time.monotonic()
            if not transient(e) or left <= 0:
                raise
            log.warning("reading %s failed (%s); trying again in %.0f s", url, e, min(delay, left))
            sleep(min(delay, left))
            delay = min(delay * 2, 30.0)


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
