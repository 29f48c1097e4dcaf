"""petctl_agent.checkpoint: atomic save, verified load with fallback, drain flag, progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent import checkpoint as ckpt


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step_copy": step}


def test_save_and_load_latest_roundtrip(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path) is None
    for s in (10, 20, 30, 40):
        ckpt.save(_state(s), s, tmp_path, keep=2)
    state, step = ckpt.load_latest(tmp_path)
    assert step == 40 and state["step_copy"] == 40 and torch.equal(state["w"], torch.full((4,), 40.0))
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-0000000030.pt", "ckpt-0000000040.pt"]
    assert json.loads((tmp_path / "latest").read_text())["step"] == 40
    assert ckpt.latest_step(tmp_path) == 40


def test_corrupt_newest_falls_back_to_previous(tmp_path: Path) -> None:
    ckpt.save(_state(1), 1, tmp_path)
    ckpt.save(_state(2), 2, tmp_path)
    newest = tmp_path / "ckpt-0000000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn/corrupted after the fact
    state, step = ckpt.load_latest(tmp_path)
    assert step == 1 and state["step_copy"] == 1


def test_missing_pointer_uses_newest_file(tmp_path: Path) -> None:
    ckpt.save(_state(5), 5, tmp_path)
    (tmp_path / "latest").unlink()
    assert ckpt.load_latest(tmp_path)[1] == 5


def test_checkpoint_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PETCTL_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="PETCTL_CHECKPOINT_DIR"):
        ckpt.checkpoint_dir()
    monkeypatch.setenv("PETCTL_CHECKPOINT_DIR", str(tmp_path))
    ckpt.save(_state(3), 3)
    assert ckpt.load_latest()[1] == 3


WRITER = textwrap.dedent(
    """
    import sys, torch
    from petctl_agent import checkpoint as ckpt
    d = sys.argv[1]
    big = torch.randn(1_000_000)  # ~4 MB per checkpoint: kills land mid-write
    step = 0
    while True:
        step += 1
        ckpt.save({"big": big + step, "step_copy": step}, step, d, keep=3)
        print(step, flush=True)
    """
)


def test_writer_killed_mid_save_never_corrupts_latest(tmp_path: Path) -> None:
    """SIGKILL a busy writer at many points; 'latest' must always load and be self-consistent."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    d = tmp_path / "ck"
    for i in range(6):
        p = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE, text=True)
        # wait until it has saved at least once in this run, then kill at a varying offset
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(0.05 * i)
        p.send_signal(signal.SIGKILL)
        p.wait()
        state, step = ckpt.load_latest(d)
        assert state["step_copy"] == step
        assert torch.equal(state["big"][:3], (state["big"] - step + step)[:3])
    leftovers = [n for n in os.listdir(d) if n.endswith(".tmp")]
    assert len(leftovers) <= 6  # temp files of killed writers only (pruned after a minute)


def test_should_checkpoint_and_drain_flag_single_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drain = tmp_path / "drain"
    monkeypatch.setenv("PETCTL_DRAIN_FILE", str(drain))
    assert ckpt.should_checkpoint(10, 5) is True
    assert ckpt.should_checkpoint(11, 5) is False
    assert ckpt.drain_requested() is False
    drain.touch()
    assert ckpt.should_checkpoint(11, 5) is True
    assert ckpt.drain_requested() is True
    drain.unlink()
    assert ckpt.should_checkpoint(12, 0) is False


def test_exit_for_drain_uses_the_drain_exit_code(tmp_path: Path) -> None:
    code = "from petctl_agent import checkpoint as c; print('bye', flush=True); c.exit_for_drain()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == DRAIN_EXIT_CODE == 75 and "bye" in r.stdout


def test_report_progress_is_atomic_and_local_rank_zero_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "progress.json"
    monkeypatch.setenv("PETCTL_PROGRESS_FILE", str(f))
    monkeypatch.setenv("LOCAL_RANK", "1")
    ckpt.report_progress(7, 2)
    assert not f.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    ckpt.report_progress(7, 2)
    assert json.loads(f.read_text())["step"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]


