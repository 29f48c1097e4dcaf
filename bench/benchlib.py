"""Real-process plumbing shared by ``bench/bench_elastic.py`` and ``tests/faults``.

One *run* = a real etcd 3.5 (v2 API) on a free 127.0.0.1 port, a tiny IMDS
look-alike, a shared "EFS" directory and N *nodes*. A node is one process group
bound to its own loopback address 127.0.0.N: either ``petctl-agent run`` (as in
production: only the local-cloud plumbing env is set) or plain ``torchrun``
with torch's defaults and an etcd rendezvous backend. Every node runs the same
``scripts/elastic_train.py``; its ``step=<n> world_size=<w> loss=<x>`` lines are
timestamped (``time.monotonic()``) as they are read.

etcd, the IMDS look-alike and the process helpers come from ``harness.py`` (next to this
file), the one launcher the agent tests use too; what is specific to benchmarking (torchrun
nodes, timestamps, leak accounting) stays here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from harness import Etcd, FakeImds, free_port

from petctl.local import efs_rate
from petctl.local.procs import descendants

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "elastic_train.py"
#: the live tool's training loop (``run-job --live``: torchft replica groups, no worker restarts)
LIVE_SCRIPT = REPO / "examples" / "live_train.py"
#: training scripts the runs may use (a node's workers are found by these names)
SCRIPTS = (SCRIPT.name, "state_train.py", LIVE_SCRIPT.name)
STEP_RE = re.compile(r"step=(\d+) world_size=(\d+) (?:loss|params)=")
#: the training script's own lines for the benchmark (``bench: <what> k=v ...``)
MARK_RE = re.compile(r"bench: (\w+) (.*)$")
MONO_RE = re.compile(r" mono=(\d+\.\d+)")


def _mono(line: str, arrived: float) -> float:
    """When ``line`` was printed: its ``mono=`` (the printer's ``time.monotonic()``) if it has one
    that is not after its arrival, else its arrival."""
    m = MONO_RE.search(line)
    if m is None:
        return arrived
    t = float(m.group(1))
    return t if t <= arrived else arrived


TOOLS = ("petctl", "petctl-live", "petctl-etcd-v2", "torchrun-etcd", "torchrun-etcd-v2")
#: petctl tools -> the job spec's rdzv_backend (petctl-etcd is the agent's default)
PETCTL_BACKENDS = {"petctl": "petctl-etcd", "petctl-live": "petctl-etcd", "petctl-etcd-v2": "etcd-v2"}
#: the tool whose agents run live nodes (``live`` in the job spec; a lighthouse beside etcd)
LIVE = "petctl-live"
BIN = Path(sys.executable).parent  # console scripts next to the interpreter (no pyenv shim)


def _bin(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else (shutil.which(name) or name)


def poll(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Call ``pred`` until it returns something truthy (returned) or ``timeout`` s pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def cpu_busy(sample: float = 1.0) -> float:
    """Fraction of all CPUs busy (anyone's processes) over ``sample`` seconds, from /proc/stat."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t1, i1 = snap()
    time.sleep(sample)
    t2, i2 = snap()
    return 1.0 - (i2 - i1) / max(t2 - t1, 1)


def wait_idle(max_wait: float, threshold: float = 0.5) -> tuple[float, float]:
    """Wait (bounded) until the machine is mostly idle; return (seconds waited, last busy fraction).

    Between our runs none of our processes exist, so what is busy is someone else:
    measuring then would time their load, not the tools.
    """
    t0 = time.monotonic()
    busy = cpu_busy()
    while busy > threshold and time.monotonic() - t0 < max_wait:
        busy = cpu_busy(2.0)
    return time.monotonic() - t0, busy


# ---- processes (descendants: petctl.local.procs) --------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def ppid(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[1]) if st else None


def start_time(pid: int) -> int | None:
    """The kernel start time of ``pid`` (clock ticks): with the pid, a reuse-proof identity."""
    st = _stat(pid)
    return int(st[19]) if st else None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """True if ``pid`` exists, is not a zombie and (if given) started at ``started``."""
    st = _stat(pid)
    if st is None or st[0] == "Z":
        return False
    return started is None or int(st[19]) == started


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ---- Auto Scaling look-alike --------------------------------------------------------------
class FakeAutoScaling:
    """Answers ``DescribeAutoScalingGroups`` with a desired capacity the benchmark sets.

    petctl's agent reads its worker group's desired capacity (a hint that lets a burst of
    joins form one round); on AWS the group's scale-out sets it before the instances boot.
    Every other Auto Scaling action (the job-end scale-to-zero) is acknowledged and ignored.
    """

    def __init__(self, desired: int = 0) -> None:
        self.desired = desired
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                from urllib.parse import parse_qs

                n = int(self.headers.get("Content-Length", "0") or 0)
                form = parse_qs(self.rfile.read(n).decode())
                action = (form.get("Action") or [""])[0]
                ns = 'xmlns="http://autoscaling.amazonaws.com/doc/2011-01-01/"'
                meta = "<ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata>"
                if action == "DescribeAutoScalingGroups":
                    name = (form.get("AutoScalingGroupNames.member.1") or ["bench-workers"])[0]
                    body = (
                        f"<DescribeAutoScalingGroupsResponse {ns}><DescribeAutoScalingGroupsResult>"
                        f"<AutoScalingGroups><member><AutoScalingGroupName>{name}</AutoScalingGroupName>"
                        f"<MinSize>0</MinSize><MaxSize>8</MaxSize><DesiredCapacity>{fake.desired}</DesiredCapacity>"
                        "<Instances></Instances></member></AutoScalingGroups>"
                        f"</DescribeAutoScalingGroupsResult>{meta}</DescribeAutoScalingGroupsResponse>"
                    )
                else:
                    body = f"<{action}Response {ns}>{meta}</{action}Response>"
                b = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(b)))
                self.end_headers()
                self.wfile.write(b)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- nodes --------------------------------------------------------------------------------
