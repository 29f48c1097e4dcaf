"""The local EFS's throughput limits (petctl/local/efs_rate.py), paid through the agent's I/O hook
(checkpointing/iohook.py) by the local cloud's pacing (petctl/local/efs_pacing.py).

The local cloud writes each instance's config; the checkpoint layer's real write and read paths
(atomic_write, the single-file format, DCP, the background persister) pay it. Rates are low here
(tens of MiB/s) so a few tens of MiB take seconds; each assertion is a lower bound
(size / rate, minus a little for the clock), which load on the machine can only make truer. Two
clients are two real processes sharing the file system's bucket through its state file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from petctl.local import efs_rate
from petctl.local.client import LocalCloudError, ensure_started
from petctl.local.starting import Starting
from petctl_agent import checkpoint as ckpt
from petctl_agent.checkpointing import iohook, persist
from petctl_agent.checkpointing.atomic import atomic_write
from petctl_agent.checkpointing.files import load_file, read_pointer, write_file
from petctl_agent.checkpointing.persisting import persist_newest
from petctl_agent.checkpointing.sharded import load_sharded, save_sharded
from petctl_agent.checkpointing.snapshot import SnapshotStore

MIB = 1 << 20
SLACK = 0.05  # seconds: clock granularity, never the I/O itself


def _configure(monkeypatch: pytest.MonkeyPatch, state: Path, client: str = "i-1", **knobs: str) -> Path:
    """What the local cloud does for a unit of ``client``: its config file, in the environment."""
    env = {f"PETCTL_LOCAL_EFS_{k.upper()}": v for k, v in knobs.items()}
    rates = efs_rate.rates_from_env(env)
    extra = efs_rate.instance_env(state, client, rates)
    for name, value in extra.items():  # the rate file and the hook that pays it
        monkeypatch.setenv(name, value)
    fs = state / "efs" / "fs-0123456789abcdef0"
    fs.mkdir(parents=True, exist_ok=True)
    return fs


def _timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


def test_the_local_cloud_and_the_agent_agree_on_the_hook() -> None:
    from petctl.local import efs_pacing

    assert efs_rate.HOOK_ENV == iohook.ENV
    assert efs_pacing.ENV == efs_rate.ENV
    assert iohook._load(efs_rate.HOOK) is efs_pacing  # importable, with open, wrap and wrap_dcp


def test_without_the_hook_the_agent_does_plain_io(tmp_path: Path, monkeypatch, capsys) -> None:
    # on AWS nothing sets the hook: the rate file alone paces nothing, and files are open()'s own
    fs = _configure(monkeypatch, tmp_path, client_mibps="2")
    monkeypatch.delenv(iohook.ENV)
    _, took = _timed(atomic_write, fs / "blob", os.urandom(20 * MIB))
    assert took < 20 / 2 / 2  # 10 s if it were paced at 2 MiB/s
    with iohook.open(fs / "blob", "rb") as f:
        assert type(f).__module__ == "_io"
    sentinel = object()
    assert iohook.wrap(sentinel, fs / "blob", "rb") is sentinel
    assert iohook.wrap_dcp(sentinel) is sentinel
    # a hook that cannot be imported: one line on stderr, then plain I/O
    monkeypatch.setenv(iohook.ENV, "petctl_no_such_module.hook")
    _, took = _timed(atomic_write, fs / "blob", os.urandom(20 * MIB))
    assert took < 20 / 2 / 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "petctl_no_such_module.hook" in err[0] and "not hooked" in err[0]


def test_a_write_and_a_read_take_at_least_size_over_rate(tmp_path: Path, monkeypatch) -> None:
    fs = _configure(monkeypatch, tmp_path, client_mibps="20")
    d = fs / "petctl" / "jobs" / "j" / "checkpoints"
    # rank 0's path: torch.save bytes written atomically; the size is the file's, not a guess
    state = {"w": torch.arange(6 * MIB, dtype=torch.float32)}  # 24 MiB of tensor
    _, wrote = _timed(write_file, state, 7, d, 3)
    size = read_pointer(d)["size"]
    assert size > 24 * MIB
    assert wrote >= size / (20 * MIB) - SLACK
    p = read_pointer(d)
    (got, step), read = _timed(load_file, d / p["file"], p["sha256"], "cpu")
    assert step == 7 and torch.equal(got["w"], state["w"])
    assert read >= size / (20 * MIB) - SLACK


def test_the_path_seen_through_the_mount_symlink_is_paced(tmp_path: Path, monkeypatch) -> None:
    # an instance sees the EFS at <root>/mnt/efs, a symlink into <state>/efs/<fs-id> (docs/local.md)
    fs = _configure(monkeypatch, tmp_path, client_mibps="25")
    mnt = tmp_path / "instances" / "i-1" / "root" / "mnt" / "efs"
    mnt.parent.mkdir(parents=True)
    mnt.symlink_to(fs)
    data = os.urandom(20 * MIB)
    _, took = _timed(atomic_write, mnt / "blob", data)
    assert took >= 20 / 25 - SLACK
    assert (fs / "blob").read_bytes() == data


def test_outside_the_efs_nothing_is_paced(tmp_path: Path, monkeypatch) -> None:
    _configure(monkeypatch, tmp_path, client_mibps="2")
    other = tmp_path / "not-efs"
    other.mkdir()
    _, took = _timed(atomic_write, other / "blob", os.urandom(20 * MIB))
    assert took < 20 / 2 / 2  # 10 s if it were paced at 2 MiB/s


def test_the_switch_turns_it_off(tmp_path: Path, monkeypatch) -> None:
    assert efs_rate.rates_from_env({efs_rate.SWITCH: "0", "PETCTL_LOCAL_EFS_CLIENT_MIBPS": "2"}) is None
    assert efs_rate.instance_env(tmp_path, "i-1", None) == {}
    # a unit of an instance started with the switch off: no variable, no config, no pacing
    s = Starting.__new__(Starting)
    s.state_dir, s.endpoint_url, s.imds_url = tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:8"
    s.settings = SimpleNamespace(efs_rates=None)
    monkeypatch.setenv(efs_rate.ENV, "/somewhere/else.json")  # not inherited from the daemon
    monkeypatch.setenv(efs_rate.HOOK_ENV, efs_rate.HOOK)
    env = s._unit_env(SimpleNamespace(instance_id="i-1", marker="i-1@t", job=None))
    assert efs_rate.ENV not in env and efs_rate.HOOK_ENV not in env
    monkeypatch.delenv(efs_rate.ENV)
    monkeypatch.delenv(efs_rate.HOOK_ENV)
    fs = tmp_path / "efs" / "fs-1"
    fs.mkdir(parents=True)
    _, took = _timed(atomic_write, fs / "blob", os.urandom(20 * MIB))
    assert took < 20 / 2 / 2


def test_default_on_with_aws_figures_for_every_unit(tmp_path: Path, monkeypatch) -> None:
    rates = efs_rate.rates_from_env({})
    assert rates == efs_rate.EfsRates(1500.0, 60 * 1024.0, 5 * 1024.0, 0.25, 2.7)
    s = Starting.__new__(Starting)
    s.state_dir, s.endpoint_url, s.imds_url = tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:8"
    s.settings = SimpleNamespace(efs_rates=rates)
    env = s._unit_env(SimpleNamespace(instance_id="i-7", marker="i-7@t", job=None))
    assert env[efs_rate.HOOK_ENV] == "petctl.local.efs_pacing"
    cfg = json.loads(Path(env[efs_rate.ENV]).read_text())
    assert cfg["client"] == "i-7" and cfg["efs_root"] == str(tmp_path / "efs")
    assert cfg["client_write_bps"] == cfg["client_read_bps"] == 1500 * MIB
    assert cfg["fs_read_bps"] == 60 * 1024 * MIB and cfg["fs_write_bps"] == 5 * 1024 * MIB


_CLIENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from petctl_agent.checkpointing.atomic import atomic_write
    data = os.urandom(int(sys.argv[3]))
    while time.time() < float(sys.argv[2]):
        time.sleep(0.005)
    t0 = time.monotonic()
    atomic_write(Path(sys.argv[1]), data)
    print(t0, time.monotonic())
    """
)


