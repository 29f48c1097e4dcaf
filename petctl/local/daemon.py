"""The local cloud daemon: ``python -m petctl.local.daemon --state-dir DIR``.

Started detached by :func:`petctl.local.client.ensure_started`; stopped by SIGTERM
(:func:`petctl.local.client.stop`). One process hosts the moto server, the IMDS
emulator, the control API (on the IMDS server's port) and the reconciler. It holds an exclusive lock
on ``DIR/daemon.lock`` for its whole life, so two daemons never share a state
dir, and writes ``DIR/cloud.json`` once every part answers.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from petctl.local import procs
from petctl.local.environment import LOCAL_ENV, REGION

log = logging.getLogger("petctl.local")


class LocalCloud:
    """moto server + IMDS/control server + reconciler, in this process."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.region = REGION
        self.started_at = time.time()
        self.moto: Any = None
        self.imds: Any = None
        self.reconciler: Any = None
        self._loop: threading.Thread | None = None

    def start(self) -> None:
        import boto3
        import botocore.config
        from moto.server import ThreadedMotoServer

        from petctl.local import moto_patches
        from petctl.local.control import ControlApi
        from petctl.local.imds import ImdsServer
        from petctl.local.reconciler import Reconciler

        moto_patches.apply()
        self.moto = ThreadedMotoServer(
            ip_address="127.0.0.1", port=int(os.environ.get("PETCTL_LOCAL_PORT") or 0), verbose=False
        )
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        session = boto3.session.Session(
            aws_access_key_id=LOCAL_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=LOCAL_ENV["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=LOCAL_ENV["AWS_SESSION_TOKEN"],
            region_name=self.region,
        )
        cfg = botocore.config.Config(retries={"max_attempts": 3}, connect_timeout=5, read_timeout=60)
        clients = {
            name: session.client(name, endpoint_url=self.endpoint_url, config=cfg)
            for name in ("ec2", "autoscaling", "s3", "efs", "iam")
        }
        self.control = ControlApi(self)
        self.imds = ImdsServer(
            self.region, self.control, port=int(os.environ.get("PETCTL_LOCAL_IMDS_PORT") or 0)
        )
        self.reconciler = Reconciler(self.state_dir, clients, self.endpoint_url, self.imds.url, self.region)
        self.reconciler.observer.count_changes()  # moto answers in this process
        self.imds.instances = self.reconciler
        self.imds.start()
        # The first call into each moto backend imports it (seconds); pay that before
        # announcing readiness so the first CLI command is not the slow one.
        self.reconciler.tick()
        if os.environ.get("PETCTL_LOCAL_WARMUP", "1") != "0":
            threading.Thread(target=_warm_backends, name="warm-up", daemon=True).start()
        self._loop = threading.Thread(target=self.reconciler.run, name="reconciler", daemon=True)
        self._loop.start()

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "endpoint_url": self.endpoint_url,
            "imds_url": self.imds.url,
            "region": self.region,
            "started_at": self.started_at,
            "log_file": str(self.state_dir / "cloud.log"),
            "state_dir": str(self.state_dir),
            "control_token": self.control.token,
        }

    def status(self) -> dict[str, Any]:
        info = {k: v for k, v in self.info().items() if k != "control_token"}
        info["instances"] = self.reconciler.summaries()
        return info

    def shutdown(self) -> list[dict[str, Any]]:
        killed: list[dict[str, Any]] = []
        if self.reconciler is not None:
            killed = self.reconciler.shutdown()
            if self._loop is not None:
                self._loop.join(timeout=10)
        if self.imds is not None:
            self.imds.stop()
        if self.moto is not None:
            self.moto.stop()
        return killed


def _warm_backends() -> None:
    """Import the moto backends ``petctl setup`` / ``run_job`` use, in the background."""
    import importlib

    for name in ("s3", "efs", "cloudformation", "iam", "logs", "sts", "ssm"):
        try:
            importlib.import_module(f"moto.{name}.models")
        except Exception:  # noqa: BLE001 - only a warm-up
            log.debug("warm-up of moto.%s failed", name, exc_info=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m petctl.local.daemon", description=__doc__)
    parser.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    d: Path = args.state_dir.absolute()
    d.mkdir(parents=True, exist_ok=True)

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,  # ensure_started points stdout/stderr at cloud.log
    )
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per API call otherwise
    logging.getLogger("botocore").setLevel(logging.WARNING)

    lock_fd = os.open(d / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.error("another local cloud daemon already runs for %s", d)
        return 3
    os.ftruncate(lock_fd, 0)
    os.write(lock_fd, f"{os.getpid()}\n".encode())  # lets `stop` find a daemon that is still starting

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # survive the terminal that started us
    procs.set_child_subreaper()  # orphaned torch workers re-parent here and get reaped

    cloud = LocalCloud(d)
    try:
        log.info("starting the local cloud in %s (pid %d)", d, os.getpid())
        cloud.start()
        _write_json(d / "cloud.json", cloud.info())
        log.info("ready: AWS endpoint %s, IMDS %s", cloud.endpoint_url, cloud.imds.url)
        while not stop.wait(1.0):
            pass
        log.info("stopping (SIGTERM)")
    except Exception:
        log.exception("the local cloud failed")
        return 1
    finally:
        try:
            (d / "cloud.json").unlink(missing_ok=True)
            killed = cloud.shutdown()
            if killed:
                log.info("killed %d instance process group(s): %s", len(killed), killed)
            # Anything that left its instance's process group is still our descendant (we are
            # its subreaper): the local cloud must not leave a process behind.
            strays = procs.descendants(os.getpid())
            for pid in strays:
                procs.signal_pid(pid, signal.SIGKILL)
            if strays:
                log.info("killed %d stray process(es): %s", len(strays), strays)
            log.info("stopped")
        finally:
            os.close(lock_fd)
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: it would wait for moto's half-done background imports.
    os._exit(code)
