"""The whole product on the local cloud, through the CLI a user types: each test gets its own
petctl home and local cloud, stopped (with every process it started) when the test ends."""

from __future__ import annotations

import pytest


@pytest.fixture
def local_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PETCTL_LOCAL_DIR", str(tmp_path / "home" / "local"))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield tmp_path / "home"
    from petctl import local

    local.stop()
