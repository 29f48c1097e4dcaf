"""A parent that has imported torch once and forks the ranks of :func:`tests.ranks.run_ranks`.

Each rank is still a process of its own, with its own environment, working directory, argv,
stdout and stderr, and its exit status: what changes is that it starts as a fork of a process
that already imported torch (~1.4 s of CPU a fresh interpreter spends before the script's first
line), as the agent's workers start from its forkserver. One zygote serves each pytest process;
``PETCTL_TEST_FRESH_RANKS=1`` starts every rank as a fresh interpreter instead.

Requests go over a SOCK_SEQPACKET socket pair: the client sends one JSON message (argv, env,
cwd) with the rank's stdout and stderr descriptors; the zygote answers with the child's pid, and
later with its exit code (``os.waitstatus_to_exitcode``: minus the signal for a killed one). The
zygote stays single-threaded (a fork copies only the calling thread) and ends when the client
closes its end.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.optim",
)


class Forked:
    """The part of ``subprocess.Popen`` run_ranks uses, for a rank the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.zygote.wait_exit(self.pid, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client side: :meth:`spawn` a rank, read exits as the zygote reports them."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self._spawn_lock = threading.Lock()
        self._pids: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:
                with self._cond:
                    self._gone = True
                    self._cond.notify_all()
                self._pids.put(None)
                return
            m = json.loads(msg)
            if "pid" in m:
                self._pids.put(m["pid"])
            else:
                with self._cond:
                    self._exits[m["exit"]] = m["code"]
                    self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def spawn(self, args: list[str], env: dict[str, str], stdout, stderr, cwd: str | None = None) -> Forked:
        req = json.dumps({"argv": args, "env": env, "cwd": cwd or os.getcwd()}).encode()
        with self._spawn_lock:
            socket.send_fds(self.sock, [req], [stdout.fileno(), stderr.fileno()])
            pid = self._pids.get(timeout=60)
        if pid is None:
            raise RuntimeError("the ranks' zygote exited")
        return Forked(self, pid, args)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid not in self._exits and self._gone:
                return -signal.SIGKILL  # its parent died: it was never reaped here
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote | None:
    """This process's zygote (started at the first call), or None when ranks start fresh."""
    global _ZYGOTE
    if os.environ.get("PETCTL_TEST_FRESH_RANKS") == "1":
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive:
            _ZYGOTE = Zygote()
        return _ZYGOTE


# ---- the zygote process ------------------------------------------------------------------------


def _serve(fd: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock)
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            return  # the client closed its end
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(req, fds)  # runs the script; this process then exits as the script's would
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become(req: dict, fds: list[int]) -> None:
    """In the child: the rank's environment, directory, streams and argv, then its script as
    ``__main__``. An uncaught exception or ``sys.exit`` ends this process as they end a fresh
    interpreter (the traceback on stderr, exit 1; the given code), threads joined, atexit run."""
    import faulthandler
    import runpy

    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for f in (devnull, *fds):
        os.close(f)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False, buffering=1 if req["env"].get("PYTHONUNBUFFERED") else -1)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115
    if req["env"].get("PYTHONFAULTHANDLER"):
        faulthandler.enable(sys.stderr)
    script, *rest = req["argv"][1:]
    script = os.path.abspath(script)
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *[p for p in sys.path[1:] if p not in extra]]
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
