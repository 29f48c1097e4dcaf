"""The demo's errors say why in one plain line (petctl.local.demo)."""

from __future__ import annotations

import pytest

from petctl.errors import PetctlError
from petctl.local.demo import Demo, failure_reason


def test_a_failing_cli_step_shows_its_error_line_not_a_list() -> None:
    with pytest.raises(PetctlError) as e:
        Demo(log=lambda _: None).petctl("status", "--no-such-option")
    assert (
        str(e.value.message)
        == "`petctl --local status --no-such-option` failed: No such option '--no-such-option'."
    )


def test_failure_reason_is_never_empty() -> None:
    assert failure_reason({"job": "j", "reason": "3 instance boot(s) failed; i-1: error: x"}) == (
        "3 instance boot(s) failed; i-1: error: x"
    )
    agents = [{"state": "FAILED", "reason": "workers failed: exit 1"}, {"state": "RUNNING", "reason": "r"}]
    assert failure_reason({"job": "j", "reason": None, "agents": agents}) == "workers failed: exit 1"
    assert failure_reason({"job": "j", "reason": None, "agents": []}) == (
        "no reason recorded; `petctl --local status j` shows the hosts"
    )
