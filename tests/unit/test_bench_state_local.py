"""bench/bench_state_local.py: an instance's log read as the harness reads a node's pipes (no cloud)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_state as bs  # noqa: E402
import bench_state_local as bsl  # noqa: E402


def test_log_node_times_steps_by_their_own_clock_across_partial_reads(tmp_path: Path) -> None:
    log = tmp_path / "i-1.log"
    node = bsl.LogNode("i-1", log, started=0.0)
    log.write_text(
        "2026-12-06 02:38:52,098 INFO petctl_agent.status: event workers_ready {}\n"
        "[i-1 attempt_0/rank0/out] step=7 world_size=3 loss=0.5 mono=1.250\n"
        "[i-1 attempt_0/rank0/out] bench: restored step=6 seconds=0.7 source=memory gib=1\n"
        'petctl fetch: {"status": "ok", "step": 6, "bytes": 1024, "holders": 2, "seconds": 0.5}\n'
        "[i-1 attempt_0/rank0/out] step=8 world_si"  # a line the agent has not finished writing
    )
    node.read()
    assert node.steps == [(1.25, 7, 3)]  # the worker's mono=, not when the line was read
    assert [(w, kv["source"]) for _, w, kv in node.marks] == [("restored", "memory")]
    assert [(f["holders"], f["seconds"]) for f in node.fetches] == [(2, 0.5)]
    with open(log, "a") as f:
        f.write("ze=3 loss=0.4 mono=1.300\n")
    node.read()
    assert node.steps[-1] == (1.3, 8, 3)
    assert node.steps_after(1.26, 3) == [(1.3, 8, 3)] and node.last_step() == 8


def test_local_cloud_tool_is_named_and_not_run_by_default() -> None:
    assert "petctl-local" in bs.TOOLS
    assert "petctl-local" not in bs.parse_args([]).tool_list
    assert bs.parse_args(["--tools", "petctl-mem,petctl-local"]).tool_list == ["petctl-mem", "petctl-local"]
