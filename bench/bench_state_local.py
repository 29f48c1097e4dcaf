"""``bench_state.py --via local-cloud``: the same chain through the product's own path.

The harness (``bench_state.py``'s default) starts ``petctl-agent run`` itself, one process group per
node, with a plain etcd and a directory as EFS. This mode runs what a user runs: ``petctl --local
setup``, ``run-job --size N`` of ``bench/state_train.py``, then the membership changes through the
Auto Scaling API -- a drain (``terminate-instance-in-auto-scaling-group`` of the newest instance,
with decrement: its lifecycle hook SIGTERMs the agent, as on AWS) and a join (``petctl scale JOB
--size N``: the group launches an instance, which boots from its user data). Every instance boots,
installs the job's wheel, talks TLS to its etcd, ships its logs and status to moto.

The step lines carry the worker's own ``time.monotonic()`` (``mono=``), and the local cloud runs on
this machine, so an instance's log (``logs/<id>.log``, tailed here) times every step as exactly as
the harness's pipes do; the phases come from the agents' status documents (in moto's S3). The
records have bench_state.py's shape (``tool``: ``petctl-local``), so its tables render both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench_elastic import Miss, measure, steady
from benchlib import MARK_RE, REPO, STEP_RE, Node, Run, _f, _med, _mono, add_marks, mem_available_gib, poll
from cpu_account import CpuAccount

TOOL = "petctl-local"
#: the agent's account of a newcomer's fetch of its peers' snapshot (``checkpointing/fetch.py``)
FETCH_RE = re.compile(r"petctl fetch: (\{.*\})\s*$")


class LogNode:
    """One worker instance, seen through its log: what ``benchlib.Node`` gives the measurements."""

    def __init__(self, name: str, log: Path, started: float) -> None:
        self.name, self.log, self.started = name, log, started
        self.steps: list[tuple[float, int, int]] = []
        self.marks: list[tuple[float, str, dict[str, str]]] = []
        self.fetches: list[dict[str, Any]] = []
        self.gone = False
        self._pos, self._rest = 0, b""

    def alive(self) -> bool:
        return not self.gone

    def read(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return
        now = time.monotonic()
        self._pos += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            m = STEP_RE.search(line)
            if m:
                self.steps.append((_mono(line, now), int(m.group(1)), int(m.group(2))))
                continue
            m = FETCH_RE.search(line)
            if m:
                try:
                    self.fetches.append(json.loads(m.group(1)))
                except ValueError:
                    pass
                continue
            m = MARK_RE.search(line)
            if m:
                kv = dict(x.split("=", 1) for x in m.group(2).split() if "=" in x)
                self.marks.append((_mono(line, now), m.group(1), kv))

    # the harness's own accounts of a node's steps (they read .steps and .started only)
    steps_after = Node.steps_after
    last_step = Node.last_step
    last_t = Node.last_t


class CloudRun:
    """A job on the local cloud, with the parts of ``benchlib.Run`` the chain's measurements read."""

    stepping = staticmethod(Run.stepping)
    stall = staticmethod(Run.stall)
    steps_lost = Run.steps_lost
    max_step = Run.max_step

    def __init__(self, home: Path, job: str, n: int, script_args: list[str], a: argparse.Namespace) -> None:
        self.home, self.job, self.n, self.a = home, job, n, a
        self.env = {**os.environ, "PETCTL_HOME": str(home), "PETCTL_LOCAL_DIR": str(home / "local")}
        if a.no_efs_limits:
            self.env["PETCTL_LOCAL_EFS_THROTTLE"] = "0"
        self.script_args = script_args
        self.cfg = SimpleNamespace(checkpoint_every=a.checkpoint_every)
        self.imds = True  # the agents publish status documents (read from moto): phases() reads them
        self.nodes: list[LogNode] = []
        self.ckpt_dir = Path("/nonexistent")
        self._status_prefix = ""
        self._s3: Any = None
        self._stop = threading.Event()
        self.cpu: CpuAccount | None = CpuAccount()
        self._tail = threading.Thread(target=self._tail_loop, daemon=True)

    # ---- the product's commands ---------------------------------------------------------------
    def petctl(self, *args: str, json_out: bool = True) -> Any:
        cmd = [sys.executable, "-m", "petctl.cli", "--local", *(["-o", "json"] if json_out else []), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=600)
        if p.returncode != 0:
            raise Miss(f"petctl --local {' '.join(args[:2])} failed: {p.stderr.strip()[-400:]}")
        return json.loads(p.stdout) if json_out and p.stdout.strip() else p.stdout

    def aws(self, name: str) -> Any:
        import boto3

        info = json.loads((self.home / "local" / "cloud.json").read_text())
        return boto3.session.Session(
            aws_access_key_id="petctl-local", aws_secret_access_key="petctl-local", region_name="us-east-1"
        ).client(name, endpoint_url=info["endpoint_url"])

    def workers(self) -> list[dict[str, Any]]:
        st = self.petctl("local", "status", "--json")
        return [i for i in st["instances"] if i.get("job") == self.job and i.get("role") == "worker"]

    def in_service(self) -> list[str]:
        asg = self.aws("autoscaling")
        groups = asg.describe_auto_scaling_groups()["AutoScalingGroups"]
        return sorted(
            i["InstanceId"]
            for g in groups
            if any(t["Key"] == "petctl:job" and t["Value"] == self.job for t in g.get("Tags", []))
            and "rdzv" not in g["AutoScalingGroupName"].lower()
            for i in g["Instances"]
            if i["LifecycleState"] == "InService"
        )

    def start(self) -> None:
        self.petctl("setup")
        self.petctl(
            "run-job", "--name", self.job, "--min", str(self.n - 1), "--max", str(self.n), "--size", str(self.n),
            "--drain-timeout", str(int(self.a.timeout)), str(REPO / "bench" / "state_train.py"), "--",
            *self.script_args,
        )  # fmt: skip
        self.ckpt_dir = poll(self._find_ckpt_dir, 120, 0.5) or self.ckpt_dir
        self._tail.start()

    def _find_ckpt_dir(self) -> Path | None:
        from petctl_agent.spec import checkpoint_dir

        found = list((self.home / "local" / "efs").glob(f"*/{checkpoint_dir(self.job)}"))
        return found[0] if found else None

    def add_node(self, iid: str, started: float) -> LogNode:
        node = LogNode(iid, self.home / "local" / "logs" / f"{iid}.log", started)
        self.nodes.append(node)
        return node

    def _tail_loop(self) -> None:
        while not self._stop.wait(0.05):
            for n in list(self.nodes):
                n.read()

    def wait_stepping(self, nodes: list[LogNode], world: int, after: float, timeout: float,
                      min_steps: int = 1) -> tuple[float | None, str | None]:  # fmt: skip
        if poll(lambda: self.stepping(nodes, world, after, min_steps), timeout, 0.05):
            return max(n.steps_after(after, world)[min_steps - 1][0] for n in nodes), None
        got = {n.name: sorted({w for _, _, w in n.steps_after(after)}) for n in nodes}
        return None, f"timeout {timeout:.0f}s waiting for world_size={world} (seen: {got})"

    def status(self, node: LogNode) -> dict[str, Any] | None:
        """The node's agent status document (``status_url`` of the job spec, in moto's S3)."""
        try:
            if self._s3 is None:
                self._s3 = self.aws("s3")
                inst = self.aws("ec2").describe_instances(InstanceIds=[node.name])["Reservations"][0][
                    "Instances"
                ][0]
                spec_url = next(t["Value"] for t in inst["Tags"] if t["Key"] == "petctl:spec")
                bucket, _, key = spec_url[5:].partition("/")
                url = json.loads(self._s3.get_object(Bucket=bucket, Key=key)["Body"].read())["status_url"]
                self._status_prefix = url[5:]
            bucket, _, prefix = self._status_prefix.partition("/")
            return json.loads(
                self._s3.get_object(Bucket=bucket, Key=f"{prefix}{node.name}.json")["Body"].read()
            )
        except Exception:  # noqa: BLE001 - not published yet, or gone: no phases, not a failure
            return None

    def cloud_cpu(self) -> float | None:
        """CPU seconds the local cloud's daemon (moto, IMDS, the reconciler: the emulator, not the
        product) has used so far; None when unknown."""
        try:
            pid = json.loads((self.home / "local" / "cloud.json").read_text())["pid"]
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, KeyError, IndexError):
            return None

    def close(self) -> None:
        self._stop.set()
        if self.cpu is not None:
            self.cpu.close()
        try:
            self.petctl("local", "stop", json_out=False)
        except (Miss, subprocess.TimeoutExpired) as e:
            print(f"# local stop: {e}", file=sys.stderr, flush=True)
        # the instances' memory snapshots (their RAM on AWS) outlive a SIGKILLed tree here
        shutil.rmtree(Path("/dev/shm/petctl") / self.job, ignore_errors=True)