def _two_clients(tmp_path: Path, clients: tuple[str, str], each: int, **knobs: str) -> tuple[float, float]:
    """Two processes write ``each`` bytes at once; (first start, last end) in monotonic time."""
    env = {f"PETCTL_LOCAL_EFS_{k.upper()}": v for k, v in knobs.items()}
    rates = efs_rate.rates_from_env(env)
    fs = tmp_path / "efs" / "fs-1"
    fs.mkdir(parents=True, exist_ok=True)
    go = time.time() + 1.5  # both import first, then start together
    procs = []
    for i, c in enumerate(clients):
        penv = dict(os.environ, **efs_rate.instance_env(tmp_path, c, rates))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(fs / f"part-{i}"), str(go), str(each)],
                env=penv,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        spans.append(tuple(map(float, out.split())))
    return min(s for s, _ in spans), max(e for _, e in spans)


def test_the_file_system_limit_is_shared_by_two_clients(tmp_path: Path) -> None:
    # each client alone may write 500 MiB/s; together they get the file system's 20 MiB/s
    start, end = _two_clients(tmp_path, ("i-a", "i-b"), 16 * MIB, client_mibps="500", write_mibps="20")
    assert end - start >= 32 / 20 - SLACK


def test_a_client_limit_covers_all_its_processes(tmp_path: Path) -> None:
    # two processes of one instance (say a worker and the persister) share its 20 MiB/s
    start, end = _two_clients(tmp_path, ("i-a", "i-a"), 16 * MIB, client_mibps="20")
    assert end - start >= 32 / 20 - SLACK