# ---- map_location, the one-call contract, agreement across ranks, sharded state ------------
def test_loads_map_to_the_rank_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads go to ``rank_device()`` (cuda:<local rank> on a GPU rank); 'meta' stands in here."""
    ckpt.save(_state(4), 4, tmp_path)
    state, _ = ckpt.load_latest(tmp_path)
    assert state["w"].device == torch.device("cpu")  # CPU rank
    import petctl_agent.distributed as pd

    monkeypatch.setattr(pd, "rank_device", lambda: torch.device("meta"))
    state, step = ckpt.resume(directory=tmp_path)
    assert step == 4 and state["w"].device.type == "meta"
    state, _ = ckpt.load_latest(tmp_path, map_location="cpu")
    assert state["w"].device == torch.device("cpu")


def test_step_contract_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    progress = tmp_path / "progress.json"
    monkeypatch.setenv("PETCTL_PROGRESS_FILE", str(progress))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("PETCTL_DRAIN_FILE", raising=False)
    d = tmp_path / "ck"
    assert ckpt.resume(directory=d) is None
    calls = []

    def state_fn() -> dict:
        calls.append(1)
        return _state(s)

    saved = []
    for s in range(1, 8):
        if ckpt.step(s, state_fn, every=3, directory=d, last=s == 7):
            saved.append(s)
    assert saved == [3, 6, 7] and len(calls) == 3  # state_fn only when saving
    assert json.loads(progress.read_text())["step"] == 7
    state, step = ckpt.resume(directory=d)
    assert step == 7 and state["step_copy"] == 7


def test_step_exits_75_on_drain_after_saving(tmp_path: Path) -> None:
    drain = tmp_path / "drain"
    code = textwrap.dedent(
        f"""
        import torch
        from petctl_agent import checkpoint as ckpt
        for s in range(1, 100):
            if s == 5:
                open({str(drain)!r}, "w").close()
            print(s, flush=True)
            ckpt.step(s, lambda: {{"w": torch.ones(2) * s}}, every=0, directory={str(tmp_path / "ck")!r})
        """
    )
    env = {**os.environ, "PETCTL_DRAIN_FILE": str(drain)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == DRAIN_EXIT_CODE, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "5"  # one process: decided at the step the flag was seen
    assert ckpt.latest_step(tmp_path / "ck") == 5


def test_sharded_checkpoint_needs_a_state_to_load_into(tmp_path: Path) -> None:
    d = tmp_path
    d.joinpath("ckpt-0000000003.dcp").mkdir()
    d.joinpath("latest").write_text(json.dumps({"file": "ckpt-0000000003.dcp", "step": 3, "format": "dcp"}))
    with pytest.raises(ckpt.NeedsStateError, match="sharded"):
        ckpt.resume(directory=d)


RANKS = textwrap.dedent(
    """
    import json, os, sys, torch
    import torch.distributed as dist
    from petctl_agent import checkpoint as ckpt
    from petctl_agent.distributed import init_process_group
    init_process_group()
    rank = dist.get_rank()
    out = {}
    exec(open(sys.argv[1]).read())
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def _run_ranks(
    tmp_path: Path,
    body: str,
    world: int = 2,
    env: dict | None = None,
    timeout: float = 120,
    per_rank: list[dict] | None = None,
) -> list:
    """Run ``body`` on ``world`` gloo ranks (a process each: tests/ranks.py); return their
    CompletedProcess. ``per_rank``: more environment for each rank (its own snapshot store, ...)."""
    from tests.ranks import run_ranks

    (tmp_path / "ranks.py").write_text(RANKS)
    (tmp_path / "body.py").write_text(textwrap.dedent(body))
    envs = [
        {
            "LOCAL_RANK": str(r),
            "PETCTL_DRAIN_FILE": str(tmp_path / f"drain-{r}"),
            **(env or {}),
            **(per_rank[r] if per_rank else {}),
        }
        for r in range(world)
    ]
    return run_ranks(
        [sys.executable, str(tmp_path / "ranks.py"), str(tmp_path / "body.py")], envs, timeout=timeout
    )


