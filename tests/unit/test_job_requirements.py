"""run-job's requirements check (petctl/jobs/requirements.py): what is refused, in one line, and
what each node is told to install; and the agent's side that needs no pip (constraints, pip's line,
the install as a boot stage of status)."""

from __future__ import annotations

import pytest

from petctl.errors import ConfigError
from petctl.jobs import requirements as rq
from petctl.jobs.boots import boot_phases
from petctl_agent.node import jobenv

TORCH = "2.13.0"


def checked(project, text: str, name: str = "requirements.txt") -> rq.Requirements:
    (project / name).write_text(text)
    return rq.check(rq.find(str(project), None, False), TORCH, project)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "tinywords-0.1-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "train.py").write_text("")
    return tmp_path


@pytest.mark.parametrize(
    "line",
    ["torch==2.1", "torch<2", "torch>=3", "Torch ==2.12.1", "torch[opt]==2.1.0",
     "torch @ https://example.com/torch.whl", "https://example.com/torch-2.1.0-cp311-cp311-linux_x86_64.whl"],
)  # fmt: skip
def test_another_torch_is_refused_in_one_line(project, line):
    with pytest.raises(ConfigError) as e:
        checked(project, f"numpy\n\n# a comment\n{line}\n")
    msg = e.value.format_message()
    assert "\n" not in msg and "line 4" in msg and f"torch {TORCH}" in msg, msg


@pytest.mark.parametrize("line", ["torch", "torch==2.13.0", "torch>=2.0,<3", "torch~=2.13"])
def test_the_jobs_own_torch_is_kept(project, line):
    assert checked(project, f"{line}\n").lines == [line]


def test_a_nested_file_and_a_constraints_file_are_read_for_torch(project):
    (project / "extra.txt").write_text("torch==2.0.1\n")
    with pytest.raises(ConfigError, match=r"extra.txt line 1: 'torch==2.0.1'"):
        checked(project, "-r extra.txt\n")
    (project / "pins.txt").write_text("torch<2\n")
    with pytest.raises(ConfigError, match=r"pins.txt line 1"):
        checked(project, "--constraint=pins.txt\n")


def test_lines_paths_and_continuations(project):
    r = checked(
        project,
        "--no-index\n-f wheels\ntinywords==0.1 \\\n  --hash=sha256:00\nrequests>=2 ; python_version > '3'  # http\n"
        "./wheels/tinywords-0.1-py3-none-any.whl\n",
    )
    assert r.lines == [
        "tinywords==0.1",
        "requests>=2 ; python_version > '3'",
        "./wheels/tinywords-0.1-py3-none-any.whl",
    ]
    assert r.local_files and r.project_path == "requirements.txt"
    assert r.digest(b"a") != r.digest(b"b")  # names the project's files: the project is in the key
    plain = checked(project, "requests\n")
    assert not plain.local_files and plain.digest(b"a") == plain.digest(b"b")


@pytest.mark.parametrize(
    "text, words",
    [("-e .\n", "editable"), ("../other.whl\n", "outside the project"), ("-r missing.txt\n", "not in the project"),
     ("--find-links /abs/wheels\n", "relative to the project"), ("./nope.whl\n", "not in the project")],
)  # fmt: skip
def test_files_must_be_the_projects(project, text, words):
    with pytest.raises(ConfigError, match=words):
        checked(project, text)


def test_a_file_outside_the_project_names_packages_only(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "reqs.txt"
    outside.write_text("requests\n")
    r = rq.check(rq.find(str(project), str(outside), False), TORCH, project)
    assert r.lines == ["requests"] and r.project_path == ""
    outside.write_text("-f wheels\ntinywords\n")
    with pytest.raises(ConfigError, match="outside the project cannot"):
        rq.check(rq.find(str(project), str(outside), False), TORCH, project)


def test_found_at_the_projects_top_unless_told_otherwise(project):
    assert not rq.find(str(project), None, False)
    (project / "requirements.txt").write_text("requests\n")
    assert rq.find(str(project), None, False).text == "requests\n"
    assert not rq.find(str(project), None, True)
    assert not rq.find(str(project / "train.py"), None, False)  # a single script: only --requirements
    with pytest.raises(ConfigError, match="no such file"):
        rq.find(str(project), str(project / "nope.txt"), False)


def test_pip_error_is_pips_line_naming_the_package():
    out = (
        "Looking in links: wheels\n"
        "ERROR: Could not find a version that satisfies the requirement nosuch==1 (from versions: none)\n"
        "ERROR: No matching distribution found for nosuch==1\n"
    )
    assert jobenv.pip_error(out).startswith(
        "ERROR: Could not find a version that satisfies the requirement nosuch"
    )
    assert jobenv.pip_error("something odd\n") == "something odd"


def test_constraints_pin_torch_and_the_agents_own_dependencies_as_installed():
    from importlib import metadata

    pins = dict(line.split("==") for line in jobenv.constraints().splitlines())
    assert pins["torch"] == metadata.version("torch")
    assert pins["boto3"] == metadata.version("boto3") and "click" not in pins  # the CLI's: not pinned


def test_the_install_is_a_boot_stage_with_its_own_time():
    docs = [{"instance_id": "i-1", "role": "worker", "events": [
        {"t": 100.0, "kind": "launched"}, {"t": 130.0, "kind": "agent_started"}]}]  # fmt: skip
    reports = [{"instance_id": "i-1", "events": [
        {"t": 140.0, "kind": "requirements_installed", "seconds": 7.5, "cached": False},
        {"t": 900.0, "kind": "requirements_installed", "seconds": 0.0, "cached": True},  # a restart
        {"t": 141.0, "kind": "workers_ready", "seconds": 1.0}]}]  # fmt: skip
    (b,) = boot_phases(docs, reports)
    assert b["phases"] == [
        {"kind": "agent_started", "seconds": 30.0},
        {"kind": "requirements_installed", "seconds": 7.5},
    ]
    assert b["seconds"] == 40.0
