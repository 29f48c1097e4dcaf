"""The suite's scheduler (tests/conftest.py): with 3 xdist workers, the last one (the waiting
lane) runs only the modules marked ``pytest.mark.waits``, and the others run everything else
first, then what waiting work is left. Run for real: a pytest with the suite's own conftest on
a few modules that record which worker ran them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

HERE = Path(__file__).resolve().parents[1]

TEST = """
import json, os, time
import pytest
{mark}

@pytest.mark.parametrize("i", range({n}))
def test_one(i):
    time.sleep({sleep})
    with open(os.path.join({out!r}, "{name}-%d.json" % i), "w") as f:
        json.dump({{"worker": os.environ.get("PYTEST_XDIST_WORKER")}}, f)
"""


def _suite(tmp_path: Path, out: Path, files: dict[str, tuple[bool, int, float]]) -> Path:
    root = tmp_path / "suite"
    (root / "tests" / "agent").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", root / "tests" / "conftest.py")
    (root / "pytest.ini").write_text(
        "[pytest]\ntestpaths = tests\naddopts = -p no:cacheprovider\nmarkers =\n    waits: the waiting lane\n"
    )
    for name, (waits, n, sleep) in files.items():
        mark = "pytestmark = [pytest.mark.waits]" if waits else ""
        (root / "tests" / "agent" / f"test_{name}.py").write_text(
            TEST.format(mark=mark, n=n, sleep=sleep, out=str(out), name=name)
        )
    return root


def _run(root: Path, workers: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadgroup",
         "--no-loadscope-reorder"],
        cwd=root, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _workers(out: Path) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for f in out.glob("*.json"):
        seen.setdefault(f.stem.rsplit("-", 1)[0], set()).add(json.loads(f.read_text())["worker"])
    return seen


def test_the_waiting_lane_runs_only_waiting_modules_and_the_others_run_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # more other work than the two workers hold at once (two units each), so that they never
    # run out of it while the lane still has waiting modules queued
    files = {"wait_a": (True, 2, 0.1), "wait_b": (True, 2, 0.1)}
    files.update({f"cpu_{c}": (False, 3, 0.3) for c in "abcdef"})
    r = _run(_suite(tmp_path, out, files), 3)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = _workers(out)
    assert set(seen) == set(files), seen
    # a module is one unit: each ran on one worker
    assert all(len(w) == 1 for w in seen.values()), seen
    for name, (waits, _, _) in files.items():
        if waits:
            assert seen[name] <= {"gw2"}, (name, seen)
        else:
            assert seen[name] <= {"gw0", "gw1"}, (name, seen)


def test_with_nothing_waiting_left_the_other_workers_take_the_waiting_modules(tmp_path: Path) -> None:
    """Four waiting modules of 1.5 s and one short other: the two other workers, idle after it,
    take waiting modules the lane has not started (the lane runs one at a time)."""
    out = tmp_path / "out"
    out.mkdir()
    files = {f"wait_{c}": (True, 3, 0.5) for c in "abcd"}
    files["cpu_a"] = (False, 1, 0.1)
    r = _run(_suite(tmp_path, out, files), 3)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = _workers(out)
    ran_on = set().union(*(seen[f"wait_{c}"] for c in "abcd"))
    assert "gw2" in ran_on and ran_on & {"gw0", "gw1"}, seen


def test_two_workers_have_no_waiting_lane(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    files = {"wait_a": (True, 2, 0.3), "wait_b": (True, 2, 0.3), "cpu_a": (False, 1, 0.1)}
    r = _run(_suite(tmp_path, out, files), 2)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = _workers(out)
    assert set(seen) == set(files) and set().union(*seen.values()) <= {"gw0", "gw1"}, seen
