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


AGENT_BREAKS = [
    # the worker side never reaches the agent's machinery
    ({"petctl_agent.checkpointing.drain": {"petctl_agent.node.agent"}}, "checkpointing room may import"),
    ({"petctl_agent.checkpoint": {"petctl_agent.cloud.aws"}}, "checkpoint room may import"),
    # a lower room never imports a higher one, and the contracts import no room
    ({"petctl_agent.cloud.status": {"petctl_agent.elastic.agent"}}, "cloud room may import"),
    ({"petctl_agent.elastic.handlers": {"petctl_agent.worker.env"}}, "elastic room may import"),
    ({"petctl_agent.settings": {"petctl_agent.cloud.imds"}}, "contracts room may import no other room"),
    ({"petctl_agent.rendezvous.handler": {"petctl_agent.elastic.handlers"}}, "rendezvous room may import"),
    ({"petctl_agent.node.agent": {"boto3"}}, "only the cloud room talks to AWS"),
    ({"petctl_agent.helpers": set()}, "is in no agent room"),
]


@pytest.mark.parametrize(("graph", "rule"), AGENT_BREAKS)
def test_each_agent_room_rule_catches_its_break(graph: dict[str, set[str]], rule: str) -> None:
    problems = graph_check.broken_rules(graph)
    assert any(rule in p for p in problems), problems


def test_agent_rooms_allow_the_downward_edges() -> None:
    graph = {
        "petctl_agent.main": {"petctl_agent.node.agent", "petctl_agent.elastic.tracebacks"},
        "petctl_agent.node.agent": {"petctl_agent.worker.env", "petctl_agent.cloud.fetch"},
        "petctl_agent.worker.env": {"petctl_agent.elastic.handlers", "petctl_agent.worker.forkserver"},
        "petctl_agent.elastic.handlers": {"petctl_agent.rendezvous", "petctl_agent.settings"},
        "petctl_agent.cloud.aws": {"boto3"},
        "petctl_agent.checkpoint": {"petctl_agent.checkpointing.files", "petctl_agent.distributed"},
        "petctl_agent.checkpointing.drain": {"petctl_agent.distributed", "petctl_agent"},
    }
    assert graph_check.broken_rules(graph) == []


def test_every_agent_module_is_in_a_room_and_connected() -> None:
    known = graph_check.modules()
    graph = graph_check.imports(known)
    agent = [m for m in known if m.startswith("petctl_agent")]
    assert {"petctl_agent.node.agent", "petctl_agent.elastic.agent", "petctl_agent.cloud.aws"} <= set(agent)
    assert {m: graph_check.room(m) for m in agent if graph_check.room(m) is None} == {}
    assert graph_check.unconnected(graph, known) == []
    # the rooms have arrows between them: the node imports the elastic agent, which imports cloud
    assert "petctl_agent.elastic.agent" in graph["petctl_agent.node.agent"] | set().union(
        *(graph[m] for m in agent if m.startswith("petctl_agent.node"))
    )
    # a module nothing imports and that imports nothing is caught; a room's docstring-only face is not
    lonely = {"petctl_agent.node.orphan": set(), "petctl_agent.node": set()}
    assert graph_check.unconnected(lonely, {"petctl_agent.node": known["petctl_agent.node"]}) == [
        "petctl_agent.node.orphan is unconnected: no module imports it and it imports none"
    ]


def test_each_rooms_face_says_what_it_may_import() -> None:
    """A room's __init__ says in words what ROOM_MAY_IMPORT enforces."""
    import ast
    import re

    known = graph_check.modules()
    for package, name in graph_check.AGENT_ROOMS.items():
        path = known[package]
        if path.name != "__init__.py" or package == "petctl_agent":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        line = next((x for x in doc.splitlines() if x.startswith("May import:")), None)
        assert line is not None, f"{path}: no 'May import:' line"
        said = {r for r in graph_check.ROOM_MAY_IMPORT if re.search(rf"\b{r}\b", line)}
        assert said == graph_check.ROOM_MAY_IMPORT[name], (package, line)


def test_bench_imports_point_one_way(tmp_path: Path) -> None:
    """bench/ (benchmarks, simulators, their harness): no import cycle; rdzv_sim uses rdzv_light, not back."""
    graph = graph_check.bench_imports()
    assert "bench.rdzv_light" in graph["bench.rdzv_sim"] and "bench.harness" in graph["bench.benchlib"]
    assert graph_check.cycles(graph) == []
    (tmp_path / "a.py").write_text("def f():\n    from b import g\n")  # a lazy import counts too
    (tmp_path / "b.py").write_text("import a\n")
    assert graph_check.cycles(graph_check.bench_imports(tmp_path)) == [["bench.a", "bench.b"]]
