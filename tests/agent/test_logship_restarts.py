"""The worker log tail across restarts: no line is lost.

torch rmtree()s and re-creates ``attempt_<n>/`` at every restart that keeps the restart count
(each membership change). Lines were lost there: a worker's last line without its newline
(``print`` under ``python -u`` writes the text and the ``\\n`` separately, and a kill can land
between them), lines written after the tail's last read of a file that is then deleted, and the
last line of each file at the agent's exit. The real tailer, on files torch's own
``DefaultLogsSpecs`` lays out, and under CPU load.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from petctl_agent.cloud.logship import LogTailer


def _tailer(root: Path) -> tuple[LogTailer, list[str]]:
    got: list[str] = []
    return LogTailer(root, [lambda label, line: got.append(line)]), got


def test_last_line_without_newline_survives_the_restart(tmp_path: Path) -> None:
    attempt = tmp_path / "run" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stdout.log").write_bytes(b"step=1\nstep=2")  # killed before the \n
    t, got = _tailer(tmp_path)
    t.poll()
    assert got == ["step=1"]
    shutil.rmtree(attempt)  # the next round's workers start
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stdout.log").write_bytes(b"resumed from step=2\n")
    t.poll()
    assert got == ["step=1", "step=2", "resumed from step=2"]


def test_lines_after_the_last_read_survive_the_rmtree(tmp_path: Path) -> None:
    """The tail thread was late (a loaded machine): the old file is gone before it read the end."""
    attempt = tmp_path / "run" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    f = attempt / "0" / "stdout.log"
    f.write_bytes(b"step=1\n")
    t, got = _tailer(tmp_path)
    t.poll()
    with open(f, "ab") as fh:
        fh.write(b"step=2\nstep=3\n")
    shutil.rmtree(attempt)
    t.poll()
    assert got == ["step=1", "step=2", "step=3"]
    (attempt / "0").mkdir(parents=True)
    f.write_bytes(b"step=4\n")
    t.poll()
    assert got == ["step=1", "step=2", "step=3", "step=4"]


def test_stop_emits_the_last_line_without_newline(tmp_path: Path) -> None:
    f = tmp_path / "run" / "attempt_0" / "0" / "stderr.log"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"Traceback (most recent call last):\nRuntimeError: boom")
    t, got = _tailer(tmp_path)
    t.start()
    t.stop()
    assert got == ["Traceback (most recent call last):", "RuntimeError: boom"]


def test_no_line_lost_across_fast_restarts_under_load(tmp_path: Path) -> None:
    """Rounds of a fake worker on the paths torch's DefaultLogsSpecs gives (rmtree + re-create
    with the restart count unchanged), the tail thread at its real interval, the agent's poll
    before each restart, two busy processes on the CPUs: every line written reaches the sink."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    root = tmp_path / "logs"
    specs = DefaultLogsSpecs(log_dir=str(root), redirects=Std.ALL)
    envs = {0: {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}}
    t, got = _tailer(root)
    t.start()
    busy = [
        subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()+60\nwhile time.time()<t: pass"])
        for _ in range(2)
    ]
    written: list[str] = []
    rng = random.Random(17)
    try:
        for rnd in range(30):
            t.poll()  # PetctlElasticAgent._start_workers: before_workers_start
            path = Path(specs.reify(envs).stdouts[0])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                lines = ["training world_size=2", f"resumed from step={rnd * 100}"]
                lines += [f"step={rnd * 100 + i} world_size=2" for i in range(1, rng.randint(1, 60))]
                for i, line in enumerate(lines):
                    os.write(fd, line.encode())  # print() under -u: the text, then the newline
                    written.append(line)
                    if i == len(lines) - 1 and rnd % 2:
                        break  # killed between the two writes
                    os.write(fd, b"\n")
                    if rng.random() < 0.1:
                        time.sleep(rng.uniform(0, 0.05))  # the tail thread reads mid-round
            finally:
                os.close(fd)
    finally:
        t.stop()
        for p in busy:
            p.kill()
            p.wait()
    assert got == written, (len(got), len(written), [w for w in written if w not in set(got)][:5])
