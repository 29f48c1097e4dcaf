"""bench/bench_state.py's argument handling and tables, from synthetic records (no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_state as bs  # noqa: E402


def test_sizes_and_nodes_defaults_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    a = bs.parse_args(["--sizes", "0.1,1,4"])
    assert a.size_list == [0.1, 1.0, 4.0]
    assert a.node_map == {0.1: 3, 1.0: 3, 4.0: 2}  # 4 GiB: 2 nodes (24 GiB machine)
    assert bs.parse_args(["--sizes", "1", "--nodes", "4"]).node_map == {1.0: 4}
    assert bs.parse_args(["--sizes", "0.1,2", "--nodes", "0.1:3,2:2"]).node_map == {0.1: 3, 2.0: 2}
    assert a.scenario_set == set(bs.SCENARIOS[1:])  # every scenario by default (a cold start always runs)
    assert bs.parse_args(["--scenarios", "join, drain"]).scenario_set == {"join", "drain"}
    for argv, words in (
        (["--sizes", "one"], "comma-separated GiB"),
        (["--sizes", "0"], "must be > 0"),
        (["--sizes", "0.1,1", "--nodes", "0.1:3"], "no N for size(s) [1.0]"),
        (["--nodes", "1"], "within 2..8"),
        (["--tools", "petctl,torchrun-efs"], "unknown ['petctl']"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--scenarios", "join,scale_up"], "--scenarios: choose from drain, join, hard_loss"),
    ):
        with pytest.raises(SystemExit) as e:
            bs.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err


def test_memory_need_counts_two_snapshot_slots_per_node() -> None:
    assert bs.memory_need(4, 2, snapshots=True) == 2 * 4 * 3 + 4 + 1  # 29 GiB: not on this 24 GiB box
    assert bs.memory_need(1, 3, snapshots=False) == 3 + 1 + 1


def rec(gib, sc, tool, rep, seconds, lost=0, **kw):
    return {"gib": gib, "scenario": sc, "tool": tool, "rep": rep, "nodes": 3, "seconds": seconds,
            "steps_lost": lost, **kw}  # fmt: skip


def test_tables_take_medians_and_show_misses_and_targets() -> None:
    recs = [
        rec(
            1.0,
            "join",
            "petctl-mem",
            1,
            1.0,
            phases={"rendezvous_done": 0.5, "restore": 0.2, "sources": ["memory"]},
            ckpt_blocked=[0.08, 0.1],
            ckpt_persisted=[2.0],
        ),  # fmt: skip
        rec(
            1.0,
            "join",
            "petctl-mem",
            2,
            3.0,
            phases={"rendezvous_done": 0.7, "restore": 0.4, "sources": ["efs"]},
        ),
        rec(1.0, "join", "petctl-mem", 3, None, lost=None, note="timeout 120s waiting"),
        rec(1.0, "join", "torchrun-efs", 1, 40.0, lost=8, ckpt_blocked=[3.0]),
    ]
    rows = bs.summarize(recs)
    mem = next(r for r in rows if r["tool"] == "petctl-mem")
    assert (mem["seconds"], mem["reps"], mem["attempts"]) == (2.0, 2, 3)
    table = bs.markdown(rows)
    line = next(x for x in table.splitlines() if "| join |" in x)
    # tools in TOOLS order, the missed rep shown, the 1 GiB join target, steps lost per tool
    assert "| 1 (3) | join | 2.00 (2/3) | 40.00 | ≤ 2.0 | 0 / 8 |" in line
    ck = bs.ckpt_table(recs)
    assert "| 1 | petctl-mem | 0.090 | 0.090 | 0.100 | 2.00 | 2 |" in ck
    assert "| 1 | torchrun-efs | 3.000 | 3.000 | 3.000 | — | 1 |" in ck
    bd = bs.breakdown(recs)
    mem_line = next(x for x in bd.splitlines() if "petctl-mem" in x)
    assert "0.60" in mem_line and "0.30 (efs+memory)" in mem_line and mem_line.endswith("| 2 |")


def test_targets_by_size() -> None:
    assert bs.target(0.1, "drain") == 1.5
    assert bs.target(0.5, "hard_loss") == 4.0  # between sizes: the next size up
    assert bs.target(2, "join") == 4.0
    assert bs.target(8, "join") is None and bs.target(1, "cold_start") is None


def test_mem_table_shows_the_heaviest_chain_and_the_model() -> None:
    peak = {"run_gib": 6.0, "anon_gib": 3.5, "shm_gib": 2.5, "system_rise_gib": 7.0, "model_gib": 11.0}
    recs = [
        rec(1.0, "cold_start", "petctl-mem", 1, 5.0, mem_peak=peak),
        rec(
            1.0, "cold_start", "petctl-mem", 2, 5.0, mem_peak={**peak, "run_gib": 5.0, "system_rise_gib": 8.0}
        ),
        rec(1.0, "join", "petctl-mem", 1, 1.0),  # only a chain's first record carries its peak
    ]
    line = next(x for x in bs.mem_table(recs).splitlines() if "petctl-mem" in x)
    # the heaviest chain's peak and split, per GiB of state per node (6 / (1 x 3)), the
    # machine-wide rise's max over chains, the model, and the number of chains
    assert line == "| 1 (3) | petctl-mem | 6.00 | 3.50 | 2.50 | 2.00 | 8.00 | 11.0 | 2 |"
    assert bs.mem_table([rec(1.0, "join", "petctl-mem", 1, 1.0)]) == ""


def test_memory_probes_read_real_processes_and_tmpfs_files(tmp_path: Path) -> None:
    import os

    blob = bytearray(64 * 2**20)  # 64 MiB of anonymous memory, touched
    blob[::4096] = b"x" * len(blob[::4096])
    assert bs.pss_anon_gib(os.getpid()) >= 60 / 1024
    assert bs.pss_anon_gib(2**22 + 12345) == 0.0  # no such process
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "slot").write_bytes(b"\1" * (8 * 2**20))
    assert 8 / 1024 <= bs.tree_bytes_gib(tmp_path) < 9 / 1024
    del blob


def test_scenarios_filter(capsys: pytest.CaptureFixture[str]) -> None:
    assert bs.parse_args([]).scenario_set == {"drain", "join", "hard_loss"}
    assert bs.parse_args(["--scenarios", "hard_loss"]).scenario_set == {"hard_loss"}
    with pytest.raises(SystemExit):
        bs.parse_args(["--scenarios", "cold_start"])  # always runs: not a choice
    assert "--scenarios" in capsys.readouterr().err


def test_memory_model_counts_the_snapshot_slots_the_product_would_admit() -> None:
    # 0.1 and 1 GiB: every slot fits, the need is memory_need's whole need, as before
    m = bs.memory_model(1, 3, True, avail=20.0, reserve=1.2)
    assert (m["slots"], m["of_slots"], m["fallback"]) == (6, 6, False)
    assert m["need"] == bs.memory_need(1, 3, snapshots=True)  # workers, 2 slots per node, buffer, 1 GiB
    # 4 GiB x 2 nodes on this 24 GiB machine: workers 8 + 1 GiB of processes; 20 - 9 - 1.2 = 9.8
    # GiB of room: 2 of the 4 slots fit (budget.fits takes a slot only whole), the rest is EFS
    m = bs.memory_model(4, 2, True, avail=20.0, reserve=1.2)
    assert (m["slots"], m["of_slots"], m["fallback"]) == (2, 4, True)
    assert (m["base"], m["need"]) == (2 * 4 + 4 + 1, 2 * 4 + 4 + 1 + 2 * 4)
    assert bs.memory_model(4, 2, True, avail=9.0, reserve=1.2)["slots"] == 0  # no room: never negative
    assert bs.memory_model(4, 2, False, avail=20.0, reserve=1.2) == {
        "base": 13.0, "need": 13.0, "slots": 0, "of_slots": 0, "fallback": False}  # fmt: skip
    assert bs.snapshot_reserve_gib(24.0) == pytest.approx(1.2)  # 5 % of MemTotal (above 512 MiB)
    assert bs.snapshot_reserve_gib(4.0) == 0.5


def test_ckpt_table_says_what_served_each_checkpoint_and_mem_table_the_low_water() -> None:
    recs = [
        rec(
            4.0,
            "cold_start",
            "petctl-mem",
            1,
            30.0,
            ckpt_blocked=[2.0, 5.0, 6.0],
            ckpt_via=["memory", "efs", "efs"],
            mem_peak={
                "run_gib": 16.0,
                "anon_gib": 8.0,
                "shm_gib": 8.0,
                "system_rise_gib": 17.0,
                "model_gib": 21.0,
                "min_available_gib": 3.25,
                "oom_kills": 0,
            },
        ),  # fmt: skip
        rec(4.0, "cold_start", "petctl-efs", 1, 30.0, ckpt_blocked=[5.0]),
    ]
    ck = bs.ckpt_table(recs)
    assert "| 4 | petctl-mem | 5.000 | 1.250 | 6.000 | — | 3 | 1 / 2 | 2.000 / 5.500 |" in ck
    assert "| 4 | petctl-efs | 5.000 | 1.250 | 5.000 | — | 1 | 0 / 0 | — / — |" in ck
    line = next(x for x in bs.mem_table(recs).splitlines() if "petctl-mem" in x)
    assert line.endswith("| 21.0 | 1 | 3.25 | 0 |")
    assert bs.oom_kills() >= 0  # /proc/vmstat's oom_kill on Linux


def test_a_line_is_timed_when_it_was_printed_not_when_the_tailer_forwarded_it() -> None:
    import benchlib

    line = "[i-n2 attempt_0/rank0/out] step=138 world_size=3 loss=0.735338 mono=33878.012"
    assert benchlib.STEP_RE.search(line) is not None  # the step parser still reads it
    assert benchlib._mono(line, 33878.170) == 33878.012  # printed, not forwarded 0.16 s later
    assert benchlib._mono("[x] step=3 world_size=2 loss=1.0", 50.0) == 50.0  # no mono: arrival
    assert benchlib._mono("bench: started seconds=0.2 mono=99.5", 50.0) == 50.0  # never after arrival
