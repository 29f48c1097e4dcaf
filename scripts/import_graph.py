"""Check the import graph of petctl/ and agent/ against docs/architecture.md's layers (and bench/'s).

    python scripts/import_graph.py            # exit 1 and one line per broken rule
    python scripts/import_graph.py --edges    # also print every module -> module edge

It reads imports as text (ast), so it runs without the dependencies installed. Imports inside a
function count too: a lazy import is still a dependency. The rules:

- no cycle among modules;
- the agent (``petctl_agent``) never imports ``petctl``;
- outside ``petctl.gateway`` and ``petctl.local`` (the emulator), nothing in ``petctl`` imports
  boto3 or botocore;
- the job and infra layers never import the CLI (``petctl.cli``, ``petctl.commands``,
  ``petctl.render``), and the gateway imports none of the layers above it;
- ``petctl`` imports from the agent only its standard-library contracts (``spec``, ``settings``);
- the CLI's job code never imports the local cloud's daemon side;
- the agent's rooms (``AGENT_ROOMS``) import only the rooms below them (``ROOM_MAY_IMPORT``; a room's
  ``__init__`` says the same in words), every agent module is in a room, and only ``cloud`` talks
  to AWS;
- every agent module imports or is imported by another one, but for a room's face (an ``__init__``
  that only says what the room holds);
- no cycle among bench/'s modules either (the benchmarks, simulators and their harness import each
  other by bare name, bench/ on ``sys.path``): its imports point one way, as rdzv_sim -> rdzv_light.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"petctl": ROOT / "petctl", "petctl_agent": ROOT / "agent" / "petctl_agent"}
BENCH = ROOT / "bench"
AGENT_CONTRACTS = {"petctl_agent", "petctl_agent.spec", "petctl_agent.settings"}
CLI_LAYER = ("petctl.cli", "petctl.commands", "petctl.render")
UPPER_LAYERS = (*CLI_LAYER, "petctl.jobs", "petctl.infra", "petctl.timeline", "petctl.context")
# The daemon side of the local cloud; the CLI reaches the local cloud through petctl.local.client.
DAEMON_SIDE = (
    "petctl.local.daemon",
    "petctl.local.reconciler",
    "petctl.local.moto_patches",
    "petctl.local.moto_autoscaling",
    "petctl.local.moto_cloudformation",
    "petctl.local.moto_ec2",
    "petctl.local.moto_logs",
    "petctl.local.moto_s3",
    "petctl.local.shims",
    "petctl.local.starting",
)


# The agent's rooms (docs/architecture.md): the longest prefix names a module's room.
AGENT_ROOMS = {
    "petctl_agent": "contracts",  # DRAIN_EXIT_CODE; spec, settings, knobs, workarounds: stdlib only
    "petctl_agent.spec": "contracts",
    "petctl_agent.settings": "contracts",
    "petctl_agent.workarounds": "contracts",
    "petctl_agent.filelocks": "contracts",  # flock helpers of the snapshot store and its persister
    "petctl_agent.knobs": "contracts",  # the workers' PETCTL_* variables, one reader each
    "petctl_agent.distributed": "distributed",  # user scripts' face
    "petctl_agent.checkpointing": "checkpointing",
    "petctl_agent.checkpoint": "checkpoint",  # user scripts' face
    "petctl_agent.live": "live",  # live membership (torchft): the training loop's face and the lighthouse
    "petctl_agent.cloud": "cloud",
    "petctl_agent.rendezvous": "rendezvous",
    "petctl_agent.elastic": "elastic",
    "petctl_agent.worker": "worker",
    "petctl_agent.node": "node",
    "petctl_agent.main": "main",  # the petctl-agent command
}
# What each room may import besides itself: a strict order, so no two rooms import each other. The
# worker side (distributed, checkpointing, checkpoint) never reaches the agent's machinery.
ROOM_MAY_IMPORT = {
    "contracts": set(),
    "distributed": {"contracts"},
    "checkpointing": {"contracts", "distributed"},
    "checkpoint": {"contracts", "distributed", "checkpointing"},
    "live": {"contracts"},
    "cloud": {"contracts"},
    "rendezvous": {"contracts"},
    "elastic": {"contracts", "cloud", "rendezvous"},
    "worker": {"contracts", "distributed", "elastic"},
    "node": {"contracts", "cloud", "rendezvous", "elastic", "worker"},
    "main": {"contracts", "cloud", "elastic", "node"},
}


def room(module: str) -> str | None:
    """The agent room ``module`` lives in (None outside the agent, or in no room)."""
    if module != "petctl_agent" and not module.startswith("petctl_agent."):
        return None
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = AGENT_ROOMS.get(".".join(parts[:n]))
        if name is not None and (n > 1 or module == "petctl_agent"):
            return name
    return None


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports (the agent's ``agent.x`` spelling maps to petctl_agent.x)."""
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                for alias in node.names:
                    # ``from pkg import submodule`` depends on the submodule, not on pkg's __init__
                    sub = f"{target}.{alias.name}"
                    names.add(
                        sub if sub in known or sub.replace("agent.", "petctl_agent.", 1) in known else target
                    )
        resolved = set()
        for name in names:
            if name.startswith("agent."):
                name = "petctl_agent." + name[len("agent.") :]
            # the longest known module the name starts with (``from x import y`` may name a class)
            while name and name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module:
                resolved.add(name)
            elif name.split(".")[0] in ("boto3", "botocore"):
                resolved.add(name.split(".")[0])
        graph[module] = resolved
    return graph


