"""The wheel the instances install must be a complete petctl: CLI, agent and templates."""

from __future__ import annotations

import zipfile

from petctl import storage


def test_wheel_from_source_is_complete_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path))
    monkeypatch.delenv("PETCTL_DIST", raising=False)
    wheel = storage.dist_wheel()
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "petctl/cli.py" in names
    assert "petctl_agent/__init__.py" in names
    # every module of the agent's source tree ships, at its import path (agent/petctl_agent/x -> petctl_agent/x)
    agent_src = storage._source_root() / "agent"
    modules = {str(p.relative_to(agent_src)) for p in agent_src.rglob("*.py") if "__pycache__" not in p.parts}
    assert {"petctl_agent/node/agent.py", "petctl_agent/rendezvous/entry.py"} <= modules
    assert sorted(modules - names) == []
    assert "petctl/cfn_templates/infra.yaml.j2" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    assert storage.dist_wheel() == wheel  # cached by content hash: no second build


def test_dist_override_must_exist(monkeypatch, tmp_path):
    import pytest

    from petctl.errors import PetctlError

    monkeypatch.setenv("PETCTL_DIST", str(tmp_path / "missing.whl"))
    with pytest.raises(PetctlError, match="PETCTL_DIST=.*is not a file"):
        storage.dist_wheel()
