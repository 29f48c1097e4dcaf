"""tests/ranks.py: a hung rank job fails with every stuck rank's Python stack, and a failed rank
does not leave the others to wait out the whole timeout; the same for ranks forked from the
zygote (a script file) as for fresh interpreters (``-c``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import ranks

SLEEPY = "import os, time\nif os.environ['RANK'] == os.environ.get('SLEEPER'):\n    time.sleep(600)\n"


@pytest.fixture(params=["fresh", "forked"])
def cmd(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], list[str]]:
    """``code`` -> the command of a rank that runs it: ``python -c`` (a fresh interpreter) or
    ``python script.py`` (forked from the zygote)."""

    def make(code: str) -> list[str]:
        if request.param == "fresh":
            return [sys.executable, "-c", code]
        script = tmp_path / "rank_script.py"
        script.write_text(code)
        return [sys.executable, str(script)]

    return make


def test_a_hung_rank_fails_with_its_stack(cmd: Callable[[str], list[str]]) -> None:
    with pytest.raises(ranks.RanksFailed) as e:
        ranks.run_ranks(cmd(SLEEPY), [{"SLEEPER": "1"}] * 2, timeout=3)
    msg = str(e.value)
    assert "ranks [1] still running after 3 s" in msg
    assert "rank 1 (rc -6, stuck)" in msg and "Current thread" in msg  # SIGABRT: faulthandler's dump


def test_a_failed_rank_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch, cmd: Callable[[str], list[str]]
) -> None:
    monkeypatch.setattr(ranks, "AFTER_FAILURE", 1.0)
    code = SLEEPY + "raise SystemExit(3)\n"
    # rank 0 hangs, rank 1 fails: a later rank's failure is seen while an earlier one still runs
    with pytest.raises(ranks.RanksFailed, match=r"ranks \[0\] still running 1 s after a rank failed") as e:
        ranks.run_ranks(cmd(code), [{"SLEEPER": "0"}] * 2, timeout=60)
    assert "rank 1 (rc 3)" in str(e.value)


def test_every_rank_gets_its_rank_and_one_port(cmd: Callable[[str], list[str]]) -> None:
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], os.environ['X'])"
    done = ranks.run_ranks(cmd(code), [{"X": "a"}, {"X": "b"}], timeout=30)
    lines = [cp.stdout.split() for cp in done]
    assert [ln[0] for ln in lines] == ["0", "1"] and {ln[1] for ln in lines} == {"2"}
    assert lines[0][2] == lines[1][2] and [ln[3] for ln in lines] == ["a", "b"]


def test_a_forked_rank_is_a_process_of_its_own(tmp_path: Path) -> None:
    """What a fresh interpreter gives a script, a forked rank has too: its own pid, environment
    (nothing of the zygote's), argv, working directory, ``sys.path[0]`` and PYTHONPATH, its
    script as ``__main__``, non-daemon threads joined and atexit run before it exits, and an
    uncaught exception's traceback on stderr with exit 1."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "nearby.py").write_text("NEAR = 5\n")
    script = tmp_path / "main_script.py"
    script.write_text(
        "import atexit, json, os, sys, threading, time\n"
        "import helper_mod, nearby\n"
        "atexit.register(lambda: print('ATEXIT', flush=True))\n"
        "t = threading.Thread(target=lambda: (time.sleep(0.3), print('THREAD', flush=True)))\n"
        "t.start()\n"
        "print(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:], 'cwd': os.getcwd(),\n"
        "    'main': __name__, 'mod': sys.modules['__main__'].__file__, 'v': helper_mod.VALUE + nearby.NEAR,\n"
        "    'zyg': 'ZYGOTE_ONLY' in os.environ, 'rank': os.environ['RANK']}), flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('boom from rank 1')\n"
    )
    import json
    import os

    os.environ["ZYGOTE_ONLY"] = "1"  # not in a rank's environment: run_ranks passes the rank's own
    try:
        done = ranks.run_ranks(
            [sys.executable, str(script), "--flag", "x"],
            [{"PYTHONPATH": str(tmp_path / "lib")}, {"PYTHONPATH": str(tmp_path / "lib")}],
            timeout=60,
            drop=("ZYGOTE_ONLY",),
        )
    finally:
        del os.environ["ZYGOTE_ONLY"]
    got = [json.loads(cp.stdout.splitlines()[0]) for cp in done]
    assert got[0]["pid"] != got[1]["pid"] and os.getpid() not in {g["pid"] for g in got}
    for r, g in enumerate(got):
        assert g["argv"] == ["--flag", "x"] and g["main"] == "__main__" and g["mod"] == str(script), g
        assert g["v"] == 12 and g["zyg"] is False and g["rank"] == str(r) and g["cwd"] == os.getcwd(), g
        assert done[r].stdout.splitlines()[1:] == ["THREAD", "ATEXIT"], done[r].stdout
    assert done[0].returncode == 0 and done[1].returncode == 1, [cp.returncode for cp in done]
    assert "ValueError: boom from rank 1" in done[1].stderr and "Traceback" in done[1].stderr