def test_the_background_persister_pays_too(tmp_path: Path, monkeypatch) -> None:
    # 10 MiB/s: paced, the 20 MiB would take 2 s; unpaced it takes ~0.05 s idle, and the bound
    # (half the paced time) leaves a loaded CI box 20x that
    fs = _configure(monkeypatch, tmp_path, client_mibps="10")
    store = SnapshotStore(tmp_path / "shm", "replicated")  # node memory: never paced
    state = {"w": torch.ones(5 * MIB, dtype=torch.float32)}  # 20 MiB
    _, wrote = _timed(store.write, state, 3, wait=True)
    assert wrote < 20 / 10 / 2
    d = fs / "ckpt"
    step, took = _timed(persist_newest, store, d)
    assert step == 3 and took >= read_pointer(d)["size"] / (10 * MIB) - SLACK


def test_sharded_checkpoints_pay_through_dcp_streams(tmp_path: Path, monkeypatch) -> None:
    fs = _configure(monkeypatch, tmp_path, client_mibps="20")
    d = fs / "ckpt"
    state = {"w": torch.arange(4 * MIB, dtype=torch.float32)}  # 16 MiB, one rank
    out, wrote = _timed(save_sharded, state, 5, d, 3)
    assert wrote >= 16 / 20 - SLACK
    into = {"w": torch.zeros(4 * MIB, dtype=torch.float32)}
    (got, step), read = _timed(load_sharded, out, into)
    assert step == 5 and torch.equal(got["w"], state["w"])
    assert read >= 16 / 20 - SLACK


@pytest.mark.parametrize(
    "knob,value",
    [
        ("PETCTL_LOCAL_EFS_CLIENT_MIBPS", "fast"),
        ("PETCTL_LOCAL_EFS_WRITE_MIBPS", "0"),
        (efs_rate.SWITCH, "maybe"),
    ],
)
def test_a_bad_knob_is_one_line_and_starts_nothing(
    tmp_path: Path, monkeypatch, knob: str, value: str
) -> None:
    monkeypatch.setenv("PETCTL_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setenv(knob, value)
    with pytest.raises(LocalCloudError) as e:
        ensure_started(timeout=5)
    msg = str(e.value)
    assert "\n" not in msg and knob in msg
    assert not (tmp_path / "local" / "cloud.json").exists()
    assert not (tmp_path / "local" / "cloud.log").exists()


def test_a_persist_slower_than_the_checkpoints_still_lands(tmp_path: Path, monkeypatch) -> None:
    # the agent's persister (the real --serve process) writes at 2 MiB/s, ~4 s per
    # checkpoint, while the worker snapshots every ~0.1 s. Without the pin the writer reused the
    # slot being persisted two snapshots later, every persist was dropped, and EFS kept nothing.
    # (4 s, not 2: the case needs >= 5 snapshots per persist, and a loaded CI box slows the
    # writer's loop -- an 8 MiB copy each -- several times)
    fs = _configure(monkeypatch, tmp_path, client_mibps="2")
    shm, d = tmp_path / "shm", fs / "ckpt"
    store = SnapshotStore(shm, "replicated")
    n = 2 * MIB  # 8 MiB of fp32 per snapshot
    assert store.write({"w": torch.full((n,), 0.0), "s": 0}, 0, wait=True) == "ok"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "agent")}
    cmd = [sys.executable, "-m", "petctl_agent.checkpointing.persist", "--serve", str(shm), "replicated"]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not persist.served(shm):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        step, t0 = 0, time.monotonic()
        while read_pointer(d) is None:
            assert server.poll() is None and time.monotonic() < deadline, f"no latest after {step} snapshots"
            step += 1
            assert store.write({"w": torch.full((n,), float(step)), "s": step}, step) == "ok"
            persist.request(shm, step, d, 3)
            time.sleep(0.1)
        landed = time.monotonic() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    store.close()
    assert step >= 5, f"the writer was not faster than the persist ({step} snapshots in {landed:.1f} s)"
    state, got = ckpt.load_latest(d, map_location="cpu")  # sha256 checked: complete, loadable
    assert 1 <= got <= step and state["s"] == got
    assert torch.equal(state["w"], torch.full((n,), float(got)))
