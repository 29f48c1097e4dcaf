"""Processes for the live tests and bench/bench_live.py: a lighthouse and replica groups running
examples/live_train.py, each group one process whose step lines are parsed as they come."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "live_train.py"
STEP = re.compile(r"^step=(\d+) world_size=(\d+) params=(\w+) mono=([\d.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, poll: float = 0.05):
    """Poll ``pred`` until it returns a true value (returned) or fail after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


class Lighthouse:
    def __init__(self, tmp: Path, port: int | None = None, heartbeat_ms: int = 1000) -> None:
        self.port = port or free_port()
        self.heartbeat_ms = heartbeat_ms
        self.log = tmp / f"lighthouse-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Lighthouse:
        cmd = [sys.executable, "-m", "petctl_agent.live.lighthouse", "--bind", f"127.0.0.1:{self.port}"]
        cmd += ["--heartbeat-timeout-ms", str(self.heartbeat_ms)]
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: b"lighthouse listening" in self.log.read_bytes(), 30, "the lighthouse")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Step:
    step: int
    world: int
    params: str
    mono: float


class Replica:
    """One replica group: one worker process of the example, its stdout parsed as it comes."""

    def __init__(self, name: str, lighthouse: Lighthouse, tmp: Path, *args: str, env: dict | None = None):
        self.name = name
        self.drain_file = tmp / f"{name}.drain"
        self.err = tmp / f"{name}.err"
        e = dict(os.environ)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            e.pop(k, None)
        e.update(
            PETCTL_LIVE_LIGHTHOUSE=lighthouse.addr,
            PETCTL_LIVE_REPLICA_ID=name,
            PETCTL_LOCAL_ADDR="127.0.0.1",
            PETCTL_DRAIN_FILE=str(self.drain_file),
            PYTHONUNBUFFERED="1",
        )
        e.update(env or {})
        cmd = [sys.executable, str(EXAMPLE), "--steps", "100000", "--step-time", "0.1", *args]
        self.proc = subprocess.Popen(
            cmd, env=e, stdout=subprocess.PIPE, stderr=open(self.err, "wb"), text=True
        )
        self.pid = self.proc.pid
        self.steps: list[Step] = []
        self.other: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            m = STEP.match(line)
            if m:
                self.steps.append(Step(int(m[1]), int(m[2]), m[3], float(m[4])))
            else:
                self.other.append(line.rstrip())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    def params_at(self, step: int) -> str | None:
        # the last line of that step number: a discarded attempt repeats the number
        found = [s.params for s in self.steps if s.step == step]
        return found[-1] if found else None

    def wait_lines(self, pred, timeout: float, what: str) -> Step:
        """Wait for a step line (after those seen now) matching ``pred``; fail if the process died."""
        start = len(self.steps)

        def seen():
            if not self.alive() and len(self.steps) == start:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            return next((s for s in self.steps[start:] if pred(s)), None)

        return wait_for(seen, timeout, f"{self.name}: {what}")

    def tail(self, n: int = 15) -> str:
        lines = self.err.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if "[INFO]" not in line)[-3000:] or "\n".join(lines[-n:])

    def drain(self) -> None:
        self.drain_file.touch()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait(10)


def stall_around(r: Replica, t: float, until: float) -> float:
    """The survivor's longest gap between step lines from just before ``t`` to ``until`` (for the log)."""
    ts = [s.mono for s in r.steps if t - 1 <= s.mono <= until]
    return max((b - a for a, b in zip(ts, ts[1:])), default=float("nan"))


def listening(pid: int) -> set[str]:
    """``host:port`` of every TCP socket ``pid`` listens on (from /proc; no psutil)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if v6:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    host = socket.inet_ntop(socket.AF_INET6, words)
                else:
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                found.add(f"{host}:{int(hexport, 16)}")
    return found
