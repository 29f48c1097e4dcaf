"""A project on the local cloud, through the CLI a user types: a project directory whose script
reads a data file by a path relative to the project and imports a package its requirements.txt
names (a wheel vendored in the project, which nothing on this machine has installed) trains to
SUCCEEDED on 2 nodes (its output in the job's shared work dir, the install a boot stage, done once
for the job with this machine's pip); the same script without its data file fails the job in
under a minute with the exception's line, its rank and node in ``run-job --wait``'s error and in
``petctl status``; and a requirement no index has fails a job in under a minute with pip's line.
~1.5-2.5 min on a 2-core machine (two boots of two instances each, one of one).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import wheels

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TRAIN = """\
import os
import torch
import torch.distributed as dist
import tinywords  # the project's requirement

dist.init_process_group("gloo")
text = open("data/input.txt").read()  # relative to the project, as under `cd project && torchrun`
t = torch.tensor([float(len(text) + tinywords.count(text))])
dist.all_reduce(t)
if dist.get_rank() == 0:
    with open("result.txt", "w") as f:  # relative: the job's shared work dir
        f.write(f"{int(t.item())} {dist.get_world_size()}\\n")
print("rank", dist.get_rank(), "read", len(text), flush=True)
"""
LINE = "FileNotFoundError: [Errno 2] No such file or directory: 'data/input.txt'"
#: A vendored wheel, as a user without an index (or with private wheels) lists it.
REQUIREMENTS = f"--no-index\n--find-links wheels\n{wheels.NAME}=={wheels.VERSION}\n"
PIP_LINE = "ERROR: Could not find a version that satisfies the requirement no-such-package-here==1.0"


def petctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "petctl.cli", "--local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _job(started: subprocess.CompletedProcess) -> str:
    for line in (started.stdout + started.stderr).splitlines():
        if "petctl --local kill-job " in line:
            return line.rsplit("kill-job ", 1)[1].split()[0]
    raise AssertionError(started.stdout + started.stderr)


def test_a_project_reads_its_files_and_a_failing_one_says_why(local_home, tmp_path) -> None:
    from petctl import local

    r = petctl("setup")
    assert r.returncode == 0, r.stderr
    assert importlib.util.find_spec(wheels.NAME) is None  # nothing here has it: the job installs it
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        d.mkdir()
        (d / "train.py").write_text(TRAIN)
        wheels.build(d / "wheels")
        (d / "requirements.txt").write_text(REQUIREMENTS)
    (good / "data").mkdir()
    (good / "data" / "input.txt").write_text("hello world\n")

    r = petctl("run-job", "--min", "2", "--max", "2", "--wait", str(good), "--", "train.py", timeout=600)
    job = _job(r)
    assert r.returncode == 0 and "SUCCEEDED" in r.stderr + r.stdout, r.stdout + r.stderr
    efs = Path(local.status()["state_dir"]) / "efs"
    work = list(efs.glob(f"*/petctl/jobs/{job}/work"))
    # 12 characters and 2 words (tinywords.count), on each of 2 nodes
    assert len(work) == 1 and (work[0] / "result.txt").read_text() == "28 2\n", list(efs.rglob("*"))[:20]
    assert (work[0] / "data").is_symlink() and not (work[0] / "result.txt").is_symlink()
    # installed once for the job (the local cloud's per-job cache), with this machine's pip; a boot stage
    envs = list((Path(local.status()["state_dir"]) / "venvs" / job / "envs").glob("*/.petctl-env.json"))
    assert len(envs) == 1 and json.loads(envs[0].read_text())["installed"] == ["tinywords-0.1"], envs
    assert importlib.util.find_spec(wheels.NAME) is None
    st = json.loads(petctl("-o", "json", "status", job).stdout)
    stages = [p["kind"] for b in st["boot_events"] for p in b["phases"]]
    assert stages.count("requirements_installed") == 1, st["boot_events"]  # the other node: cached
    installs = [e for e in st["events"] if e["kind"] == "requirements_installed"]
    assert sorted(e["cached"] for e in installs) == [False, True], installs

    t0 = time.monotonic()
    r = petctl("run-job", "--min", "2", "--max", "2", "--max-restarts", "10", "--wait", str(bad), "--",
               "train.py", timeout=600)  # fmt: skip
    took = time.monotonic() - t0
    job = _job(r)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"job {job} ended FAILED: " in out and LINE in out, out
    assert f"logs {job} --instance i-" in out and "To enable traceback" not in out, out
    st = json.loads(petctl("-o", "json", "status", job).stdout)
    assert st["state"] == "FAILED" and LINE in st["reason"] and " on i-" in st["reason"], st["reason"]
    assert st["restarts"] <= 2, st["restarts"]  # stopped after the second identical failure, not 10
    # from the workers' first start to FAILED: two tries of the script, well within a minute
    kinds = [(e["kind"], e["t"]) for e in st["events"]]
    first = min(t for k, t in kinds if k == "workers_started")
    failed = max(t for k, t in kinds if k == "failed")
    assert failed - first < 60, kinds
    assert took < 240, f"{took:.0f}s"  # with the boot of the local cloud's instances (~30 s)

    # a requirement no index has: the job fails at the install, with pip's line, in under a minute
    (bad / "requirements.txt").write_text("--no-index\nno-such-package-here==1.0\n")
    t0 = time.monotonic()
    r = petctl("run-job", "--min", "1", "--max", "1", "--wait", str(bad), "--", "train.py", timeout=600)
    took = time.monotonic() - t0
    job, out = _job(r), r.stdout + r.stderr
    assert r.returncode == 1 and PIP_LINE in out, out
    st = json.loads(petctl("-o", "json", "status", job).stdout)
    assert st["state"] == "FAILED" and PIP_LINE in st["reason"], st["reason"]
    assert "workers_started" not in [e["kind"] for e in st["events"]]
    assert took < 60, f"{took:.0f}s from run-job to FAILED"
