"""``aws s3 cp`` and ``aws s3 ls``: one object between the instance's files and moto's S3, and the
CLI's listing of a prefix."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .base import Failed, Refused, client, inside_root


def s3_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise Refused(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[5:].partition("/")
    return bucket, key


def cp(rest: list[str], quiet: bool) -> None:
    if len(rest) != 2 or any(a.startswith("--") for a in rest):
        raise Refused(f"only 'aws s3 cp SRC DST' (one of them s3://) is emulated, not: {shlex.join(rest)}")
    src, dst = rest
    s3 = client("s3")
    if src.startswith("s3://") and dst == "-":  # to standard output, as the CLI
        bucket, key = s3_url(src)
        try:
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - as the CLI says it
            raise Failed(f"fatal error: {e}") from e
        sys.stdout.buffer.write(body)
        sys.stdout.buffer.flush()
        return
    if src.startswith("s3://") and not dst.startswith("s3://"):
        bucket, key = s3_url(src)
        path = Path(dst)
        if dst.endswith("/") or path.is_dir():
            path = path / key.rsplit("/", 1)[-1]
        inside_root(str(path), "destination")
        try:
            s3.download_file(bucket, key, str(path))
        except Exception as e:  # noqa: BLE001 - as the CLI says it
            raise Failed(f"fatal error: {e}") from e
        if not quiet:
            print(f"download: {src} to {path}")
    elif dst.startswith("s3://") and not src.startswith("s3://"):
        bucket, key = s3_url(dst)
        if src == "-":  # standard input
            if not key or key.endswith("/"):
                raise Refused("aws s3 cp - needs a destination key, not a prefix")
            try:
                s3.put_object(Bucket=bucket, Key=key, Body=sys.stdin.buffer.read())
            except Exception as e:  # noqa: BLE001
                raise Failed(f"upload failed: - to s3://{bucket}/{key} {e}") from e
            return
        if not key or key.endswith("/"):
            key += Path(src).name
        inside_root(src, "source")
        try:
            s3.upload_file(src, bucket, key)
        except Exception as e:  # noqa: BLE001
            raise Failed(f"upload failed: {src} to s3://{bucket}/{key} {e}") from e
        if not quiet:
            print(f"upload: {src} to s3://{bucket}/{key}")
    else:
        raise Refused(f"only local<->s3 copies are emulated, not {src} -> {dst}")


def ls(rest: list[str], quiet: bool) -> None:
    if len(rest) != 1:
        raise Refused(f"only 'aws s3 ls s3://BUCKET/PREFIX' is emulated, not: {shlex.join(rest)}")
    bucket, prefix = s3_url(rest[0])
    s3 = client("s3")
    lines = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            lines.append(" " * 27 + "PRE " + p["Prefix"][len(prefix) :])
        for o in page.get("Contents", []):
            when = o["LastModified"].strftime("%Y-%m-%d %H:%M:%S")
            lines.append(f"{when} {o['Size']:>10} {o['Key'][len(prefix) :]}")
    if not lines:
        raise Failed("", 1)  # as the CLI: nothing listed is exit 1, silently
    print("\n".join(lines))