def mem_guard(stop_below: float, stop: threading.Event, why: list[str], cloud: CloudRun) -> None:
    """Stop the whole local cloud when ``MemAvailable`` drops under ``stop_below`` GiB (shared box)."""

    while not stop.wait(0.25):
        avail = mem_available_gib()
        if avail < stop_below and not why:
            why.append(f"stopped: MemAvailable {avail:.2f} GiB < {stop_below:g} GiB")
            cloud.close()


def chain(run: CloudRun, n: int, a: argparse.Namespace, rec: Any) -> None:

    t0 = time.monotonic()
    run.start()
    ids = poll(lambda: (lambda x: x if len(x) == n else None)(run.in_service()), a.start_timeout, 0.5)
    if not ids:
        raise Miss(f"cold start: {n} instances not InService")
    nodes = [run.add_node(i, t0) for i in ids]
    t, note = run.wait_stepping(nodes, n, t0, a.start_timeout)
    if t is None:
        raise Miss(f"cold start of {n}: {note}")
    rec("cold_start", seconds=t - t0, from_event=t - t0, steps_lost=None)
    steady(run, nodes, n, a.timeout)

    # drain: the newest instance leaves through its group (the lifecycle hook's SIGTERM)
    leaving = nodes[-1]
    live = nodes[:-1]
    t0, cpu0 = time.monotonic(), run.cloud_cpu()
    run.aws("autoscaling").terminate_instance_in_auto_scaling_group(
        InstanceId=leaving.name, ShouldDecrementDesiredCapacity=True
    )
    r = measure(run, nodes, live, n - 1, t0, a, extra=[leaving])
    r["cloud_cpu_s"] = _delta(cpu0, run.cloud_cpu())
    leaving.gone = True
    rec("drain", **_cpu(run, add_marks(run, r, nodes, live, n - 1, t0), t0))
    steady(run, live, n - 1, a.timeout)

    # join: `petctl scale`, as a user would; the stall counts from the last step at N-1
    before = set(run.in_service()) | {leaving.name}
    t0 = time.monotonic()
    run.petctl("scale", run.job, "--size", str(n))
    got = poll(lambda: [i for i in run.workers() if i["instance_id"] not in before], a.timeout, 0.2)
    if not got:
        raise Miss("join: no new instance")
    new = run.add_node(got[0]["instance_id"], t0)
    # the emulator's CPU over the stall itself (from the last step at N-1), not over the boot
    cpu = poll(lambda: run.cloud_cpu() if len(new.marks) and not new.steps else None, a.timeout, 0.02)
    r = measure(run, live, live + [new], n, t0, a)
    r["cloud_cpu_s"] = _delta(cpu, run.cloud_cpu())
    t_first = min(x.steps_after(t0, n)[0][0] for x in live + [new])
    t_last = max((s[0] for x in live for s in list(x.steps) if s[2] == n - 1 and s[0] < t_first), default=0.0)
    r = add_marks(run, r, live, live + [new], n, t0, since=max(t_last, t0))
    r["boot_s"] = _boot_seconds(run, new.name)
    got = poll(lambda: [f for f in new.fetches if f.get("status") == "ok"], 3.0, 0.1)
    if got:  # its transfer alone: bytes from how many holders, in how long
        r["fetch_s"], r["fetch_holders"] = got[-1].get("seconds"), got[-1].get("holders")
    rec("join", **_cpu(run, r, t0))