@dataclass
class Node:
    """One node: a process group on its own 127.0.0.x address, with its timestamped output."""

    name: str
    addr: str
    proc: subprocess.Popen
    dir: Path
    started: float
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (t, step, world)
    nlines: int = 0
    #: (t, what, {k: v}) from the script's ``bench: <what> k=v ...`` lines
    marks: list[tuple[float, str, dict[str, str]]] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def steps_after(self, t: float, world: int | None = None) -> list[tuple[float, int, int]]:
        return [s for s in list(self.steps) if s[0] > t and (world is None or s[2] == world)]

    def last_step(self, before: float | None = None) -> int:
        st = [s for s in list(self.steps) if before is None or s[0] <= before]
        return st[-1][1] if st else 0

    def last_t(self) -> float:
        st = self.steps
        return st[-1][0] if st else self.started

    def workers(self) -> list[int]:
        """Live training-worker pids under this node.

        A worker is a descendant running the example script, or a process forked by a
        multiprocessing forkserver (an agent may pre-import torch in one and fork workers
        from it: those keep the forkserver's command line).
        """
        out = []
        for p in descendants(self.proc.pid):
            if not pid_alive(p):
                continue
            c = cmdline(p)
            if any(name in c for name in SCRIPTS):
                out.append(p)
            elif "forkserver" in cmdline(ppid(p) or 0) and "resource_tracker" not in c:
                out.append(p)
        return out


