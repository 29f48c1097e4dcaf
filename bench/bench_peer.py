#!/usr/bin/env python3
"""A peer restore's transfer alone, one stream against several, under AWS's per-flow cap.

The join sends a newcomer the state from a survivor's memory (``memory.resume``: the
stripes of ``checkpointing/peer.py``). AWS caps a single TCP flow between two instances at
5 Gbit/s outside a cluster placement group (10 inside): one stream cannot move a GiB in under
1.7 s however fast the instances are. This bench runs the real restore (``ckpt.resume`` in real
processes over gloo, the holders' snapshots written first, EFS empty) for each ``--streams`` value
and each ``--flow-cap`` side by side in one run, inside a private network namespace whose loopback
caps every TCP flow (``benchlib.cap_flows``: htb + a BPF flow classifier), and prints the
receiver's transfer time, its rate and the ratio to one stream.

    python bench/bench_peer.py                                  # 0.25 GiB, 1 and 4 streams, caps 5 and 1 Gbit/s
    python bench/bench_peer.py --gib 1 --holders 2 --reps 3 --json out.json
    python bench/bench_peer.py --gib 1 --holders 2 --transports gloo,fetch --streams 4 --flow-caps 5

``--transports``: ``gloo`` (the workers' restore, above) and/or ``fetch`` (the joining
node's agent fetching the holders' snapshots from their agents' servers as the round closes,
``checkpointing/fetch.py``; each holder's server a process of its own, the fetch the agent's own
process, timed from its start to its exit -- the interpreter's start included -- and by its own
account, ``fetched.json``).

On a 2-core box the receiver's CPU (the copy into its slot, the crc32s) binds near 5 Gbit/s, so
at AWS's own 5 Gbit/s cap one stream and four take the same time here; a lower cap (1 Gbit/s:
the ratio of a 5 Gbit/s flow to a 25 Gbit/s instance) shows what the flows buy where the network,
not the receiver, is the limit -- as on a GPU instance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, cap_flows, reexec_in_netns  # noqa: E402

WORKER = """
import json, os, sys, time
from petctl_agent.distributed import init_process_group
from petctl_agent.checkpointing import memory
from petctl_agent.worker.forkserver import keep_destroyed_groups_alive
from pathlib import Path
keep_destroyed_groups_alive()  # as the agent's workers (worker/forkserver.py: torch's gloo exit race)
init_process_group()
t0 = time.monotonic()
got = memory.resume(Path(os.environ["PETCTL_CHECKPOINT_DIR"]), "cpu")
took = time.monotonic() - t0
print("RESULT " + json.dumps({"step": got[1] if got else None, "seconds": took}), flush=True)
os._exit(0)  # as a forkserver worker leaves: the groups are never destructed
"""


WRITER = """
import sys, torch
from petctl_agent.checkpointing.snapshot import SnapshotStore
gib, tensors, dirs = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
n = int(gib * (1 << 30) / 4 / tensors)
state = {f"t{i}": torch.full((n,), float(i)) for i in range(tensors)}
for d in dirs:
    s = SnapshotStore(d, "replicated")
    assert s.write(state, 6, wait=True) == "ok"
    s.close()
"""


def write_snapshots(dirs: list[Path], gib: float, tensors: int) -> None:
    """The holders' snapshots, written by a process that then exits, as a stopped worker's are:
    its seal covers them, so the sources send without a crc32 pass (docs/agent.md)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    subprocess.run(
        [sys.executable, "-c", WRITER, str(gib), str(tensors), *map(str, dirs)], env=env, check=True
    )


