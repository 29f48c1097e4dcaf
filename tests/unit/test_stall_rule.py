"""The agent's stall rule (petctl_agent/elastic/stall.py): when "no new step" starts the lease
reads of a hard loss that failed nothing (a peer vanished without a reset)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from petctl_agent.elastic.stall import STALL_MAX_S, STALL_MIN_S, StallWatch, stall_after


def test_the_rule_needs_two_step_times_and_takes_three_times_the_median() -> None:
    assert stall_after([]) is None and stall_after([0.5]) is None
    assert stall_after([0.5, 0.5]) == 1.5
    # one slow step (a checkpoint) does not move the median
    assert stall_after([0.4, 0.4, 0.4, 30.0, 0.4]) == pytest.approx(1.2)


def test_fast_steps_are_floored_and_slow_steps_capped() -> None:
    assert stall_after([0.01] * 8) == STALL_MIN_S  # a scheduling hiccup of a 10 ms step is no stall
    assert stall_after([5.0] * 8) == STALL_MAX_S  # later than this, the lease expiry comes first


def _step(f: Path, step: int, t: float) -> None:
    f.write_text(json.dumps({"step": step, "world_size": 2, "t": t}))
    os.utime(f, (t, t))  # a new mtime each write (the watch skips an unchanged file)


def test_slow_steps_do_not_stall_and_a_silence_does_once(tmp_path: Path) -> None:
    f = tmp_path / "progress.json"
    w = StallWatch(f)
    now, t = 100.0, 1000.0
    for step in range(1, 6):  # steps of 0.5 s: stall after 1.5 s
        _step(f, step, t)
        assert w.poll(now) is None
        now, t = now + 0.5, t + 0.5
    # a step twice the median, then one 2.9x it: slow, not stalled (polled every 0.1 s)
    for slow in (1.0, 1.45):
        for _ in range(int(slow / 0.1)):
            now += 0.1
            assert w.poll(now) is None, (slow, w.silence(now))
        step += 1
        t += slow
        _step(f, step, t)
        assert w.poll(now) is None
    # silence: stalled once at 3x the median, not again while it lasts
    got = []
    for _ in range(40):
        now += 0.1
        got.append(w.poll(now))
    assert got.count("stalled") == 1 and got.index("stalled") in (14, 15), got
    assert w.stalled
    # a new step ends it (and re-arms the rule)
    _step(f, step + 1, t + 4.0)
    assert w.poll(now + 0.1) == "resumed" and not w.stalled


def test_steps_sampled_a_few_at_a_time_give_one_step_time_each(tmp_path: Path) -> None:
    f = tmp_path / "progress.json"
    w = StallWatch(f)
    for i, (step, t) in enumerate(
        [(3, 1000.0), (10, 1000.21), (17, 1000.42)]
    ):  # 30 ms steps, read every 0.2 s
        _step(f, step, t)
        assert w.poll(100.0 + 0.2 * i) is None
    assert w.poll(100.4 + STALL_MIN_S - 0.05) is None
    assert w.poll(100.4 + STALL_MIN_S + 0.01) == "stalled"  # 3 x 30 ms is under the floor


def test_no_stall_before_the_new_workers_have_step_times(tmp_path: Path) -> None:
    f = tmp_path / "progress.json"
    _step(f, 41, 1000.0)  # the old workers' last step
    w = StallWatch(f)
    assert w.poll(0.0) is None
    assert w.poll(60.0) is None  # one step seen, no step time: never a stall
    _step(f, 30, 1100.0)  # the new workers resume from a checkpoint: not a step time
    assert w.poll(61.0) is None and w.poll(120.0) is None