def bench_imports(base: Path = BENCH) -> dict[str, set[str]]:
    """bench/'s modules (``bench.<name>``) -> the bench modules each imports, lazy imports too."""
    known = {path.stem for path in base.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in sorted(known):
        path = base / f"{name}.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        graph[f"bench.{name}"] = {f"bench.{n}" for n in found & known if n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            edge = f"{module} imports {target}"
            if _under(module, "petctl_agent") and _under(target, "petctl"):
                problems.append(f"{edge}: the agent never imports petctl")
            if (
                target in ("boto3", "botocore")
                and _under(module, "petctl")
                and not _under(module, ("petctl.gateway", "petctl.local"))
            ):
                problems.append(f"{edge}: only petctl.gateway talks to AWS")
            if _under(module, ("petctl.jobs", "petctl.infra", "petctl.timeline")) and _under(
                target, CLI_LAYER
            ):
                problems.append(f"{edge}: the job layer never imports the CLI")
            if _under(module, "petctl.gateway") and _under(target, UPPER_LAYERS):
                problems.append(f"{edge}: the gateway imports no layer above it")
            if _under(module, "petctl") and _under(target, "petctl_agent") and target not in AGENT_CONTRACTS:
                problems.append(f"{edge}: petctl imports only the agent's stdlib contracts (spec, settings)")
            if not _under(module, "petctl.local") and _under(target, DAEMON_SIDE):
                problems.append(f"{edge}: the CLI reaches the local cloud through petctl.local.client only")
            here, there = room(module), room(target)
            if here and target in ("boto3", "botocore") and here != "cloud":
                problems.append(f"{edge}: in the agent only the cloud room talks to AWS")
            if here and there and here != there and there not in ROOM_MAY_IMPORT[here]:
                allowed = ", ".join(sorted(ROOM_MAY_IMPORT[here])) or "no other room"
                problems.append(f"{edge}: the agent's {here} room may import {allowed}")
        if _under(module, "petctl_agent") and room(module) is None:
            problems.append(f"{module} is in no agent room: add it to AGENT_ROOMS (docs/architecture.md)")
    return problems


def is_face(path: Path) -> bool:
    """An ``__init__.py`` that only says what its package holds (a docstring, no code)."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body
    )


def unconnected(graph: dict[str, set[str]], known: dict[str, Path]) -> list[str]:
    """Agent modules that import no other module and that no module imports (faces excepted)."""
    imported = {t for targets in graph.values() for t in targets}
    return [
        f"{module} is unconnected: no module imports it and it imports none"
        for module, targets in sorted(graph.items())
        if _under(module, "petctl_agent")
        and not (targets - {"boto3", "botocore"})
        and module not in imported
        and not (module in known and is_face(known[module]))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    args = parser.parse_args(argv)
    known = modules()
    graph = imports(known)
    graph.update(bench_imports())  # bench.* names: no layer rule applies to them, the cycle rule does
    if args.edges:
        for module, targets in sorted(graph.items()):
            for target in sorted(targets):
                print(f"{module} -> {target}")
    problems = broken_rules(graph) + unconnected(graph, known)
    for line in problems:
        print(line)
    edges = sum(len(t) for t in graph.values())
    print(f"{len(graph)} modules, {edges} imports: {'OK' if not problems else f'{len(problems)} broken'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
