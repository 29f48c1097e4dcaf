"""The project reads as a product: no words of how it was built, and the newcomer's pages short.

Comments, docstrings and docs say why the code is as it is, not when it changed: no names of
development stages or CI runs ("stop 33", "ci27c"). The README is for the person deciding whether
to use petctl, and docs/benchmarks.md holds today's results (earlier ones are in git history and
docs/bench/*.json, named by date).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: a development stage or a CI run named in the text
BUILD_HISTORY = re.compile(r"\b[Ss]tops? \d+\b|\bci\d+[a-z]?\b|\b[Ss]ession \d+\b")
TEXT = (".py", ".md", ".j2", ".sh", ".toml", ".ini", ".cfg", ".txt", ".yaml", ".yml")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if p.endswith(TEXT) and not p.startswith("docs/bench/")]


def test_no_names_of_development_stages_or_ci_runs() -> None:
    found = []
    for path in _tracked():
        if path == Path(__file__) or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if BUILD_HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_bench_results_are_named_by_date() -> None:
    names = [p.name for p in (ROOT / "docs" / "bench").iterdir()]
    assert names and all(re.match(r"\d{4}-\d{2}-\d{2}-", n) for n in names), names


def test_the_newcomers_pages_stay_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 800


#: the most lines a product module (``petctl/``, ``agent/``) may have: past it, a module holds
#: more than one responsibility and is split by them (docs/architecture.md has the rooms)
MODULE_LINES = 400


def test_no_product_module_is_over_400_lines() -> None:
    big = []
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if rel.suffix == ".py" and rel.parts[0] in ("petctl", "agent") and path.is_file():
            n = len(path.read_text().splitlines())
            if n > MODULE_LINES:
                big.append(f"{rel}: {n} lines")
    assert not big, "\n".join(big)
