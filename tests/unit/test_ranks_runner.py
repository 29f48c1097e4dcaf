"""tests/ranks.py: a hung rank job fails with every stuck rank's Python stack, and a failed rank
does not leave the others to wait out the whole timeout."""

from __future__ import annotations

import sys

import pytest

from tests import ranks

SLEEPY = "import os, time\nif os.environ['RANK'] == os.environ.get('SLEEPER'):\n    time.sleep(600)\n"


def test_a_hung_rank_fails_with_its_stack() -> None:
    with pytest.raises(ranks.RanksFailed) as e:
        ranks.run_ranks([sys.executable, "-c", SLEEPY], [{"SLEEPER": "1"}] * 2, timeout=3)
    msg = str(e.value)
    assert "ranks [1] still running after 3 s" in msg
    assert "rank 1 (rc -6, stuck)" in msg and "Current thread" in msg  # SIGABRT: faulthandler's dump


def test_a_failed_rank_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "AFTER_FAILURE", 1.0)
    code = SLEEPY + "raise SystemExit(3)\n"
    # rank 0 hangs, rank 1 fails: a later rank's failure is seen while an earlier one still runs
    with pytest.raises(ranks.RanksFailed, match=r"ranks \[0\] still running 1 s after a rank failed") as e:
        ranks.run_ranks([sys.executable, "-c", code], [{"SLEEPER": "0"}] * 2, timeout=60)
    assert "rank 1 (rc 3)" in str(e.value)


def test_every_rank_gets_its_rank_and_one_port() -> None:
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], os.environ['X'])"
    done = ranks.run_ranks([sys.executable, "-c", code], [{"X": "a"}, {"X": "b"}], timeout=30)
    lines = [cp.stdout.split() for cp in done]
    assert [ln[0] for ln in lines] == ["0", "1"] and {ln[1] for ln in lines} == {"2"}
    assert lines[0][2] == lines[1][2] and [ln[3] for ln in lines] == ["a", "b"]