def _cpu(run: CloudRun, r: dict[str, Any], origin: float) -> dict[str, Any]:
    """Into ``r["cpu"]``: the machine's CPU over the stall (last step at the old size -> the last
    rank's first step at the new one), by role (:mod:`cpu_account`)."""
    ph = r.get("phases", {})
    if run.cpu is not None and "last_old_step" in ph and "first_step" in ph:
        r["cpu"] = run.cpu.window(origin + ph["last_old_step"], origin + ph["first_step"])
    return r


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 2)


def _boot_seconds(run: CloudRun, iid: str) -> float | None:
    """Launch -> the agent's service started (the boot's own events), for the newcomer."""
    try:
        st = run.petctl("status", run.job)
        for b in st.get("boot_events", []):
            if b.get("instance_id") == iid:
                return b.get("seconds")
    except Miss:
        pass
    return None


def run_one(gib: float, n: int, rep: int, a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """One chain through the local cloud; records as ``bench_state.run_one`` makes them."""
    tag = f"{gib:g}".replace(".", "p")
    job = f"bsl-{tag}-{rep}-{os.getpid() % 10000}"
    script_args = ["--total-steps", "1000000", "--step-time", f"{a.step_time:g}", "--checkpoint-every",
                   str(a.checkpoint_every), "--state-gib", f"{gib:g}", "--io", "helper",
                   "--start-delay", f"{a.start_delay:g}"]  # fmt: skip
    home = root / f"{tag}-{TOOL}-{rep}"
    home.mkdir(parents=True, exist_ok=True)
    run = CloudRun(home, job, n, script_args, a)
    base = {"gib": gib, "tool": TOOL, "rep": rep, "nodes": n, "start_delay": a.start_delay}
    out: list[dict[str, Any]] = []

    def rec(scenario: str, **kw: Any) -> None:
        out.append({"scenario": scenario, **base, "load": round(os.getloadavg()[0], 2), **kw})

    why: list[str] = []
    stop = threading.Event()
    guard = threading.Thread(target=mem_guard, args=(a.stop_below, stop, why, run), daemon=True)
    guard.start()
    note, t = "", time.monotonic()
    try:
        chain(run, n, a, rec)
    except Miss as e:
        note = str(e)
    except Exception as e:  # noqa: BLE001 - a broken path is a result too
        note = f"error: {type(e).__name__}: {e}"
    finally:
        stop.set()
        run.close()
        if not a.keep:
            shutil.rmtree(home, ignore_errors=True)
        else:  # the logs, not the checkpoints
            shutil.rmtree(home / "local" / "efs", ignore_errors=True)
    note = "; ".join(x for x in (*why, note) if x)
    ckpts = [(tt, kv) for nd in run.nodes for tt, w, kv in list(nd.marks) if w == "ckpt"]
    done = {r["scenario"] for r in out}
    for sc in ("cold_start", "drain", "join"):
        if sc not in done:
            rec(sc, seconds=None, steps_lost=None, note=note or "not reached")
    if out and ckpts:  # the periodic checkpoints, as bench_state.py's table reads them
        out[0]["ckpt_blocked"] = [float(kv["blocked"]) for _, kv in ckpts]
        out[0]["ckpt_steps"] = [int(kv["step"]) for _, kv in ckpts]
        out[0]["ckpt_via"] = [kv.get("via", "") for _, kv in ckpts]
    for r in out:
        r["wall"] = round(time.monotonic() - t, 1)
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 3)
    return out


