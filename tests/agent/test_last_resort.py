"""The job's end when the Auto Scaling API does not answer: the scale to zero is tried again a
bounded number of times, then the node powers itself off instead of idling in service until
kill-job (issue #31). No process, no AWS: a fake Auto Scaling client and a stand-in power-off."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from petctl_agent.cloud import aws
from petctl_agent.cloud.imds import Imds
from petctl_agent.node import ending
from petctl_agent.node.lifecycle import SCALE_TO_ZERO_DELAYS, Lifecycle
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec

SPEC = {
    "job_name": "j-1",
    "min_nodes": 1,
    "max_nodes": 2,
    "code_url": "file:///x.py",
    "script": "x.py",
    "worker_group": "petctl-j-1-workers",
    "rdzv_group": "petctl-j-1-rdzv",
}


class FlakyAutoScaling:
    """UpdateAutoScalingGroup fails ``failures[group]`` times for each group, then succeeds."""

    def __init__(self, failures: dict[str, int]) -> None:
        self.failures = dict(failures)
        self.calls: list[str] = []

    def update_auto_scaling_group(self, AutoScalingGroupName: str, **_: Any) -> dict:  # noqa: N803
        self.calls.append(AutoScalingGroupName)
        if self.failures.get(AutoScalingGroupName, 0) > 0:
            self.failures[AutoScalingGroupName] -= 1
            raise ConnectionError("Could not connect to the endpoint URL")
        return {}

    def describe_auto_scaling_groups(self, **_: Any) -> dict:
        return {"AutoScalingGroups": []}


class Pub:
    def __init__(self) -> None:
        self.states: list[str] = []

    def event(self, kind: str, **_: Any) -> None:
        pass

    def update(self, state: str, reason: str | None = None) -> None:
        self.states.append(state)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _lifecycle(monkeypatch: pytest.MonkeyPatch, client: Any, settings: Settings) -> Lifecycle:
    monkeypatch.setattr(aws, "client", lambda *a, **k: client)
    return Lifecycle(JobSpec.from_dict(SPEC), Imds("http://127.0.0.1:9", timeout=0.2), settings, "i-end")


def _power_off_script(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the boot's petctl-power-off: records that it ran, and why."""
    ran = tmp_path / "powered-off"
    script = tmp_path / "petctl-power-off"
    script.write_text(f'#!/bin/sh\nprintf "%s" "$1" > {ran}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, ran


def _ckpt(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return tmp_path / "ckpt"


def test_a_failed_scale_to_zero_is_tried_again_for_the_failed_group_only(monkeypatch) -> None:
    client = FlakyAutoScaling({"petctl-j-1-rdzv": 2})
    slept: list[float] = []
    lc = _lifecycle(monkeypatch, client, Settings())
    assert lc.scale_groups_to_zero(sleep=slept.append) is True
    assert client.calls == ["petctl-j-1-workers", "petctl-j-1-rdzv", "petctl-j-1-rdzv", "petctl-j-1-rdzv"]
    assert slept == list(SCALE_TO_ZERO_DELAYS[:2])


def test_the_tries_are_bounded(monkeypatch) -> None:
    client = FlakyAutoScaling({"petctl-j-1-workers": 99, "petctl-j-1-rdzv": 99})
    slept: list[float] = []
    lc = _lifecycle(monkeypatch, client, Settings())
    assert lc.scale_groups_to_zero(sleep=slept.append) is False
    assert len(client.calls) == 2 * (len(SCALE_TO_ZERO_DELAYS) + 1)
    assert slept == list(SCALE_TO_ZERO_DELAYS) and sum(slept) <= 90  # about a minute, documented


def test_success_whose_groups_stay_up_powers_the_node_off(monkeypatch, tmp_path) -> None:
    """After SUCCEEDED the agent exits 0 and systemd does not restart it: without the last resort
    the instance would idle in service, billed, until kill-job."""
    from petctl_agent.elastic.outcome import Outcome

    script, ran = _power_off_script(tmp_path)
    lc = _lifecycle(
        monkeypatch, FlakyAutoScaling({"petctl-j-1-workers": 99}), Settings(power_off=str(script))
    )
    monkeypatch.setattr(
        lc, "scale_groups_to_zero", lambda: Lifecycle.scale_groups_to_zero(lc, sleep=lambda s: None)
    )
    pub = Pub()
    rc = ending.finish(
        Outcome.SUCCEEDED,
        None,
        None,
        _ckpt(tmp_path),
        pub,  # type: ignore[arg-type]
        lc,
        leave_reason=None,
        lifecycle_wait=0,
        last_step=lambda: 7,
    )
    assert rc == 0 and pub.states == ["SUCCEEDED"]
    assert ran.read_text() == "the job succeeded, but its groups could not be scaled to zero"


def test_success_with_its_groups_at_zero_does_not_power_off(monkeypatch, tmp_path) -> None:
    from petctl_agent.elastic.outcome import Outcome

    script, ran = _power_off_script(tmp_path)
    lc = _lifecycle(monkeypatch, FlakyAutoScaling({}), Settings(power_off=str(script)))
    rc = ending.finish(
        Outcome.SUCCEEDED,
        None,
        None,
        _ckpt(tmp_path),
        Pub(),  # type: ignore[arg-type]
        lc,
        leave_reason=None,
        lifecycle_wait=0,
        last_step=lambda: 7,
    )
    assert rc == 0 and not ran.exists()


def test_without_the_setting_nothing_is_powered_off(monkeypatch) -> None:
    """Tests and machines that are no petctl instance never run a power-off."""
    lc = _lifecycle(monkeypatch, FlakyAutoScaling({}), Settings())
    assert Settings.from_env({}).power_off == ""
    assert (
        Settings.from_env({"PETCTL_AGENT_POWER_OFF": "/x/petctl-power-off"}).power_off
        == "/x/petctl-power-off"
    )
    assert lc.power_off("why") is False
