"""The etcd server the rendezvous instance installs: the official release tarball, pinned.

Version: the latest patch of the 3.5 line. 3.5 is a supported line (etcd maintains the two
newest minor lines, 3.6 and 3.5), and the only supported one that still serves the v2 API
(``--enable-v2``; 3.6 removed the flag), which torch's ``etcd-v2``/``etcd`` rendezvous backends
need when a job selects them as the fallback. One pin then serves every backend; 3.5.33 carries
3.5.3's data-correctness fix and every later one.

SHA-256 of the release tarballs ``etcd-v3.5.33-linux-{amd64,arm64}.tar.gz`` (the files under
https://github.com/etcd-io/etcd/releases/download/v3.5.33/), cited from kubespray's pinned
checksums, ``roles/kubespray_defaults/vars/main/checksums.yml`` (``etcd_binary_checksums``, whose
``etcd_download_url`` is that same release URL), commit 46dbdd3994b32640bcd806b0097f50e8fdf1d514
(2026-08-21) of github.com/kubernetes-sigs/kubespray. The amd64 value is also the one other
public projects pin for this file. Never edit a value by hand without such a source.

Standard library only: the job template renders these into the rendezvous boot script, and the
local cloud reads them to stand its package etcd in for the tarball (docs/local.md).
"""

from __future__ import annotations

import re

ETCD_VERSION = "3.5.33"
#: etcd's name of each architecture (its tarballs' suffix) -> SHA-256 of that release tarball.
ETCD_SHA256 = {
    "amd64": "5025b5b24d81a9616b6e284ccd439b9a3df055ef8fdcdc142af3ec8f6a3b3c95",
    "arm64": "0764c5c0acef155f4bfa0487791cc5776adef66315bf16ec0653883bfd463a90",
}
#: EC2's architecture names (DescribeInstanceTypes ``SupportedArchitectures``) -> etcd's.
EC2_TO_ETCD_ARCH = {"x86_64": "amd64", "arm64": "arm64"}
#: The Amazon Linux 2023 image of each architecture: AWS's public SSM parameters.
AL2023_AMI_PARAMETERS = {
    "x86_64": "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64",
    "arm64": "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-arm64",
}
RELEASE_BASE = "https://github.com/etcd-io/etcd/releases/download"
#: The official tarball's URL with ``ARCH`` for the architecture: the boot script fills it in.
RELEASE_URL_PATTERN = re.compile(
    r"^https://github\.com/etcd-io/etcd/releases/download/v(\d+\.\d+\.\d+)/etcd-v\1-linux-(amd64|arm64)\.tar\.gz$"
)
#: The backends that speak etcd's v2 API, which etcd 3.5 serves only with ``--enable-v2``:
#: torch's fallbacks (python-etcd). petctl-etcd speaks v3 (agent/petctl_agent/rendezvous/), so a
#: default job's etcd runs without the v2 store.
ETCD_V2_BACKENDS = ("etcd-v2", "etcd")

#: A user's own copy: ``s3://bucket/key`` or ``https://host/path`` (no spaces or shell quoting).
USER_URL_RE = re.compile(
    r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[A-Za-z0-9!_.*()/+=,@-]+|https://[A-Za-z0-9.-]+(:\d+)?/[A-Za-z0-9!_.*()/+=,@%~-]+)$"
)
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def release_url(arch: str, version: str = ETCD_VERSION) -> str:
    """The official release tarball of ``version`` for etcd's architecture name ``arch``."""
    return f"{RELEASE_BASE}/v{version}/etcd-v{version}-linux-{arch}.tar.gz"
