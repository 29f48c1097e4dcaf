"""``petctl status`` shows where a memory-snapshot restore came from (petctl/render.py).

The events are the agent's ``snapshot_restored`` / ``snapshot_fallback`` as docs/contracts.md
defines them; a sharded restore says the source of each shard and the step it went back to.
"""

from __future__ import annotations

from petctl import render


def _status(events: list[dict]) -> str:
    return render.status_text(
        {
            "job": "j",
            "state": "RUNNING",
            "stack_status": "CREATE_COMPLETE",
            "desired": 2,
            "in_service": 2,
            "min": 1,
            "max": 3,
            "world_size": 2,
            "last_step": 10,
            "last_checkpoint_step": 8,
            "rounds": 2,
            "restarts": 1,
            "uptime_s": 60,
            "hosts": [],
            "events": events,
        }
    )


def test_a_sharded_restore_shows_each_shards_source_and_the_step_gone_back_to() -> None:
    out = _status(
        [
            {"t": 1.0, "kind": "rendezvous_done", "instance_id": "i-0", "round": 2, "world_size": 2},
            {
                "t": 2.0,
                "kind": "snapshot_restored",
                "instance_id": "i-1",
                "source": "peer",
                "step": 6,
                "bytes": 10,
                "seconds": 0.2,
                "shards": {"self": [1], "peer": [0]},
                "newest": 8,
                "back_to": 6,
            },
            {
                "t": 3.0,
                "kind": "snapshot_restored",
                "instance_id": "i-2",
                "source": "efs",
                "step": 4,
                "shards": {"efs": [0, 1]},
                "newest": 8,
                "back_to": 4,
            },
        ]
    )
    line = next(ln for ln in out.splitlines() if "i-1" in ln)
    assert "source=peer" in line and "step=6" in line and "shards self 1; peer 0" in line
    assert "went back to step 6 (newest 8)" in line
    line = next(ln for ln in out.splitlines() if "i-2" in ln)
    assert "source=efs" in line and "shards efs 0,1" in line and "went back to step 4" in line
    line = next(ln for ln in out.splitlines() if "i-0" in ln)
    assert "round=2" in line and "world_size=2" in line


def test_a_replicated_restore_and_a_fallback_warning() -> None:
    out = _status(
        [
            {"t": 1.0, "kind": "snapshot_restored", "instance_id": "i-1", "source": "self", "step": 5},
            {
                "t": 2.0,
                "kind": "snapshot_fallback",
                "instance_id": "i-1",
                "step": 6,
                "reason": "memory snapshot skipped (no-fit: ...); step written to EFS",
            },
        ]
    )
    assert "source=self, step=5" in out
    assert "snapshot_fallback" in out and "step=6, reason=memory snapshot skipped (no-fit" in out