@dataclass
class RunConfig:
    tool: str = "petctl"
    min_nodes: int = 2
    max_nodes: int = 8
    step_time: float = 0.05
    total_steps: int = 1_000_000
    checkpoint_every: int = 20
    drain_timeout: float = 60
    job: str = "bench"
    env: dict[str, str] = field(default_factory=dict)  # extra env for every node (tests only)
    #: petctl tools: give the agents a worker group whose desired capacity the run sets
    #: (``Run.asg.desired``), served by :class:`FakeAutoScaling`
    worker_group: bool = False
    #: the training script (``bench/state_train.py`` for the state-size benchmark) and its extra args
    script: Path = SCRIPT
    extra_args: list[str] = field(default_factory=list)
    #: petctl tools: each node's agent gets ``PETCTL_AGENT_SNAPSHOT_DIR=<this>/<node>`` (memory
    #: snapshots on, in a directory the run removes); "" leaves the agent's default
    snapshot_root: str = ""
    #: every node (petctl and torchrun) gets ``PETCTL_EFS_EMULATION``: the local cloud's EFS limits
    #: (``petctl/local/efs_rate.py``, AWS's Elastic-mode figures; ``PETCTL_LOCAL_EFS_*`` knobs and
    #: ``PETCTL_LOCAL_EFS_THROTTLE=0`` apply) on the run's EFS directory; False: none
    efs_limits: bool = True


