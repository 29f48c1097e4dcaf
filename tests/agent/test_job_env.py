"""The job's environment on a node (petctl_agent/node/jobenv.py), with this machine's real pip and
a wheel no index has: installed once, importable with torch and petctl_agent behind it, found
cached the second time; a requirement that does not install raises pip's line and leaves nothing."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from petctl_agent.node import jobenv
from petctl_agent.settings import Settings
from petctl_agent.spec import JobSpec
from petctl_agent.worker.env import worker_entrypoint
from tests import wheels


def spec(requirements: str, path: str = "") -> JobSpec:
    return JobSpec(job_name="envjob", min_nodes=1, max_nodes=1, code_url="s3://b/k", script="train.py",
                   code_kind="dir", requirements=requirements, requirements_path=path)  # fmt: skip


def test_installed_once_then_cached_and_the_workers_python_sees_it(tmp_path):
    code = tmp_path / "code"
    wheels.build(code / "wheels")
    (code / "requirements.txt").write_text(
        f"--no-index\n--find-links wheels\n{wheels.NAME}=={wheels.VERSION}\n"
    )
    s = spec((code / "requirements.txt").read_text(), "requirements.txt")
    assert importlib.util.find_spec(wheels.NAME) is None
    env = jobenv.ensure(s, code, tmp_path / "envs")
    assert env is not None and not env.cached and env.installed == ("tinywords-0.1",)
    probe = "import tinywords, torch, petctl_agent, sys; print(tinywords.count('a b c'), sys.executable)"
    out = subprocess.run([str(env.python), "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", str(env.python)]
    again = jobenv.ensure(s, code, tmp_path / "envs")
    assert again is not None and again.cached and again.path == env.path and again.seconds == 0.0
    exe, args, method = worker_entrypoint(code / "train.py", (), Settings(workarounds_off=frozenset({"FORKSERVER"})),
                                          str(env.python))  # fmt: skip
    assert exe == str(env.python) and method == "spawn"
    assert jobenv.ensure(spec(""), code, tmp_path / "envs") is None


def test_a_requirement_that_does_not_install_raises_pips_line(tmp_path):
    (tmp_path / "code").mkdir()
    with pytest.raises(jobenv.RequirementsError) as e:
        jobenv.ensure(spec("--no-index\nno-such-package-here==1.0\n"), tmp_path / "code", tmp_path / "envs")
    assert str(e.value).startswith(
        "ERROR: Could not find a version that satisfies the requirement no-such-package-here==1.0"
    )
    assert [p for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")] == []


def test_a_forkserver_worker_puts_the_job_env_first(tmp_path):
    """multiprocessing's forkserver sets sys.path to the agent's: run_script puts the env back."""
    code = tmp_path / "code"
    wheels.build(code / "wheels")
    s = spec(f"--no-index\n--find-links wheels\n{wheels.NAME}\n", "")
    env = jobenv.ensure(s, code, tmp_path / "envs")
    probe = (
        "import sys; from petctl_agent.worker.forkserver import use_job_env; sys.path[:] = [p for p in sys.path "
        f"if {str(env.path)!r} not in p]; use_job_env({str(env.path)!r}); import tinywords; print(tinywords.__file__)"
    )
    out = subprocess.run([str(env.python), "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith(str(env.path))
