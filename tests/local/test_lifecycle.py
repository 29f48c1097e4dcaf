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
        wait_for(lambda: ours.poll() is not None, timeout=5, what="leftover killed")
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