class Run:
    """etcd + IMDS + shared dir + nodes for one tool. ``close()`` kills everything it started."""

    def __init__(self, root: Path, cfg: RunConfig) -> None:
        if cfg.tool not in TOOLS:
            raise ValueError(f"tool {cfg.tool!r} not in {TOOLS}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.run_id = f"{cfg.job}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.efs = self.root / "efs"
        self.ckpt_rel = f"petctl/jobs/{self.run_id}/checkpoints"
        self.ckpt_dir = self.efs / self.ckpt_rel
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # AWS's EFS limits, as in the local cloud (docs/local.md): each node is a client of "efs/"
        self.efs_rates = efs_rate.rates_from_env() if cfg.efs_limits else None
        self.status_dir = self.root / "status"
        self.etcd = Etcd(self.root)
        self.imds: FakeImds | None = None
        self.asg: FakeAutoScaling | None = None
        self.nodes: list[Node] = []
        self.seen: dict[int, int] = {}  # pid -> start time of every process this run started
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_pids, daemon=True)
        self.spec_path = self.root / "job.json"
        #: the live tool's lighthouse, on etcd's host as on the rendezvous instance
        self.lighthouse: Any = None
        if cfg.tool == LIVE:
            from live_harness import Lighthouse  # bench/, next to this file

            self.lighthouse = Lighthouse(self.root)
        if cfg.tool in PETCTL_BACKENDS:
            self.imds = FakeImds()
            if cfg.worker_group:
                self.asg = FakeAutoScaling()
            self._write_spec()

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.etcd.start()
        self._see([self.etcd.proc.pid] if self.etcd.proc else [])
        if self.lighthouse is not None:
            self.lighthouse.start()
            self._see([self.lighthouse.proc.pid])
        self._sampler.start()

    def _see(self, pids: list[int]) -> None:
        for p in pids:
            if p not in self.seen:
                st = start_time(p)
                if st is not None:
                    self.seen[p] = st

    def script_args(self) -> list[str]:
        c = self.cfg
        if c.tool == LIVE:  # examples/live_train.py: no checkpoints of its own (peers hold the state)
            return ["--steps", str(c.total_steps), "--step-time", str(c.step_time), *c.extra_args]
        return [
            "--total-steps", str(c.total_steps), "--step-time", str(c.step_time),
            "--checkpoint-every", str(c.checkpoint_every), *c.extra_args,
        ]  # fmt: skip

    def _write_spec(self) -> None:
        c = self.cfg
        code = self.root / "code"
        code.mkdir(exist_ok=True)
        script = Path(c.script)
        shutil.copy(script, code / script.name)
        spec = {
            "version": 1,
            "job_name": self.run_id
            if re.match(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$", self.run_id)
            else "bench-job",
            "user": "bench",
            "region": "us-east-1",
            "min_nodes": c.min_nodes,
            "max_nodes": c.max_nodes,
            "nproc_per_node": "auto",
            "code_url": f"file://{code / script.name}",
            "code_kind": "script",
            "script": script.name,
            "args": self.script_args(),
            "env": {},
            "checkpoint_dir": self.ckpt_rel,
            "status_url": f"file://{self.status_dir}/",
            "log_group": "",
            "worker_group": "bench-workers" if self.asg is not None else "",
            "rdzv_group": "",
            "lifecycle_hook": "",
            "drain_timeout": c.drain_timeout,
            "rdzv_port": self.etcd.port,
            "rdzv_backend": PETCTL_BACKENDS[c.tool],
        }
        if self.lighthouse is not None:
            spec.update(live=True, lighthouse_port=self.lighthouse.port)
        self.spec_path.write_text(json.dumps(spec, indent=2))

    def add_node(self) -> Node:
        """Start the next node (127.0.0.<10+i>) and return it at once."""
        i = len(self.nodes) + 1
        name, addr = f"n{i}", f"127.0.0.{10 + i}"
        ndir = self.root / "nodes" / name
        ndir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # never real AWS, whatever happens: nothing, or the Auto Scaling look-alike
            "AWS_ENDPOINT_URL": self.asg.url if self.asg is not None else "http://127.0.0.1:9",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        for k in [k for k in env if k.startswith(("PETCTL_", "TORCH_DISABLE_SHARE", "TORCHELASTIC_"))]:
            del env[k]  # a clean node: only what we set below
        if self.cfg.tool in PETCTL_BACKENDS:
            assert self.imds is not None
            env.update(
                PETCTL_IMDS_URL=self.imds.add(f"i-{name}", addr),
                PETCTL_EFS_MOUNT=str(self.efs),
                PETCTL_AGENT_DIR=str(ndir / "agent"),
            )
            if self.cfg.snapshot_root:
                env["PETCTL_AGENT_SNAPSHOT_DIR"] = str(Path(self.cfg.snapshot_root) / name)
            cmd = [
                _bin("petctl-agent"), "run", "--spec", f"file://{self.spec_path}",
                "--rdzv-endpoint", self.etcd.endpoint, "--local-addr", addr,
            ]  # fmt: skip
        else:
            backend = "etcd-v2" if self.cfg.tool == "torchrun-etcd-v2" else "etcd"
            cmd = [
                _bin("torchrun"), "--nnodes", f"{self.cfg.min_nodes}:{self.cfg.max_nodes}",
                "--nproc-per-node", "1", "--rdzv-backend", backend,
                "--rdzv-endpoint", self.etcd.endpoint, "--rdzv-id", self.run_id,
                "--max-restarts", "100", "--local-addr", addr,
                str(self.cfg.script), "--checkpoint-dir", str(self.ckpt_dir), *self.script_args(),
            ]  # fmt: skip
        env.update(efs_rate.instance_env(self.root, f"i-{name}", self.efs_rates))
        env.update(self.cfg.env)
        with open(ndir / "stderr.log", "ab") as err:
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=str(ndir),
            )  # fmt: skip
        node = Node(name, addr, proc, ndir, time.monotonic())
        self.nodes.append(node)
        self._see([proc.pid])
        threading.Thread(target=self._read, args=(node,), daemon=True).start()
        if self.lighthouse is not None:
            threading.Thread(target=self._tail_live, args=(node,), daemon=True).start()
        return node

    def _tail_live(self, node: Node) -> None:
        """A live node's workers write their step lines to the agent's log files
        (``logs/live/attempt_<n>/<local rank>/stdout.log``), not to its stdout: follow them.
        Their lines carry ``mono=``, so the poll's delay does not enter the times."""
        offsets: dict[Path, int] = {}
        while True:
            alive = node.alive()  # one more pass after the node ended: its last lines
            for path in sorted(node.dir.glob("agent/**/live/attempt_*/*/stdout.log")):
                try:
                    with open(path, "rb") as f:
                        f.seek(offsets.get(path, 0))
                        data = f.read()
                except OSError:
                    continue
                end = data.rfind(b"\n") + 1
                offsets[path] = offsets.get(path, 0) + end
                t = time.monotonic()
                for raw in data[:end].splitlines():
                    self._line(node, raw.decode(errors="replace"), t)
            if not alive or self._stop.is_set():
                return
            time.sleep(0.1)

    def _read(self, node: Node) -> None:
        assert node.proc.stdout is not None
        with open(node.dir / "stdout.log", "a") as log:
            for raw in node.proc.stdout:
                t = time.monotonic()
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(f"{t:.3f} {line}\n")
                self._line(node, line, t)

    @staticmethod
    def _line(node: Node, line: str, t: float) -> None:
        """One line of a node's output, read at ``t``: a step or a mark."""
        node.nlines += 1
        # a line that says when it was printed (state_train.py, live_train.py: mono=, the worker's
        # time.monotonic(), the same clock) is timed by that, not by its arrival here: a worker's
        # line reaches the agent's stdout only at its log tailer's next poll (0.2 s)
        m = STEP_RE.search(line)
        if m:
            node.steps.append((_mono(line, t), int(m.group(1)), int(m.group(2))))
            return
        m = MARK_RE.search(line)
        if m:
            kv = dict(x.split("=", 1) for x in m.group(2).split() if "=" in x)
            node.marks.append((_mono(line, t), m.group(1), kv))

    def _sample_pids(self) -> None:
        while not self._stop.wait(0.25):
            for n in list(self.nodes):
                if n.alive():
                    self._see(descendants(n.proc.pid))

    # ---- events ---------------------------------------------------------------------------
    def _signal_tree(self, node: Node, sig: signal.Signals) -> tuple[float, list[int]]:
        """Send ``sig`` to the node's process group and to every process of its tree (a worker
        may have left the group); return the event time and the pids signalled."""
        victims = descendants(node.proc.pid)
        self._see(victims)
        t = time.monotonic()
        try:
            os.killpg(node.proc.pid, sig)
        except ProcessLookupError:
            pass
        kill_pids(victims, sig)
        return t, victims

    def kill_node(self, node: Node) -> float:
        """SIGKILL the node's whole process tree (an instance vanishing); return the event time."""
        t, _ = self._signal_tree(node, signal.SIGKILL)
        try:
            node.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return t

    def vanish_node(self, node: Node) -> float:
        """SIGSTOP the node's whole process tree (agent, forkserver, workers): an instance that
        vanishes on real AWS (spot reclaim, kernel panic, partition, power) sends no RST, so its
        peers' sockets stay open and their collectives hang instead of failing; its lease is no
        longer kept alive. :meth:`kill_node` / :meth:`close` still end it (SIGKILL ends stopped
        processes). Returns the event time."""
        t, victims = self._signal_tree(node, signal.SIGSTOP)
        late = [p for p in descendants(node.proc.pid) if p not in victims]  # forked meanwhile
        self._see(late)
        kill_pids(late, signal.SIGSTOP)
        return t

    def terminate_node(self, node: Node) -> float:
        """SIGTERM the node's main process only (what an ASG scale-in / systemd stop sends first)."""
        self._see(descendants(node.proc.pid))
        t = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        return t

    def restart_etcd(self, down: float = 0.0) -> tuple[float, float]:
        """SIGKILL etcd, wait ``down`` s, start it again on the same port and data dir.

        Returns (time of the kill, time it answered again).
        """
        t_kill = time.monotonic()
        self.etcd.stop(signal.SIGKILL)
        if down > 0:
            time.sleep(down)
        self.etcd.start()
        self._see([self.etcd.proc.pid] if self.etcd.proc else [])
        return t_kill, time.monotonic()

    def replace_etcd(self) -> tuple[float, float]:
        """SIGKILL etcd and start an *empty* one (data dir wiped) on the same port: a replaced server.

        The new one also gets a new peer URL, so its cluster id differs, as a replaced rendezvous
        instance's does (python-etcd refuses answers from another cluster: docs/rendezvous.md).
        Returns (time of the kill, time the new one answered).
        """
        t_kill = time.monotonic()
        self.etcd.stop(signal.SIGKILL)
        shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
        self.etcd.peer_port = free_port()
        self.etcd.start()
        self._see([self.etcd.proc.pid] if self.etcd.proc else [])
        return t_kill, time.monotonic()

    def kill_worker(self, node: Node) -> tuple[float, int] | None:
        """SIGKILL just the training worker under ``node`` (not the node); None if none found."""
        ws = node.workers()
        if not ws:
            return None
        self._see(ws)
        t = time.monotonic()
        kill_pids(ws[:1])
        return t, ws[0]

    # ---- observation ----------------------------------------------------------------------
    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    @staticmethod
    def stepping(nodes: list[Node], world: int, after: float, min_steps: int = 1) -> bool:
        """Every node printed >= ``min_steps`` steps at world size ``world`` after ``after``."""
        return all(len(n.steps_after(after, world)) >= min_steps for n in nodes)

    def wait_stepping(
        self, nodes: list[Node], world: int, after: float, timeout: float, min_steps: int = 1
    ) -> tuple[float | None, str | None]:
        """Wait (bounded) until every node steps at ``world``; return (time it happened, note)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stepping(nodes, world, after, min_steps):
                return max(n.steps_after(after, world)[min_steps - 1][0] for n in nodes), None
            dead = [n for n in nodes if not n.alive()]
            if dead:
                time.sleep(0.3)  # let the reader drain the last lines
                if self.stepping(nodes, world, after, min_steps):
                    continue
                return None, "node(s) exited: " + ", ".join(f"{n.name} rc={n.proc.returncode}" for n in dead)
            time.sleep(0.05)
        got = {n.name: sorted({w for _, _, w in n.steps_after(after)}) for n in nodes}
        return (
            None,
            f"timeout {timeout:.0f}s waiting for world_size={world} on all ranks (world sizes seen: {got})",
        )

    @staticmethod
    def stall(old: list[Node], nodes: list[Node], world: int, after: float) -> float | None:
        """Training stall of a membership change: from the last step any rank of ``old`` printed
        at another world size (before the new world's first step) to the moment every node
        in ``nodes`` has printed a step at ``world`` (after ``after``). None if not reached."""
        firsts = [n.steps_after(after, world) for n in nodes]
        if not all(firsts):
            return None
        t_first = min(f[0][0] for f in firsts)
        t_all = max(f[0][0] for f in firsts)
        lasts = [s[0] for n in old for s in list(n.steps) if s[0] < t_first and s[2] != world]
        if not lasts:
            return None
        return t_all - max(lasts)

    def max_step(self, before: float | None = None) -> int:
        return max((n.last_step(before) for n in self.nodes), default=0)

    def steps_lost(self, nodes: list[Node], world: int, after: float) -> int | None:
        """Last step any rank reached before training resumed minus the first step after resume, + 1.

        "Before the resume" (not "before the event"): ranks keep stepping until
        they notice the event, and that work counts if it is redone.
        """
        firsts = [n.steps_after(after, world) for n in nodes]
        if not all(firsts):
            return None
        t_resume = min(f[0][0] for f in firsts)
        first_step = min(f[0][1] for f in firsts)
        reached = self.max_step(before=t_resume - 1e-6)
        return max(0, reached - first_step + 1)

    def checkpoints(self) -> list[Path]:
        return sorted(self.ckpt_dir.glob("ckpt-*.pt"))

    def status(self, node: Node) -> dict[str, Any] | None:
        try:
            return json.loads((self.status_dir / f"i-{node.name}.json").read_text())
        except (OSError, ValueError):
            return None

    def leftovers(self, include_etcd: bool = True) -> list[int]:
        """Pids this run started (nodes, their descendants, etcd) that are still alive."""
        etcd = self.etcd.proc.pid if self.etcd.proc is not None else None
        return sorted(p for p, st in self.seen.items() if pid_alive(p, st) and (include_etcd or p != etcd))

    def close(self) -> list[int]:
        """Kill every node tree and etcd; return node pids that were still alive *before* the kill."""
        still = self.leftovers(include_etcd=False)
        for n in self.nodes:
            if n.alive():
                self.kill_node(n)
        kill_pids(self.leftovers(include_etcd=False))  # identity-checked: only what we started
        self.etcd.stop()
        if self.lighthouse is not None:
            self.lighthouse.kill()
        self._stop.set()
        if self.imds is not None:
            self.imds.close()
        if self.asg is not None:
            self.asg.close()
        poll(lambda: not self.leftovers(), 10, 0.1)
        if self.cfg.snapshot_root:  # the nodes' memory snapshots: tmpfs, i.e. this machine's RAM
            shutil.rmtree(self.cfg.snapshot_root, ignore_errors=True)
        return still

    def drop_memory(self, node: Node) -> None:
        """Free a gone node's memory snapshots (its instance, and so its RAM, is gone on AWS)."""
        if self.cfg.snapshot_root:
            shutil.rmtree(Path(self.cfg.snapshot_root) / node.name, ignore_errors=True)


#: classic BPF for tc's ``bpf`` classifier (``bytecode``, opcode jt jf k): a TCP packet goes to class
#: 1:(0x100 + ((sport ^ dport) & 255)) (its flow's bucket: both directions of a flow in one), any
#: other to the default. Offsets from the Ethernet header (loopback keeps one): IP at 14, its
#: protocol at 23, the ports after its IHL.
_FLOW_BPF = [
    (0x30, 0, 0, 23),  # ldb [23]: IP protocol
    (0x15, 1, 0, 6),  # jeq #6 (TCP): skip the next
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: the filter's default class
    (0xB1, 0, 0, 14),  # ldx 4*([14]&0xf): the IP header's length
    (0x48, 0, 0, 14),  # ldh [x+14]: source port
    (0x02, 0, 0, 0),  # st M[0]
    (0x48, 0, 0, 16),  # ldh [x+16]: destination port
    (0x61, 0, 0, 0),  # ldx M[0]
    (0xAC, 0, 0, 0),  # xor x
    (0x54, 0, 0, 255),  # and #255
    (0x04, 0, 0, 0x10100),  # add #1:0x100
    (0x16, 0, 0, 0),  # ret a
]


def cap_flows(gbit: float) -> str:
    """Cap every TCP flow on this (private) loopback at ``gbit`` Gbit/s, as AWS caps a single flow
    between two instances (5 Gbit/s outside a cluster placement group, 10 inside: "Amazon EC2
    instance network bandwidth"): htb, one class per flow bucket (256, by a hash of the ports;
    two flows share a bucket's cap with probability ~2% for 4 flows), chosen by a BPF classifier.
    Only ever called inside the bench's own network namespace. "" when applied, else why not."""
    tc = shutil.which("tc")
    if not tc:
        return "no tc"
    rate = int(gbit * 1e9)
    r2q = max(1, rate // 8 // 60000)  # htb's quantum (rate / r2q) near 60 kB
    lines = [
        f"qdisc add dev lo root handle 1: htb default 1 r2q {r2q}",
        "class add dev lo parent 1: classid 1:1 htb rate 400gbit",
    ]
    lines += [f"class add dev lo parent 1: classid 1:{0x100 + i:x} htb rate {rate}bit ceil {rate}bit burst 256k cburst 256k"
              for i in range(256)]  # fmt: skip
    code = ",".join(" ".join(str(x) for x in ins) for ins in _FLOW_BPF)
    lines.append(
        f'filter add dev lo parent 1: protocol ip prio 1 bpf bytecode "{len(_FLOW_BPF)},{code}" classid 1:1'
    )
    r = subprocess.run(
        [tc, "-force", "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True
    )
    if r.returncode != 0:
        subprocess.run([tc, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return (r.stderr.strip().splitlines() or ["tc failed"])[-1]
    return ""


def reexec_in_netns(script: str, argv: list[str]) -> int | None:
    """Run ``script argv`` again inside a private, loopback-only network namespace (``unshare --net``,
    ``BENCH_IN_NETNS`` set); its exit code, or None when that is not possible (or already in one)."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip or os.environ.get("BENCH_IN_NETNS"):
        return None
    if subprocess.run([unshare, "--net", "true"], capture_output=True).returncode != 0:
        return None
    cmd = [unshare, "--net", "--", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh",
           sys.executable, os.path.abspath(script), *argv]  # fmt: skip
    return subprocess.call(cmd, env={**os.environ, "BENCH_IN_NETNS": "1"})


# ---- what bench_state.py and bench_state_local.py both read off a run ---------------------------
def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _med(vals: list[Any]) -> float | None:
    v = [float(x) for x in vals if x is not None]
    return statistics.median(v) if v else None


def _f(v: Any, nd: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


FIVE = 5  # steps after the first at the new size: ``five_more_steps``


def marks_after(nodes: list[Node], t0: float, what: str) -> list[tuple[float, dict[str, str]]]:
    return [(t, kv) for n in nodes for t, w, kv in list(n.marks) if w == what and t > t0]


def restore_events(run: Run, nodes: list[Node], since: float) -> list[dict[str, Any]]:
    """The nodes' ``snapshot_restored`` status events after ``since`` (monotonic)."""
    if run.imds is None:
        return []
    offset = time.time() - time.monotonic()  # status events carry time.time()
    return [e for n in nodes for e in (run.status(n) or {}).get("events", [])
            if e.get("kind") == "snapshot_restored" and e.get("t", 0) - offset > since - 0.05]  # fmt: skip


def add_marks(run: Run, r: dict[str, Any], old: list[Node], nodes: list[Node], world: int, origin: float,
              since: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Into ``r["phases"]`` (seconds from ``origin``): restore time/source and process start ->
    ready of the ranks (re)started after ``since``; last old step and first new step when the
    agents' events gave none (torchrun)."""
    since = origin if since is None else since
    ph = r.setdefault("phases", {})
    rest = marks_after(nodes, since, "restored")
    if rest:
        ph["restore"] = max(float(kv.get("seconds", 0)) for _, kv in rest)
        ph["sources"] = sorted({kv.get("source", "?") for _, kv in rest})
    # petctl: the agents' own account (``snapshot_restored``: self / peer / efs, seconds, bytes)
    evs = poll(lambda: restore_events(run, nodes, since), 3.0 if run.imds is not None and rest else 0, 0.2)
    if evs:
        ph["sources"] = sorted({str(e.get("source")) for e in evs})
        ph["restore_agent"] = max(float(e.get("seconds") or 0) for e in evs)
    # state_train.py's own account of a failure: when the slowest rank saw it (its collective
    # raised) and began to exit; the agents' workers_failed follows once the process is gone
    # and of a start: when the slowest new rank's script began (its first line: the fork from the
    # forkserver and runpy before it) and had its process group and DDP (before its restore)
    for what in ("raised", "exiting", "begun", "grouped"):
        ms = [float(kv["mono"]) for _, kv in marks_after(nodes, since, what) if "mono" in kv]
        if ms:
            ph[f"worker_{what}"] = round(max(ms) - origin, 3)
    ready = marks_after(nodes, since, "started")
    if ready:
        ph["ready"] = round(max(t for t, _ in ready) - origin, 3)
    firsts = [n.steps_after(origin, world) for n in nodes]
    if "first_step" not in ph and all(firsts):
        t_first = min(f[0][0] for f in firsts)
        lasts = [s[0] for n in old for s in list(n.steps) if s[0] < t_first and s[2] != world]
        if lasts:
            ph["last_old_step"] = round(max(lasts) - origin, 3)
        ph["first_step"] = round(max(f[0][0] for f in firsts) - origin, 3)

    # what the steps right after it took: work moved off the stall (a restore's spares) shows here
    def after() -> list[list[tuple[float, int, int]]] | None:
        got = [n.steps_after(origin, world) for n in nodes]
        return got if all(len(f) > FIVE for f in got) else None

    more = poll(after, 5.0, 0.1)
    if more:
        ph["five_more_steps"] = round(max(f[FIVE][0] for f in more) - max(f[0][0] for f in more), 3)
    return r