def cloud_table(records: list[dict[str, Any]]) -> str:
    """What only the local cloud's path has: the newcomer's boot (launch -> its agent's service),
    its fetch alone, and the emulator's own CPU (the daemon: moto, IMDS, the reconciler) over the
    change; medians."""
    recs = [r for r in records if r.get("tool") == TOOL and r["scenario"] in ("drain", "join")]
    if not recs:
        return ""
    lines = [
        "| GiB | scenario | stall s | newcomer's boot s | fetch s (holders) | cloud daemon CPU s | reps |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for gib, sc in sorted({(r["gib"], r["scenario"]) for r in recs}):
        rs = [r for r in recs if (r["gib"], r["scenario"]) == (gib, sc) and r.get("seconds") is not None]
        hold = sorted({str(r["fetch_holders"]) for r in rs if r.get("fetch_holders")})
        lines.append(
            f"| {gib:g} | {sc} | {_f(_med([r['seconds'] for r in rs]))} | {_f(_med([r.get('boot_s') for r in rs]))} "
            f"| {_f(_med([r.get('fetch_s') for r in rs]))} ({'/'.join(hold) or '—'}) "
            f"| {_f(_med([r.get('cloud_cpu_s') for r in rs]))} | {len(rs)} |"
        )
    return "\n".join(lines)
