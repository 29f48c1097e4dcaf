"""Fixtures for the local cloud tests: a real daemon in a temporary state dir.

Every fixture that starts a daemon stops it and checks that no process it
started survives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from localcloud_helpers import DAEMON_ENV, Cloud, assert_nothing_left

import petctl.local as local
from petctl.local import procs, statedir


@pytest.fixture(scope="session")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """One daemon shared by the tests of this directory (start-up costs seconds)."""
    state = tmp_path_factory.mktemp("local-cloud")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PETCTL_LOCAL_DIR", str(state))
        for k, v in DAEMON_ENV.items():
            mp.setenv(k, v)
        info = local.ensure_started(timeout=60)
        c = Cloud(state, info)
        try:
            yield c
        finally:
            try:
                c.instances()  # record every process group for the final check
                for data in (state / "instances").glob("*/root/var/lib/petctl/env.json"):
                    c.standin(data.relative_to(state / "instances").parts[0])
            finally:
                # Even when the daemon no longer answers: stop kills it and, from procs.json and
                # its marker, every process it started.
                res = local.stop()
            assert res["was_running"]
            assert_nothing_left(c, info["pid"])


@pytest.fixture
def local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, private state dir (for tests that start and stop their own daemon)."""
    d = tmp_path / "local"
    monkeypatch.setenv("PETCTL_LOCAL_DIR", str(d))
    for k, v in DAEMON_ENV.items():
        monkeypatch.setenv(k, v)
    yield d
    info = statedir.read_json(d / "cloud.json")
    local.stop()
    if info:
        assert not procs.is_alive(info["pid"])
