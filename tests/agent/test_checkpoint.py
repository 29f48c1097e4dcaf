"""petctl_agent.checkpoint: atomic save, verified load with fallback, drain flag, progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent import checkpoint as ckpt


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step_copy": step}


def test_save_and_load_latest_roundtrip(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path) is None
    for s in (10, 20, 30, 40):
        ckpt.save(_state(s), s, tmp_path, keep=2)
    state, step = ckpt.load_latest(tmp_path)
    assert step == 40 and state["step_copy"] == 40 and torch.equal(state["w"], torch.full((4,), 40.0))
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-0000000030.pt", "ckpt-0000000040.pt"]
    assert json.loads((tmp_path / "latest").read_text())["step"] == 40
    assert ckpt.latest_step(tmp_path) == 40


def test_corrupt_newest_falls_back_to_previous(tmp_path: Path) -> None:
    ckpt.save(_state(1), 1, tmp_path)
    ckpt.save(_state(2), 2, tmp_path)
    newest = tmp_path / "ckpt-0000000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn/corrupted after the fact
    state, step = ckpt.load_latest(tmp_path)
    assert step == 1 and state["step_copy"] == 1


def test_missing_pointer_uses_newest_file(tmp_path: Path) -> None:
    ckpt.save(_state(5), 5, tmp_path)
    (tmp_path / "latest").unlink()
    assert ckpt.load_latest(tmp_path)[1] == 5


def test_checkpoint_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PETCTL_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="PETCTL_CHECKPOINT_DIR"):
        ckpt.checkpoint_dir()
    monkeypatch.setenv("PETCTL_CHECKPOINT_DIR", str(tmp_path))
    ckpt.save(_state(3), 3)
    assert ckpt.load_latest()[1] == 3


WRITER = textwrap.dedent(
    """
    import sys, torch
    from petctl_agent import checkpoint as ckpt
    d = sys.argv[1]
    big = torch.randn(1_000_000)  # ~4 MB per checkpoint: kills land mid-write
    step = 0
    while True:
        step += 1
        ckpt.save({"big": big + step, "step_copy": step}, step, d, keep=3)
        print(step, flush=True)
    """
)


def test_writer_killed_mid_save_never_corrupts_latest(tmp_path: Path) -> None:
    """SIGKILL a busy writer at many points; 'latest' must always load and be self-consistent."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    d = tmp_path / "ck"
    for i in range(6):
        p = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE, text=True)
        # wait until it has saved at least once in this run, then kill at a varying offset
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(0.05 * i)
        p.send_signal(signal.SIGKILL)
        p.wait()
        state, step = ckpt.load_latest(d)
        assert state["step_copy"] == step
        assert torch.equal(state["big"][:3], (state["big"] - step + step)[:3])
    leftovers = [n for n in os.listdir(d) if n.endswith(".tmp")]
    assert len(leftovers) <= 6  # temp files of killed writers only (pruned after a minute)


def test_should_checkpoint_and_drain_flag_single_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drain = tmp_path / "drain"
    monkeypatch.setenv("PETCTL_DRAIN_FILE", str(drain))
    assert ckpt.should_checkpoint(10, 5) is True
    assert ckpt.should_checkpoint(11, 5) is False
    assert ckpt.drain_requested() is False
    drain.touch()
    assert ckpt.should_checkpoint(11, 5) is True
    assert ckpt.drain_requested() is True
    drain.unlink()
    assert ckpt.should_checkpoint(12, 0) is False


def test_exit_for_drain_uses_the_drain_exit_code(tmp_path: Path) -> None:
    code = "from petctl_agent import checkpoint as c; print('bye', flush=True); c.exit_for_drain()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == DRAIN_EXIT_CODE == 75 and "bye" in r.stdout


def test_report_progress_is_atomic_and_local_rank_zero_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "progress.json"
    monkeypatch.setenv("PETCTL_PROGRESS_FILE", str(f))
    monkeypatch.setenv("LOCAL_RANK", "1")
    ckpt.report_progress(7, 2)
    assert not f.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    ckpt.report_progress(7, 2)
    assert json.loads(f.read_text())["step"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]
