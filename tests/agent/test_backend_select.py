"""Backend selection and the petctl-etcd integration's small parts (no etcd, no workers)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from petctl_agent.cloud.status import EVENT_KINDS
from petctl_agent.elastic import torch_compat
from petctl_agent.elastic.handlers import torch_workaround
from petctl_agent.elastic.tracebacks import _NoAgentTraceback
from petctl_agent.node.lifecycle import CapacityHint
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec, SpecError, rdzv_backend
from petctl_agent.worker.env import PROGRESS_SAMPLES, StepInfo

BASE = {"job_name": "job-a", "min_nodes": 1, "max_nodes": 2, "code_url": "file:///x.py", "script": "x.py"}


def test_spec_rdzv_backend_defaults_validates_and_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PETCTL_AGENT_RDZV_BACKEND", raising=False)
    assert JobSpec.from_dict(BASE).rdzv_backend == "petctl-etcd"
    assert JobSpec.from_dict({**BASE, "rdzv_backend": ""}).rdzv_backend == "petctl-etcd"
    assert JobSpec.from_dict({**BASE, "rdzv_backend": "etcd-v2"}).rdzv_backend == "etcd-v2"
    with pytest.raises(SpecError, match="rdzv_backend must be one of petctl-etcd, etcd-v2, etcd, got 'c10d'"):
        JobSpec.from_dict({**BASE, "rdzv_backend": "c10d"})
    assert rdzv_backend("etcd-v2") == "etcd-v2"
    monkeypatch.setenv("PETCTL_AGENT_RDZV_BACKEND", "etcd")
    assert rdzv_backend("etcd-v2", Settings.from_env().rdzv_backend) == "etcd"
    monkeypatch.setenv("PETCTL_AGENT_RDZV_BACKEND", "nope")
    with pytest.raises(ValueError, match="'nope'"):
        rdzv_backend("", Settings.from_env().rdzv_backend)


def test_torch_workarounds_apply_to_torch_backends_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPLIT_STORE", "FAST_LAST_CALL", "FAST_HEARTBEAT", "STORE_TIMEOUT", "ETCD_OUTAGE"):
        assert not torch_workaround(name, "petctl-etcd")
        assert torch_workaround(name, "etcd-v2")
    monkeypatch.setenv("PETCTL_AGENT_NO_SPLIT_STORE", "1")
    assert not torch_workaround("SPLIT_STORE", "etcd-v2", Settings.from_env())


def test_internals_check_needs_only_what_the_backend_uses() -> None:
    ours = torch_compat.required_for("petctl-etcd")
    assert ours == torch_compat.REQUIRED_BASE == torch_compat.required_for("etcd")
    assert torch_compat.required_for("etcd-v2") == torch_compat.REQUIRED
    names = {m.name for m in ours}
    assert not any("dynamic_rendezvous" in n or "etcd_rendezvous_backend" in n for n in names)
    fake = torch_compat.Member("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "NoSuchThing")
    # a torch without an etcd-v2 internal still runs petctl-etcd jobs
    assert torch_compat.check("", torch_compat.REQUIRED_BASE) is None
    assert "NoSuchThing" in (torch_compat.check("", torch_compat.REQUIRED + (fake,)) or "")


def test_capacity_hint_never_blocks_and_caches() -> None:
    calls: list[float] = []
    gate = threading.Event()

    def slow_probe() -> dict[str, int]:
        calls.append(time.monotonic())
        gate.wait(60)  # a read that blocked its caller would hold it this long
        return {"desired": 6, "in_service": 2, "pending": 4}

    hint = CapacityHint(slow_probe, max_age=60)
    t = time.monotonic()
    assert hint() is None  # the first read is under way in the background
    assert hint() is None
    assert time.monotonic() - t < 5  # far below the probe's 60 s: loose, a loaded box descheduled it
    gate.set()
    deadline = time.monotonic() + 5
    while hint.value is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hint() == 6
    assert len(calls) == 1  # cached for max_age
    assert CapacityHint(lambda: None)() is None


def test_worker_exit_logged_without_agent_traceback(caplog: pytest.LogCaptureFixture) -> None:
    lg = logging.getLogger("test.petctl.noagenttb")
    lg.addFilter(_NoAgentTraceback())
    with caplog.at_level(logging.ERROR, logger="test.petctl.noagenttb"):
        try:
            raise RuntimeError("process 0 terminated with exit code 75")
        except RuntimeError:
            lg.exception("failed (exitcode: %s)", 75)
    rec = caplog.records[-1]
    assert rec.exc_info is None
    assert rec.getMessage() == "failed (exitcode: 75): RuntimeError: process 0 terminated with exit code 75"


def test_status_progress_and_new_event_kinds(tmp_path: Path) -> None:
    for kind in ("workers_ready", "rdzv_unreachable", "rdzv_recovered"):
        assert kind in EVENT_KINDS
    progress = tmp_path / "progress.json"
    info = StepInfo(progress)
    for step in (1, 1, 2, 3):
        progress.write_text(json.dumps({"step": step, "world_size": 2, "t": 100.0 + step}))
        out = info()
    assert out["last_step"] == 3 and out["last_step_at"] == 103.0
    assert out["progress"] == [[101.0, 1], [102.0, 2], [103.0, 3]]
    for step in range(4, 4 + PROGRESS_SAMPLES + 10):
        progress.write_text(json.dumps({"step": step, "t": 100.0 + step}))
        out = info()
    assert len(out["progress"]) == PROGRESS_SAMPLES
    assert out["progress"][-1][1] == step
