"""Starting, stopping and recovering the local cloud daemon (each test has its own state dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from localcloud_helpers import wait_for

import petctl.local as local
from petctl.local import procs


def test_start_status_stop_are_idempotent(local_dir: Path) -> None:
    assert local.status()["running"] is False
    assert local.stop()["was_running"] is False  # nothing to stop, even with no state dir
    info = local.ensure_started(timeout=60)
    assert info["endpoint_url"].startswith("http://127.0.0.1:") and info["imds_url"].startswith(
        "http://127.0.0.1:"
    )
    assert local.ensure_started()["pid"] == info["pid"]  # already running: same daemon
    st = local.status()
    assert st["running"] and st["pid"] == info["pid"] and st["instances"] == []
    assert json.loads((local_dir / "cloud.json").read_text())["pid"] == info["pid"]
    assert oct((local_dir / "cloud.json").stat().st_mode & 0o777) == "0o600"  # holds the control token

    # A second daemon on the same state dir refuses to run.
    second = subprocess.run(
        [sys.executable, "-m", "petctl.local.daemon", "--state-dir", str(local_dir)],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(local.__file__).resolve().parents[2])},
    )
    assert second.returncode == 3

    res = local.stop()
    assert res["was_running"] and res["pid"] == info["pid"]
    assert not procs.is_alive(info["pid"])
    assert not (local_dir / "cloud.json").exists()
    assert local.status()["running"] is False
    assert local.stop()["was_running"] is False
    assert "stopped" in (local_dir / "cloud.log").read_text()


def test_stale_state_is_recovered_and_only_our_leftovers_are_killed(local_dir: Path) -> None:
    local_dir.mkdir(parents=True)
    # A pid that is certainly dead, and one alive but not a daemon (ours), as stale cloud.json pids.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for stale_pid in (dead.pid, os.getpid()):
        (local_dir / "cloud.json").write_text(
            json.dumps({"pid": stale_pid, "endpoint_url": "http://127.0.0.1:9"})
        )
        assert local.status()["running"] is False
    # Leftovers of a daemon that died hard: a recorded group (ours) and an unrelated process.
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    unrelated = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (local_dir / "procs.json").write_text(
            json.dumps(
                {
                    "daemon_pid": dead.pid,
                    "groups": {
                        "i-leftover": {"pgid": ours.pid, "start_ticks": procs.start_ticks(ours.pid)},
                        # A pid reused by another program: start time differs, must not be touched.
                        "i-reused": {"pgid": unrelated.pid, "start_ticks": 1},
                    },
                }
            )
        )
        info = local.ensure_started(timeout=60)
        assert info["pid"] not in (dead.pid, os.getpid())
        wait_for(lambda: ours.poll() is not None, timeout=30, what="leftover killed")
        assert unrelated.poll() is None
        assert local.status()["running"]

        # The daemon dies hard (SIGKILL), leaving an instance group behind: `stop` cleans up.
        grp = subprocess.Popen(["sleep", "600"], start_new_session=True)
        (local_dir / "procs.json").write_text(
            json.dumps({"groups": {"i-x": {"pgid": grp.pid, "start_ticks": procs.start_ticks(grp.pid)}}})
        )
        os.kill(info["pid"], 9)
        wait_for(lambda: not procs.is_alive(info["pid"]), timeout=5, what="daemon dead")
        assert local.status()["running"] is False
        res = local.stop()
        assert res["was_running"] is False and res["leftovers_killed"] == [
            {"instance_id": "i-x", "pgid": grp.pid}
        ]
        assert grp.wait(timeout=5) is not None
        assert not (local_dir / "cloud.json").exists() and not (local_dir / "procs.json").exists()
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        ours.kill()
        unrelated.wait()
        ours.wait()


# ---- Terminating:Wait (the termination lifecycle hook) ------------------------------------------
def _scale_in_one(cloud, job: dict) -> tuple[str, float]:
    import time

    group = job["groups"]["workers"]
    (inst,) = wait_for(lambda: cloud.running(job["job"]), what="worker")
    t0 = time.monotonic()
    cloud.asg.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=0)
    return inst["instance_id"], t0


def test_terminating_wait_outlasts_an_agent_that_exits_without_completing(cloud) -> None:
    """As on AWS: the agent exiting does not end Terminating:Wait; only the hook timeout does."""
    import time

    job = cloud.make_job("tw-exit", workers=1, drain_timeout=6)  # the stand-in exits 0 on SIGTERM
    iid, t0 = _scale_in_one(cloud, job)
    pid = cloud.standin(iid)["pid"]
    wait_for(lambda: cloud.drained(iid), what="SIGTERM seen")
    wait_for(lambda: not procs.is_alive(pid), timeout=10, what="stand-in gone")
    assert cloud.instance(iid)["state"] == "draining"  # agent gone, instance still waiting
    assert cloud.imds(iid, "meta-data/autoscaling/target-lifecycle-state") == (200, "Terminated")
    wait_for(lambda: cloud.instance(iid)["state"] == "terminated", timeout=30, what="hook timeout")
    assert time.monotonic() - t0 >= 6


def test_terminating_wait_ends_when_the_action_is_completed(cloud) -> None:
    """The agent (here: the test) completes the action after its process exited: no waiting out."""
    import time

    job = cloud.make_job("tw-done", workers=1, drain_timeout=60)
    iid, t0 = _scale_in_one(cloud, job)
    pid = cloud.standin(iid)["pid"]
    wait_for(lambda: not procs.is_alive(pid), timeout=10, what="stand-in gone")
    time.sleep(1)
    assert cloud.instance(iid)["state"] == "draining"
    cloud.asg.complete_lifecycle_action(
        AutoScalingGroupName=job["groups"]["workers"],
        LifecycleHookName="petctl-drain",
        LifecycleActionResult="CONTINUE",
        InstanceId=iid,
    )
    wait_for(lambda: cloud.instance(iid)["state"] == "terminated", timeout=10, what="terminated")
    assert time.monotonic() - t0 < 30  # far below the 60 s hook timeout


def test_terminating_wait_for_an_instance_whose_agent_already_exited(cloud) -> None:
    """An agent that ended earlier (job over, or crashed) cannot complete: the instance waits it out."""
    import time

    cloud.make_job("tw-gone", workers=1, drain_timeout=2, mode="crash")
    inst = wait_for(
        lambda: next((i for i in cloud.instances("tw-gone") if i["state"] == "exited"), None), what="exit"
    )
    t0 = time.monotonic()
    cloud.asg.set_desired_capacity(AutoScalingGroupName="petctl-tw-gone-workers", DesiredCapacity=0)
    wait_for(lambda: cloud.instance(inst["instance_id"])["state"] == "draining", what="Terminating:Wait")
    wait_for(lambda: cloud.instance(inst["instance_id"])["state"] == "terminated", timeout=30, what="timeout")
    assert time.monotonic() - t0 >= 2
