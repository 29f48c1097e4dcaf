"""The client side of the local cloud: find or start its daemon, point a process at it, and
call its control API.

Deliberately import-light (standard library only, no boto3/moto/torch) because the CLI
imports it on every ``--local`` command.

State lives in :func:`state_dir`::

    cloud.json          endpoints and pid of the running daemon (absent when stopped)
    cloud.log           the daemon's own log
    procs.json          process groups the daemon started (for cleanup after a crash)
    logs/<id>.log       output of each instance's process tree
    instances/<id>/     each instance's boot script, shims (bin/) and root/ (its /etc, /var, …)
    venvs/<job>/        each job's environments, shared by its instances
    efs/<fs-id>/        the "EFS" file systems
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from petctl.errors import PetctlError
from petctl.local import efs_rate, statedir
from petctl.local.environment import CONTROL_TOKEN_HEADER, LOCAL_ENV, LOCAL_ENV_UNSET
from petctl.local.statedir import DAEMON_MODULE, cloud_log, instance_log, state_dir


class LocalCloudError(PetctlError):
    """The local cloud could not do what was asked (not running, unknown instance, …)."""


def _http_answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except (OSError, ValueError):
        return False


def _daemon_env(d: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_ENV_UNSET and k != "AWS_ENDPOINT_URL"}
    env.update(LOCAL_ENV)
    env["PETCTL_LOCAL_DIR"] = str(d)
    env["PYTHONUNBUFFERED"] = "1"
    # The daemon must import this very petctl, even when it is run from a source tree.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------- lifecycle


def ensure_started(timeout: float = 30) -> dict[str, Any]:
    """Start the daemon unless it is running; wait until moto answers.

    A stale ``cloud.json`` (dead pid, or a pid now used by another program) is
    discarded, and instance process groups left behind by a daemon that died
    without cleaning up are killed first.

    Returns:
        The contents of ``cloud.json``: ``pid``, ``endpoint_url``, ``imds_url``,
        ``region``, ``started_at``, ``log_file``, ``state_dir``, ``control_token``.
    """
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    with statedir.file_lock(d / "start.lock", timeout, LocalCloudError):
        info = statedir.running_info(d)
        if info and _http_answers(info["endpoint_url"]):
            return info
        if statedir.daemon_lock_held(d):
            # A daemon is alive but not (yet) answering: wait for it rather than start a second one.
            return _wait_ready(d, None, timeout)
        with contextlib.suppress(FileNotFoundError):
            (d / "cloud.json").unlink()
        try:
            efs_rate.rates_from_env()  # a bad knob fails here, in one line, not in the daemon
        except efs_rate.EfsRateError as e:
            raise LocalCloudError(str(e)) from None
        statedir.cleanup_leftovers(d)
        with open(cloud_log(d), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", DAEMON_MODULE, "--state-dir", str(d)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(d),
                env=_daemon_env(d),
                start_new_session=True,  # outlives the CLI and its terminal's Ctrl-C
                close_fds=True,
            )
        return _wait_ready(d, proc, timeout)


def _wait_ready(d: Path, proc: subprocess.Popen | None, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LocalCloudError(
                f"the local cloud daemon exited with code {proc.returncode} while starting; "
                f"see {cloud_log(d)}:\n{_tail(cloud_log(d))}"
            )
        info = statedir.running_info(d)
        if info and (proc is None or info["pid"] == proc.pid) and _http_answers(info["endpoint_url"]):
            return info
        time.sleep(0.1)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        statedir.wait_pid_gone(proc.pid, 10)
    raise LocalCloudError(f"the local cloud did not start within {timeout:.0f}s; see {cloud_log(d)}")


def stop(timeout: float = 30) -> dict[str, Any]:
    """Stop the daemon: it kills every instance process group it started, then its servers.

    Nothing is drained (the whole cloud goes away at once). The cloud's AWS state is
    in memory and is lost. Idempotent.

    Returns:
        ``{"was_running", "pid", "instances": [{instance_id, pgid}…], "leftovers_killed": […]}``
    """
    d = state_dir()
    result: dict[str, Any] = {"was_running": False, "pid": None, "instances": [], "leftovers_killed": []}
    if not d.exists():
        return result
    info = statedir.running_info(d)
    pid = info["pid"] if info else statedir.starting_pid(d)
    if pid:
        result.update(was_running=True, pid=pid)
        if info:
            with contextlib.suppress(LocalCloudError):
                st = _control(info, "GET", "/_control/status", timeout=5)
                result["instances"] = [
                    {"instance_id": i["instance_id"], "pgid": i.get("pgid")}
                    for i in st.get("instances", [])
                    if i.get("alive")
                ]
        os.kill(pid, signal.SIGTERM)
        if not statedir.wait_pid_gone(pid, timeout):
            # The daemon is stuck: kill it; its instance groups are cleaned up from procs.json below.
            os.kill(pid, signal.SIGKILL)
            statedir.wait_pid_gone(pid, 5)
            result["daemon_killed"] = True
    result["leftovers_killed"] = statedir.cleanup_leftovers(d)
    with contextlib.suppress(FileNotFoundError):
        (d / "cloud.json").unlink()
    return result


def status() -> dict[str, Any]:
    """Whether the daemon runs, its endpoints, and its instances (role, job, ip, pid, state)."""
    d = state_dir()
    info = statedir.running_info(d) if d.exists() else None
    out: dict[str, Any] = {"running": bool(info), "state_dir": str(d), "log_file": str(cloud_log(d))}
    if not info:
        out["instances"] = []
        return out
    out.update({k: info.get(k) for k in ("pid", "endpoint_url", "imds_url", "region", "started_at")})
    st = _control(info, "GET", "/_control/status", timeout=10)
    out["instances"] = st.get("instances", [])
    return out


def activate(environ: MutableMapping[str, str] | None = None, timeout: float = 30) -> dict[str, Any]:
    """Start the local cloud if needed and point this process's AWS settings at it.

    Sets ``AWS_ENDPOINT_URL`` and :data:`LOCAL_ENV`, and removes :data:`LOCAL_ENV_UNSET`
    (a real ``AWS_PROFILE`` must not win over the fake credentials).
    """
    env = os.environ if environ is None else environ
    info = ensure_started(timeout)
    for k in LOCAL_ENV_UNSET:
        env.pop(k, None)
    env.update(LOCAL_ENV)
    env["AWS_ENDPOINT_URL"] = info["endpoint_url"]
    return info


# ---------------------------------------------------------------------------- control API


def _control(info: dict[str, Any], method: str, path: str, timeout: float = 30) -> dict[str, Any]:
    req = urllib.request.Request(
        info["imds_url"].rstrip("/") + path,
        method=method,
        headers={CONTROL_TOKEN_HEADER: info.get("control_token", "")},
        data=b"" if method == "POST" else None,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", str(e))
        except ValueError:
            message = str(e)
        raise LocalCloudError(message) from None
    except (OSError, ValueError) as e:
        raise LocalCloudError(
            f"cannot reach the local cloud's control API ({e}); see {cloud_log()}"
        ) from None


def _running_or_fail() -> dict[str, Any]:
    info = statedir.running_info(state_dir())
    if not info:
        raise LocalCloudError("the local cloud is not running: start it with `petctl local start`")
    return info


def kill_instance(instance_id: str) -> dict[str, Any]:
    """Hard failure: SIGKILL the instance's whole tree (no drain), then terminate it in the
    Auto Scaling group without decrementing the desired capacity, so the group replaces it."""
    return _control(_running_or_fail(), "POST", f"/_control/kill-instance/{instance_id}")


def spot_interrupt(instance_id: str, seconds: float = 120) -> dict[str, Any]:
    """Post a spot interruption notice (IMDS ``spot/instance-action``, time = now + ``seconds``).

    At that time (or as soon as the instance's process tree exits, whichever is first)
    the instance is shut down and terminated in its group, which replaces it.
    """
    return _control(
        _running_or_fail(), "POST", f"/_control/spot-interrupt/{instance_id}?seconds={float(seconds)}"
    )


def restart_rdzv(job: str) -> dict[str, Any]:
    """Reboot the job's rendezvous instance: SIGKILL its etcd and start it again on the same data dir."""
    return _control(_running_or_fail(), "POST", f"/_control/restart-rdzv/{job}")


def log_path(instance_id: str | None = None) -> Path:
    """The cloud's log, or one instance's log."""
    return instance_log(instance_id) if instance_id else cloud_log()
