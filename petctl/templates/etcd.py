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


# ---- how petctl runs etcd -------------------------------------------------------------
#: A watch progress notification on every quiet watch this often. Without it (etcd's default:
#: 10 min) a watch carries nothing while membership is steady, and a connection that EC2's
#: connection tracking forgot (350 s idle on Nitro v6 types: no FIN, no RST) reads as alive
#: forever. The agent takes 3 intervals of silence as a dead watch (``WATCH_SILENCE`` in
#: agent/petctl_agent/rendezvous/etcd_transport.py, 30 s) and watches again. A flag of etcd 3.5 and
#: of 3.4's later releases (Debian's 3.4.23 has it); 3.6 also takes
#: ``--watch-progress-notify-interval``.
PROGRESS_NOTIFY_INTERVAL = "10s"
#: Compaction by revision: every 5 minutes etcd forgets the history older than the newest
#: 100,000 revisions. A round writes about 2N+4 keys, so that is ~50 rounds at 1,000 nodes and
#: thousands at 8, tens of MB at most; a watch that resumes from a compacted revision reads
#: once and goes on (etcdv3.Compacted). Without it the history grows by every round forever.
AUTO_COMPACTION_RETENTION = 100_000
#: The backend's size limit, explicit (etcd's default is the same 2 GiB, its recommended
#: maximum 8 GiB): with compaction the database holds the live keys plus ~100,000 revisions of
#: history, tens of MB, and bbolt reuses freed pages; the rendezvous server's 2 GiB of memory
#: (t3.small) is what keeps it from being larger. Past it etcd raises NOSPACE and refuses writes.
QUOTA_BACKEND_BYTES = 2 * 1024**3
#: The flags every etcd petctl starts gets: the job's rendezvous server (user data, which the
#: local cloud runs too) and the test harness (bench/harness.py).
SERVER_FLAGS: tuple[str, ...] = (
    "--experimental-watch-progress-notify-interval", PROGRESS_NOTIFY_INTERVAL,
    "--auto-compaction-mode", "revision",
    "--auto-compaction-retention", str(AUTO_COMPACTION_RETENTION),
    "--quota-backend-bytes", str(QUOTA_BACKEND_BYTES),
)  # fmt: skip
