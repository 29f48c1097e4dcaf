"""The bucket's copy of etcd's release: no rendezvous boot depends on GitHub.

``setup`` downloads the pinned etcd release for each architecture (x86_64 and arm64), checks it
against the SHA-256 pinned in :mod:`petctl.templates.etcd`, and puts it in the bucket under
``petctl/uploads/etcd/``, which every job's rendezvous role may read. ``run-job`` then points the
rendezvous boot at that copy (with the same pinned SHA-256, which the boot checks again before
unpacking), unless the job gives its own (``--rdzv-etcd-url``). A release that cannot be
downloaded, or that does not match its pin, is not copied: setup says so in a warning and the
boot downloads from GitHub as before. ``PETCTL_ETCD_RELEASE_BASE`` names another place to
download from (a mirror of GitHub's release files). The local cloud copies its stand-in for the
release (:mod:`petctl.local.etcd_release`), as its boots use that in place of GitHub's.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request

from petctl.context import Context
from petctl.storage import Upload
from petctl.templates import etcd

PREFIX = "petctl/uploads/etcd/"
DOWNLOAD_TIMEOUT_S = 60


def key(arch: str) -> str:
    """The bucket's copy of the pinned release for etcd's architecture name ``arch``."""
    return f"{PREFIX}etcd-v{etcd.ETCD_VERSION}-linux-{arch}.tar.gz"


def _download(arch: str) -> bytes:
    base = os.environ.get("PETCTL_ETCD_RELEASE_BASE") or etcd.RELEASE_BASE
    url = f"{base.rstrip('/')}/v{etcd.ETCD_VERSION}/etcd-v{etcd.ETCD_VERSION}-linux-{arch}.tar.gz"
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r:  # noqa: S310 - http(s) only
        return r.read()


def _release(ctx: Context, arch: str) -> tuple[bytes, str]:
    """(the release's bytes, the SHA-256 they must have)."""
    if ctx.local:
        from petctl.local import etcd_release, statedir

        path, sha256 = etcd_release.local_release(statedir.state_dir())
        return path.read_bytes(), sha256
    return _download(arch), etcd.ETCD_SHA256[arch]


def copy_release(ctx: Context, bucket: str, kms_key: str | None) -> list[str]:
    """Put each architecture's pinned release in ``bucket`` where it is missing; the keys that
    are there afterwards. Never fails setup: what cannot be copied is a warning."""
    gw, there = ctx.gateway(), []
    for arch in etcd.ETCD_SHA256:
        k = key(arch)
        try:
            if not gw.objects.exists(bucket, k):
                data, expected = _release(ctx, arch)
                actual = hashlib.sha256(data).hexdigest()
                if actual != expected:
                    raise ValueError(f"it has SHA-256 {actual}, not the pinned {expected}")
                gw.objects.put_object(bucket, Upload(k, data=data, description=f"etcd {arch}"), kms_key)
            there.append(k)
        except Exception as e:  # noqa: BLE001 - no network, a mirror without it, no access
            ctx.ui.warn(
                f"etcd {etcd.ETCD_VERSION} ({arch}) was not copied into s3://{bucket}/{PREFIX} ({e}); "
                "rendezvous servers will download it from GitHub at boot"
            )
    return there


def bucket_copy(ctx: Context, bucket: str, arch: str) -> tuple[str, str] | None:
    """``(s3 URL, pinned SHA-256)`` of the bucket's copy for EC2's architecture ``arch``, or None."""
    name = etcd.EC2_TO_ETCD_ARCH[arch]
    try:
        found = ctx.gateway().objects.exists(bucket, key(name))
    except Exception:  # noqa: BLE001 - cannot tell: the boot downloads from GitHub
        return None
    return (f"s3://{bucket}/{key(name)}", etcd.ETCD_SHA256[name]) if found else None
