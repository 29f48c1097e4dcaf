"""The import graph keeps docs/architecture.md's layers (scripts/import_graph.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", _PATH)
graph_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph_check)


def test_the_code_keeps_its_layers() -> None:
    graph = graph_check.imports(graph_check.modules())
    # the reader sees the layers at all: these edges exist today
    assert "petctl.gateway.session" in graph and "boto3" in graph["petctl.gateway.session"]
    assert "petctl_agent.spec" in graph["petctl.jobs.planning"] | graph.get("petctl.naming", set())
    assert graph_check.broken_rules(graph) == []


@pytest.mark.parametrize(
    ("graph", "rule"),
    [
        ({"petctl.a": {"petctl.b"}, "petctl.b": {"petctl.a"}}, "import cycle"),
        ({"petctl_agent.node.agent": {"petctl.naming"}, "petctl.naming": set()}, "never imports petctl"),
        ({"petctl.jobs.apply": {"boto3"}}, "only petctl.gateway talks to AWS"),
        ({"petctl.jobs.apply": {"petctl.render"}, "petctl.render": set()}, "never imports the CLI"),
        ({"petctl.gateway.groups": {"petctl.jobs.state"}, "petctl.jobs.state": set()}, "no layer above"),
        (
            {"petctl.jobs.apply": {"petctl_agent.node.agent"}, "petctl_agent.node.agent": set()},
            "stdlib contracts",
        ),
        ({"petctl.context": {"petctl.local.daemon"}, "petctl.local.daemon": set()}, "local.client only"),
    ],
)
def test_each_rule_catches_its_break(graph: dict[str, set[str]], rule: str) -> None:
    problems = graph_check.broken_rules(graph)
    assert any(rule in p for p in problems), problems


def test_allowed_edges_pass() -> None:
    graph = {
        "petctl.gateway.groups": {"boto3"},
        "petctl.local.shims": {"boto3"},
        "petctl.jobs.planning": {"petctl_agent.spec"},
        "petctl_agent.spec": set(),
        "petctl.context": {"petctl.local.client"},
        "petctl.local.client": set(),
    }
    assert graph_check.broken_rules(graph) == []
