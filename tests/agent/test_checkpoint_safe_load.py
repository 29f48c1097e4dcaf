"""Checkpoints load with ``weights_only``: a crafted file in the directory cannot run code in the job.

Each refusal case also runs the opt-in (``unsafe_load`` / ``PETCTL_CHECKPOINT_UNSAFE_LOAD=1``) and
checks the payload *does* fire there, so the safe case proves something.
"""

from __future__ import annotations

import builtins
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from petctl_agent import checkpoint as ckpt


class Evil:
    """Unpickling this writes ``marker`` (what an attacker's checkpoint would do, less politely)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.fixture(autouse=True)
def _no_env_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PETCTL_CHECKPOINT_UNSAFE_LOAD", raising=False)


def test_malicious_single_file_is_refused_not_run(tmp_path: Path) -> None:
    d, marker = tmp_path / "ck", tmp_path / "marker"
    ckpt.save({"w": torch.ones(2)}, 1, d)  # a good older one: must not be loaded silently instead
    ckpt.save({"w": torch.ones(2), "x": Evil(marker)}, 2, d)
    with pytest.raises(ckpt.UnsafeCheckpointError) as ei:
        ckpt.load_latest(d, map_location="cpu")
    msg = str(ei.value)
    assert not marker.exists()
    assert "\n" not in msg and "ckpt-0000000002.pt" in msg and "holds exec," in msg
    assert "PETCTL_CHECKPOINT_UNSAFE_LOAD=1" in msg and "unsafe_load=True" in msg
    with pytest.raises(ckpt.UnsafeCheckpointError):
        ckpt.resume(directory=d)
    assert not marker.exists()
    # the explicit opt-in is a full unpickle: the payload runs (so the refusal above is real)
    state, step = ckpt.load_latest(d, map_location="cpu", unsafe_load=True)
    assert step == 2 and marker.read_text() == "pwned"


def test_env_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "ck"
    ckpt.save({"a": np.arange(3)}, 4, d)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"numpy\._core\.multiarray\._reconstruct"):
        ckpt.load_latest(d, map_location="cpu")
    monkeypatch.setenv("PETCTL_CHECKPOINT_UNSAFE_LOAD", "1")
    state, step = ckpt.load_latest(d, map_location="cpu")
    assert step == 4 and state["a"].tolist() == [0, 1, 2]
    assert (
        "ckpt-0000000004.pt holds numpy._core.multiarray._reconstruct: full unpickle"
        in capsys.readouterr().err
    )


def test_usual_training_state_loads_safely(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "meta": {"epoch": 3, "loss": 0.5, "name": "x", "seen": [1, 2], "pair": (1, "a"), "none": None},
    }
    ckpt.save(state, 7, tmp_path)
    got, step = ckpt.load_latest(tmp_path, map_location="cpu")
    assert step == 7 and got["meta"] == state["meta"]
    model2 = torch.nn.Linear(3, 2)
    model2.load_state_dict(got["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(got["optim"])
    assert torch.equal(got["rng"], state["rng"])


def _dcp_dir(d: Path, step: int, state: dict) -> Path:
    path = d / f"ckpt-{step:010d}.dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    (d / "latest").write_text(json.dumps({"file": path.name, "step": step, "format": "dcp"}))
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_values_load_safely_and_malicious_value_is_refused(tmp_path: Path) -> None:
    d, marker = tmp_path / "ck", tmp_path / "marker"
    d.mkdir()
    _dcp_dir(d, 3, {"w": torch.arange(4.0), "n": 5, "meta": {"s": "x", "l": [1, 2]}})
    into = {"w": torch.zeros(4), "n": 0, "meta": {"s": "", "l": []}}
    got, step = ckpt.load_latest(d, into=into)
    assert step == 3 and got["n"] == 5 and got["meta"] == {"s": "x", "l": [1, 2]}
    assert torch.equal(got["w"], torch.arange(4.0))

    _dcp_dir(d, 4, {"w": torch.arange(4.0), "x": Evil(marker)})
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"ckpt-0000000004\.dcp holds exec,"):
        ckpt.load_latest(d, into={"w": torch.zeros(4), "x": None})
    assert not marker.exists()
    ckpt.load_latest(d, into={"w": torch.zeros(4), "x": None}, unsafe_load=True)
    assert marker.exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_malicious_metadata_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch's reader unpickles ``.metadata`` with plain ``pickle.load``: ours allows DCP's records only."""
    d, marker = tmp_path / "ck", tmp_path / "marker"
    d.mkdir()
    path = _dcp_dir(d, 6, {"w": torch.arange(4.0)})
    (path / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"builtins\.exec in \.metadata"):
        ckpt.load_latest(d, into={"w": torch.zeros(4)})
    assert not marker.exists()
    capsys.readouterr()
    # the opt-in runs the payload, then DCP chokes (its CheckpointException, now a RuntimeError):
    # an unreadable newest, so load_latest falls back -- to nothing older here
    assert ckpt.load_latest(d, into={"w": torch.zeros(4)}, unsafe_load=True) is None
    assert marker.exists()
    assert "newest ckpt-0000000006.dcp unreadable (ckpt-0000000006.dcp: DCP load failed on rank(s) [0]" in (
        capsys.readouterr().err
    )