def one(root: Path, holders: int, streams: int) -> dict:
    from harness import free_port

    efs = root / "efs"
    efs.mkdir(exist_ok=True)
    port = free_port()
    n = holders + 1
    newcomer = root / f"new-{streams}-{time.time_ns()}"
    procs = []
    for r in range(n):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "agent"),
            "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PETCTL_SNAPSHOT_DIR": str(root / f"n{r}" if r < holders else newcomer),
            "PETCTL_CHECKPOINT_DIR": str(efs),
            "PETCTL_SNAPSHOT_STREAMS": str(streams),
        }  # fmt: skip
        env.pop("PETCTL_DRAIN_FILE", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        line = next((x for x in o.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"rank exited {p.returncode}: {o[-2000:]}{e[-3000:]}")
        out.append(json.loads(line[7:]))
    rep = json.loads((newcomer / "restore.json").read_text())
    for f in newcomer.iterdir():  # the received copy: its memory back before the next run
        f.unlink()
    newcomer.rmdir()
    return {"seconds": out[-1]["seconds"], "restore": rep, "source": rep.get("source")}


SERVER = """
import sys, time
from petctl_agent.checkpointing.fetch import Server
from petctl_agent.checkpointing.snapshot import SnapshotStore
srv = Server(SnapshotStore(sys.argv[1], "replicated"), "127.0.0.1", "bench").start()
print(srv.port, flush=True)
time.sleep(86400)
"""


def serve(dirs: list[Path]) -> tuple[list[subprocess.Popen], list[dict]]:
    """One snapshot server per holder (as its agent's persister runs it); the fetch's sources."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    procs = [subprocess.Popen([sys.executable, "-c", SERVER, str(d)], env=env, stdout=subprocess.PIPE, text=True)
             for d in dirs]  # fmt: skip
    return procs, [{"addr": "127.0.0.1", "port": int(p.stdout.readline()), "token": "bench"} for p in procs]


def one_fetch(root: Path, srcs: list[dict], streams: int) -> dict:
    newcomer = root / f"new-fetch-{streams}-{time.time_ns()}"
    newcomer.mkdir(mode=0o700)  # the agent's store, made before its workers start
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PETCTL_SNAPSHOT_STREAMS": str(streams)}
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "petctl_agent.checkpointing.fetch", str(newcomer), "replicated", "--deadline", "600"],
        input=json.dumps(srcs).encode(), env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    took = time.monotonic() - t0
    rep = json.loads((newcomer / "fetched.json").read_text())
    if rep.get("status") != "ok":
        raise RuntimeError(f"fetch: {rep}")
    for f in newcomer.iterdir():
        f.unlink()
    newcomer.rmdir()
    return {"seconds": took, "fetch_seconds": rep["seconds"], "restore": rep, "source": "prefetch"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.25, help="state per rank, GiB")
    p.add_argument("--tensors", type=int, default=16, help="tensors the state is cut into")
    p.add_argument(
        "--holders", type=int, default=1, help="ranks that hold the snapshot (the receiver is one more)"
    )
    p.add_argument("--streams", default="1,4", help="PETCTL_SNAPSHOT_STREAMS values, side by side")
    p.add_argument("--flow-caps", default="5,1", help="Gbit/s per TCP flow (0: none), one namespace run each")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--transports", default="gloo", help="gloo (the workers' restore) and/or fetch (the agents')"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--shm", default="/dev/shm")
    a = p.parse_args(argv)
    if not os.environ.get("BENCH_IN_NETNS"):
        rc = reexec_in_netns(__file__, argv)
        if rc is not None:
            return rc
        print("cannot create a network namespace (unshare --net): no per-flow cap", file=sys.stderr)
    caps = [float(x) for x in a.flow_caps.split(",")]
    streams = [int(x) for x in a.streams.split(",")]
    transports = a.transports.split(",")
    rows = []
    servers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-", dir=a.shm) as tmp:
        root = Path(tmp)
        write_snapshots([root / f"n{r}" for r in range(a.holders)], a.gib, a.tensors)
        srcs: list[dict] = []
        if "fetch" in transports:
            servers, srcs = serve([root / f"n{r}" for r in range(a.holders)])
        for cap in caps:
            if os.environ.get("BENCH_IN_NETNS"):  # our own namespace's loopback only, never the host's
                subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
            why = (
                ""
                if cap <= 0
                else cap_flows(cap)
                if os.environ.get("BENCH_IN_NETNS")
                else "no network namespace"
            )
            if why:
                print(f"# per-flow cap {cap:g} Gbit/s not applied: {why}", file=sys.stderr)
            for rep in range(1, a.reps + 1):
                for st in streams:  # interleaved: one rep of each, then the next
                    for tr in transports:
                        r = one(root, a.holders, st) if tr == "gloo" else one_fetch(root, srcs, st)
                        rows.append({"flow_cap_gbit": cap, "applied": not why, "streams": st, "transport": tr,
                                     "rep": rep, **r})  # fmt: skip
                        print(
                            f"# cap {cap:g} {tr} streams {st} rep {rep}: {r['seconds']:.2f} s ({r['source']})",
                            file=sys.stderr,
                        )
        for srv in servers:
            srv.kill()
            srv.wait()
    print(
        f"\n{a.gib:g} GiB per rank, {a.holders} holder(s) -> 1 newcomer, {a.tensors} tensors, {os.cpu_count()} CPUs\n"
    )
    print(
        "| per-flow cap | transport | streams | transfer s (median of reps) | GiB/s | vs the first row of its cap |"
    )
    print("|---|---|---:|---:|---:|---:|")
    summary = []
    for cap in caps:
        base = None
        for tr in transports:
            for st in streams:
                rs = [
                    r
                    for r in rows
                    if r["streams"] == st and r["flow_cap_gbit"] == cap and r["transport"] == tr
                ]
                xs = [r["seconds"] for r in rs]
                med = statistics.median(xs)
                base = base or med
                own = [r["fetch_seconds"] for r in rs if "fetch_seconds" in r]
                summary.append({"flow_cap_gbit": cap, "transport": tr, "streams": st, "median_s": round(med, 3),
                                "reps": xs, **({"fetch_own_median_s": statistics.median(own)} if own else {})})  # fmt: skip
                applied = all(r["applied"] for r in rows if r["flow_cap_gbit"] == cap)
                cap_s = (
                    (f"{cap:g} Gbit/s" if applied else f"{cap:g} Gbit/s (NOT applied)") if cap > 0 else "none"
                )
                extra = f" (its own account {statistics.median(own):.2f})" if own else ""
                print(f"| {cap_s} | {tr} | {st} | {med:.2f}{extra} | {a.gib / med:.2f} | {base / med:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps({"command": "python bench/bench_peer.py " + " ".join(argv), "cpus": os.cpu_count(),
                                      "summary": summary, "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
