"""Every ``PETCTL_*`` variable is read from the environment in one place (agent/ and petctl/).

A second reader grows its own default or its own reading of a bad value (``float(x or 60)`` here,
``float(get(x, "60"))`` there: an empty value read as 60 by one and a crash by the other). The
agent's own knobs are ``petctl_agent.settings.Settings``; the variables its workers read are
``petctl_agent.knobs``; the rest have one reader each where they are used.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = (REPO / "agent", REPO / "petctl")
#: calls that parse a variable named by their first argument
PARSERS = {"getenv", "env_float", "env_int", "_env_opt"}
#: variables read in more than one place, and why each must be (two processes that cannot share
#: a module); none today
ALLOWED: dict[str, str] = {}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("PETCTL_"):
        return node.value
    return None


def reads(tree: ast.AST) -> list[tuple[str, int]]:
    """``(variable, line)`` of every read of a ``PETCTL_*`` name in ``tree``: ``X.get(name)``
    (``os.environ``, an ``env`` mapping), ``X[name]`` read, ``name in X``, ``os.getenv(name)``
    and the settings' parsers (``env_float(name, ...)``). Writes (``env[name] = ...``, ``pop``)
    are not reads."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and (name := _name(n.args[0])):
            f = n.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called == "get" or called in PARSERS:
                found.append((name, n.lineno))
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and (name := _name(n.slice)):
            found.append((name, n.lineno))
        elif (
            isinstance(n, ast.Compare)
            and any(isinstance(op, ast.In | ast.NotIn) for op in n.ops)
            and (name := _name(n.left))
        ):
            found.append((name, n.lineno))
    return found


def test_the_scan_finds_every_kind_of_read() -> None:
    src = """
import os
a = os.environ.get("PETCTL_A", "1")
b = os.environ["PETCTL_B"]
c = os.getenv("PETCTL_C")
d = env.get("PETCTL_D") or None
e = env_float("PETCTL_E", 1.0, env)
f = "PETCTL_F" in os.environ
env["PETCTL_G"] = "written, not read"
env.pop("PETCTL_H", None)
"""
    assert sorted(n for n, _ in reads(ast.parse(src))) == [f"PETCTL_{c}" for c in "ABCDEF"]


def test_every_petctl_variable_is_read_in_one_place() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            for name, line in reads(ast.parse(path.read_text(), str(path))):
                where[name].append(f"{path.relative_to(REPO)}:{line}")
    assert where, "the scan found no reads at all: the scan is broken"
    twice = {n: w for n, w in sorted(where.items()) if len(w) > 1 and n not in ALLOWED}
    assert not twice, (
        "read in more than one place (give each one reader: petctl_agent/knobs.py for the "
        f"workers' variables, settings.py for the agent's): {twice}"
    )
    stale = sorted(n for n in ALLOWED if len(where.get(n, [])) < 2)
    assert not stale, f"allowed twice but read once: drop from ALLOWED: {stale}"
