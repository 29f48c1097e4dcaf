"""A live job's state on the shared filesystem (petctl_agent.live.durable): when every replica
group is lost at once, the next one goes on from the saved step, not from 0; a newcomer that loads
an older copy than its live peers hold takes theirs. Real processes (examples/live_train.py, gloo,
a real lighthouse on 127.0.0.1)."""

from __future__ import annotations

import signal

import pytest
import torch
from live_harness import Lighthouse, Replica, wait_for

from petctl_agent.live.durable import FILE

pytestmark = pytest.mark.e2e


@pytest.fixture
def procs():
    made: list = []
    yield made
    for p in made:
        (p.kill if isinstance(p, Lighthouse) else p.stop)()


def saved_step(ckpt) -> int | None:
    try:
        return int(torch.load(ckpt / FILE, weights_only=True)["manager"]["step"])
    except (OSError, RuntimeError, EOFError, KeyError):
        return None


def file_params(ckpt) -> str:
    """examples/live_train.py's hash of the weights, of the saved copy's model."""
    import hashlib

    sd = torch.load(ckpt / FILE, weights_only=True)["model"]
    h = hashlib.sha1()
    for k, v in sd.items():
        if k != "ballast":  # a buffer, not a parameter
            h.update(v.numpy().tobytes())
    return h.hexdigest()[:12]


def test_after_every_group_is_lost_the_next_goes_on_from_the_saved_step(tmp_path, procs):
    ckpt = tmp_path / "checkpoints"
    env = {"PETCTL_CHECKPOINT_DIR": str(ckpt), "PETCTL_LIVE_CHECKPOINT_SECONDS": "0.5"}
    lh = Lighthouse(tmp_path).start()
    procs.append(lh)
    a = Replica("a", lh, tmp_path, env=env)
    procs.append(a)
    a.wait_lines(lambda s: s.step >= 20, 60, "20 steps")
    wait_for(lambda: (saved_step(ckpt) or 0) >= 10, 30, "a saved copy")
    a.signal(signal.SIGKILL)  # the job's last group: nothing live holds the state now
    a.proc.wait(10)
    step = saved_step(ckpt)
    assert step is not None and step >= 10
    b = Replica("b", lh, tmp_path, env=env)
    procs.append(b)
    first = b.wait_lines(lambda s: True, 60, "its first step")
    # it went on from the saved step (a loses at most the interval's steps), with the saved weights
    assert first.step == step + 1, (first.step, step)
    started = next(line for line in b.other if line.startswith("live_train: started"))
    assert f"step={step} params={file_params(ckpt)}" in started, started
    assert a.params_at(step) == file_params(ckpt)  # what a held at that step


def test_a_newcomer_with_an_older_copy_takes_its_live_peers_state(tmp_path, procs):
    ckpt = tmp_path / "checkpoints"
    env = {"PETCTL_CHECKPOINT_DIR": str(ckpt), "PETCTL_LIVE_CHECKPOINT_SECONDS": "1000"}
    lh = Lighthouse(tmp_path).start()
    procs.append(lh)
    # an old copy of step 3 (an earlier loss), then a live group far past it
    old = Replica("old", lh, tmp_path, "--steps", "3", env={**env, "PETCTL_LIVE_CHECKPOINT_SECONDS": "0.01"})
    procs.append(old)
    wait_for(lambda: not old.alive(), 60, "the old group to finish its 3 steps")
    assert saved_step(ckpt) in (2, 3)  # written after a committed step, at most every 0.01 s
    a = Replica("a", lh, tmp_path, env=env)
    procs.append(a)
    a.wait_lines(lambda s: s.step >= 25, 60, "25 steps")
    b = Replica("b", lh, tmp_path, env=env)  # loads step 3, then its first quorum heals it from a
    procs.append(b)
    first = b.wait_lines(lambda s: s.world == 2, 60, "its first step beside a")
    assert first.step > 25
    a.wait_lines(lambda s: s.step >= first.step, 15, "a at that step")
    assert a.params_at(first.step) == b.params_at(first.step)