def _result(cp: subprocess.CompletedProcess) -> dict:
    for line in cp.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result (rc {cp.returncode}):\n{cp.stderr[-3000:]}")


AGREE = """
    def run(mode):
        os.environ["PETCTL_AGREEMENT"] = mode
        mine = os.environ["PETCTL_DRAIN_FILE"]
        rows = []
        for s in range(1, 9):
            if rank == 1 and s == 3:
                open(mine, "w").close()   # only rank 1's node is told to drain, at step 3
            ck = ckpt.should_checkpoint(s, every=0)
            rows.append([s, ck, ckpt.drain_requested(), os.path.exists(mine)])
        if os.path.exists(mine):
            os.unlink(mine)
        ckpt.should_checkpoint(99, every=0)   # drain the pending exchange (both ranks)
        return rows
    out["async"] = run("async")
    dist.barrier()
    out["sync"] = run("sync")
"""


def test_drain_agreement_two_ranks_same_step_and_agreed_only(tmp_path: Path) -> None:
    r0, r1 = (_result(cp) for cp in _run_ranks(tmp_path, AGREE))
    for mode, first in (("async", 4), ("sync", 3)):
        for res in (r0, r1):
            rows = res[mode]
            decided = [s for s, ck, agreed, _ in rows if agreed]
            assert decided and decided[0] == first, (mode, rows)
            assert all(ck == agreed for _, ck, agreed, _ in rows)  # every=0: checkpoint only on drain
        assert [row[:3] for row in r0[mode]] == [row[:3] for row in r1[mode]]  # identical decisions
    # agreed-only: at step 3 rank 1's drain file exists, but in async mode nobody has agreed yet
    assert r1["async"][2] == [3, False, False, True]
    assert r0["async"][2][2] is False and r0["async"][2][3] is False  # rank 0 never had a file


RANK0_WRITE_FAILS = """
    try:
        ckpt.save({"w": torch.ones(3)}, 1)
        out["error"] = None
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()  # both go on: the group still works
"""


