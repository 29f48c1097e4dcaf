"""The agent's side of a failing worker's note (``WorkerStops.failure_noted``): only the current
workers' note counts, and a new generation starts without its predecessors'."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from petctl_agent.elastic.stopping import WorkerStops


def test_only_the_current_workers_note_counts(tmp_path: Path) -> None:
    stops = WorkerStops(tmp_path / "drain", tmp_path / "progress.json", 5.0, tmp_path / "failed.json")
    note = tmp_path / "failed.json"
    stops.workers_starting()
    stops.workers_started()
    assert stops.failure_noted() is None
    note.write_text(json.dumps({"pid": 1, "error": "RuntimeError: Connection reset by peer"}))
    assert stops.failure_noted() == "RuntimeError: Connection reset by peer"
    # written before these workers started (a previous generation's, left behind): ignored
    old = time.time() - 60
    os.utime(note, (old, old))
    assert stops.failure_noted() is None
    note.write_text("{not json")
    assert stops.failure_noted() is None
    stops.workers_starting()  # the next generation starts without it
    assert not note.exists()


def test_the_note_defaults_beside_the_progress_file(tmp_path: Path) -> None:
    stops = WorkerStops(tmp_path / "drain", tmp_path / "progress.json", 5.0)
    assert stops.failure_file == tmp_path / "failed.json"