def test_a_failed_write_on_rank_0_raises_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 cannot write the checkpoint (its directory's parent is a file): every rank raises,
    the others naming rank 0's error, and the job's group still works. Rank 0 raising alone left
    the others in the checkpoint barrier (here: deadlocked against rank 0's next collective)."""
    (tmp_path / "file").write_text("not a directory")
    env = {"PETCTL_CHECKPOINT_DIR": str(tmp_path / "file" / "ck")}
    r0, r1 = (_result(cp) for cp in _run_ranks(tmp_path, RANK0_WRITE_FAILS, env=env, timeout=60))
    assert r0["error"].startswith(("NotADirectoryError", "FileExistsError")), r0
    assert r1["error"].startswith("OSError: checkpoint of step 1 not written to "), r1
    assert r0["error"].split(":")[0] in r1["error"], (r0, r1)


CONTRACT = """
    import time
    w = torch.nn.Parameter(torch.zeros(3))
    restored = ckpt.resume()
    start = 1 if restored is None else restored[1] + 1
    if restored is not None:
        w.data.copy_(restored[0]["w"])
    out["start"] = start
    total = int(os.environ["TOTAL"])
    for s in range(start, total + 1):
        w.data += 1
        if rank == 1 and s == int(os.environ.get("DRAIN_AT", "0")):
            open(os.environ["PETCTL_DRAIN_FILE"], "w").close()
        print(f"step={s}", flush=True)
        ckpt.step(s, lambda: {"w": w.detach().clone()}, every=100, last=s == total)
    out["w"] = w.tolist()
"""


def test_step_and_resume_contract_two_ranks(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    env = {"PETCTL_CHECKPOINT_DIR": str(d), "TOTAL": "8", "DRAIN_AT": "3"}
    first = _run_ranks(tmp_path, CONTRACT, env=env)
    # rank 1 raised the flag at step 3; both decided at step 4, saved it, exited 75
    for cp in first:
        assert cp.returncode == DRAIN_EXIT_CODE, cp.stderr[-3000:]
        assert cp.stdout.split()[-1] == "step=4"
    assert ckpt.latest_step(d) == 4
    (tmp_path / "drain-1").unlink()  # the agent removes it before restarting workers
    second = [_result(cp) for cp in _run_ranks(tmp_path, CONTRACT, env={**env, "DRAIN_AT": "0"})]
    assert [r["start"] for r in second] == [5, 5]
    assert all(r["w"] == [8.0, 8.0, 8.0] for r in second)  # no step lost or repeated
    assert ckpt.latest_step(d) == 8


SHARDED = """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    d = os.environ["PETCTL_CHECKPOINT_DIR"]
    full = torch.arange(32.0).reshape(8, 4)
    for s in (1, 2):
        sd = {"model": {"w": distribute_tensor(full * s, mesh, [Shard(0)])}, "plain": torch.ones(2) * s, "n": s}
        path = ckpt.save(sd, s, keep=1)
        out[f"path{s}"] = None if path is None else path.name
    into = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}, "plain": torch.zeros(2), "n": 0}
    state, step = ckpt.resume(into)
    out["step"] = step
    out["local"] = state["model"]["w"].to_local().tolist()
    out["plain"] = state["plain"].tolist()
    out["n"] = state["n"]
    out["files"] = sorted(os.listdir(d))
"""


def test_sharded_state_saves_every_rank_shard_through_dcp(tmp_path: Path) -> None:
    pytest.importorskip("numpy", reason="torch.distributed.checkpoint's object collectives need numpy")
    d = tmp_path / "ck"
    r0, r1 = (_result(cp) for cp in _run_ranks(tmp_path, SHARDED, env={"PETCTL_CHECKPOINT_DIR": str(d)}))
    assert r0["path2"] == "ckpt-0000000002.dcp" and r1["path2"] is None  # rank 0 publishes
    assert r0["files"] == ["ckpt-0000000002.dcp", "latest"]  # keep=1 pruned step 1's directory
    shards = sorted(os.listdir(d / "ckpt-0000000002.dcp"))
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards and ".metadata" in shards  # one per rank
    pointer = json.loads((d / "latest").read_text())
    assert pointer["format"] == "dcp" and pointer["step"] == 2 and pointer["world_size"] == 2
    full = torch.arange(32.0).reshape(8, 4) * 2
    assert r0["local"] == full[:4].tolist() and r1["local"] == full[4:].tolist()
    assert r0["step"] == r1["step"] == 2 and r0["plain"] == [2.0, 2.0] and r0["n"] == 2
    # a different world size reads the same checkpoint (DCP reshards): one process, plain tensor
    into = {"model": {"w": torch.zeros(8, 4)}, "plain": torch.zeros(2), "n": 0}
    state, step = ckpt.resume(into, directory=d)
    assert step == 2 and torch.equal(state["model"]["w"], full)


def test_a_save_streams_to_its_file_without_a_copy_of_the_state_in_memory(tmp_path: Path) -> None:
    """The single-file save is where a memory snapshot that does not fit falls back to, i.e. when
    the node is short of memory: it must not hold the state again. It serialized into a BytesIO
    and copied that (getvalue): 2 x the state of Python memory (at 4 GiB per rank,
    MemAvailable 2.0 -> 0.9 GiB in 2 s). Python's allocator is what tracemalloc sees; the
    tensors' own storage is not, so the peak is what the save adds."""
    import hashlib
    import tracemalloc

    from petctl_agent.checkpointing.files import write_file

    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 16 x 4 MiB = 64 MiB
    tracemalloc.start()
    try:
        write_file(state, 7, tmp_path, keep=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"the save held {peak / 2**20:.0f} MiB of Python memory for 64 MiB of state"
    # the same checkpoint as before: latest names it with the file's own sha256 and size, it loads,
    # and no temp file is left
    pointer = json.loads((tmp_path / "latest").read_text())
    data = (tmp_path / "ckpt-0000000007.pt").read_bytes()
    assert (pointer["sha256"], pointer["size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    got, step = ckpt.load_latest(tmp_path)
    assert step == 7 and all(torch.equal(got[k], v) for k, v in state.items())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    # forward_only: latest names a newer step already: nothing written, latest kept, no temp file
    write_file({"w": torch.zeros(4)}, 5, tmp_path, keep=2, forward_only=True)
    assert json.loads((tmp_path / "latest").read_text())["step"] == 7
    assert not (tmp_path / "ckpt-0000000005.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_load_reads_no_copy_of_the_file_and_still_checks_its_sha256(tmp_path: Path) -> None:
    """A restore from EFS read the whole file into memory, hashed it, then built the tensors from
    that copy: 2 x the state (and read, hash and copy one after the other: 9.5-15.7 s for
    4 GiB against torchrun's 3.1-6.1 s). Now torch.load reads the file while a thread hashes it:
    Python memory stays at the hash's piece, and a file changed by one byte, or cut short, still
    fails its sha256 (a ValueError naming the checksum, not what the unpickler made of it)."""
    import tracemalloc

    from petctl_agent.checkpointing.files import load_file, write_file

    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 16 x 4 MiB = 64 MiB
    path = write_file(state, 7, tmp_path, keep=2)
    sha = json.loads((tmp_path / "latest").read_text())["sha256"]
    tracemalloc.start()
    try:
        got, step = load_file(path, sha, "cpu")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert step == 7 and all(torch.equal(got[k], v) for k, v in state.items())
    assert peak < 24 << 20, f"the load held {peak / 2**20:.0f} MiB of Python memory for 64 MiB of state"

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: torch.load itself would not notice
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_file(bad, sha, "cpu")
    cut = tmp_path / "cut.pt"
    cut.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_file(cut, sha, "cpu")
    # no sha256 known (a pointer without one): loaded as is
    got, step = load_file(path, None, "cpu")
    assert step == 7 and torch.equal(got["t3"], state["t3"])


def test_two_writers_of_one_step_in_one_process_never_share_a_temp_file(tmp_path: Path, monkeypatch) -> None:
    """Rank 0's save and a persister thread in the same worker may write the same step at once
    (a snapshot that did not fit on another node; a wait for the persister that timed out). Their
    temp files were named by pid: both wrote one inode, the first rename published a file the
    other was still writing, the second rename failed (found in review). Each writer now has a
    temp file of its own: both return, and ``latest``'s sha256 is the published file's."""
    import hashlib
    import threading

    from petctl_agent.checkpointing import files

    real = files.HashingFile.write

    def slow_write(self, b):  # every piece of torch.save's stream takes a moment: the two overlap
        time.sleep(0.002)
        return real(self, b)

    monkeypatch.setattr(files.HashingFile, "write", slow_write)
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}
    errors: list[BaseException] = []

    def save() -> None:
        try:
            files.write_file(state, 5, tmp_path, keep=2)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    pointer = json.loads((tmp_path / "latest").read_text())
    data = (tmp_path / "ckpt-0000000005.pt").read_bytes()
    assert (pointer["sha256"], pointer["size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    got, step = ckpt.load_latest(tmp_path)
    assert step == 5 and torch.equal(got["t7"], state["t7"])
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_publish_lock_excludes_another_thread_of_the_same_process(tmp_path: Path) -> None:
    """``publish_lock`` was a POSIX lock alone (``lockf``): a lock of the process, so a second
    thread of the same process (the in-process persister beside rank 0's save) took it at once,
    and ``latest`` could end up naming other bytes than its file's. It waits now."""
    import threading

    from petctl_agent.checkpointing.files import publish_lock

    a_in, release, b_in = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with publish_lock(tmp_path):
            a_in.set()
            release.wait(60)

    def b() -> None:
        with publish_lock(tmp_path):
            b_in.set()

    ta = threading.Thread(target=a)
    ta.start()
    assert a_in.wait(30)
    tb = threading.Thread(target=b)
    tb.start()
    try:
        assert not b_in.wait(1.0), "a second thread took the publish lock while the first held it"
    finally:
        release.set()
        ta.join(30)
        tb.join(30)
    assert b_in.is_set()
