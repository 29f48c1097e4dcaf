"""A job's requirements through run-job against a moto server: a project's requirements.txt goes
into the spec and the dry run's plan; one that asks for another torch is refused in one line
before anything is created (no stack, no upload)."""

from __future__ import annotations

import json

import boto3
import pytest

from tests.functional.test_jobs import objects, spec_of


@pytest.fixture
def project(tmp_path):
    code = tmp_path / "proj"
    (code / "wheels").mkdir(parents=True)
    (code / "train.py").write_text("import tinywords\n")
    (code / "wheels" / "tinywords-0.1-py3-none-any.whl").write_bytes(b"not read by the CLI")
    (code / "requirements.txt").write_text("--no-index\n--find-links wheels  # vendored\ntinywords==0.1\n")
    return code


def stacks() -> list[str]:
    return [s["StackName"] for s in boto3.client("cloudformation").describe_stacks()["Stacks"]]


def test_the_projects_requirements_reach_the_spec_and_the_dry_run(run, ready, project):
    r = run(
        "--output",
        "json",
        "run_job",
        "--min",
        "1",
        "--max",
        "1",
        "--dry-run",
        "--name",
        "req",
        str(project),
        "--",
        "train.py",
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["requirements"]["requirements"] == ["tinywords==0.1"]
    assert plan["requirements"]["constraints"].startswith("torch==2.13.0")
    r = run(
        "run_job", "--min", "1", "--max", "1", "--dry-run", "--name", "req", str(project), "--", "train.py"
    )
    assert "packages:     from " in r.output and "after torch 2.13.0 (pinned): tinywords==0.1" in r.output

    r = run("run_job", "--min", "1", "--max", "1", "--name", "req", str(project), "--", "train.py")
    assert r.exit_code == 0, r.output
    spec = spec_of("req")
    assert spec["requirements"] == (project / "requirements.txt").read_text()
    assert spec["requirements_path"] == "requirements.txt" and len(spec["requirements_sha256"]) == 64


@pytest.mark.parametrize("line", ["torch==2.1", "torch<2", "torch @ https://example.com/torch-2.1.0.whl"])
def test_another_torch_is_refused_before_anything_is_created(run, ready, project, line):
    (project / "requirements.txt").write_text(f"tinywords==0.1\n{line}\n")
    before = stacks()
    r = run("run_job", "--min", "1", "--max", "1", "--name", "req", str(project), "--", "train.py")
    assert r.exit_code != 0 and r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "line 2" in lines[0] and "torch 2.13.0" in lines[0], r.output
    assert "Traceback" not in r.output
    assert stacks() == before and objects("petctl/jobs/") == []


def test_requirements_file_flag_and_opt_out(run, ready, project, tmp_path):
    outside = tmp_path / "gpu.txt"
    outside.write_text("tinywords==0.1\n")
    r = run("--output", "json", "run_job", "--min", "1", "--max", "1", "--dry-run", "--requirements", str(outside), str(project), "--",
            "train.py")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["spec"]["requirements_path"] == ""
    outside.write_text("./wheels/tinywords-0.1-py3-none-any.whl\n")  # a file, from outside the project
    r = run(
        "run_job",
        "--min",
        "1",
        "--max",
        "1",
        "--dry-run",
        "--requirements",
        str(outside),
        str(project),
        "--",
        "train.py",
    )
    assert r.exit_code != 0 and "outside the project" in r.output, r.output
    (project / "requirements.txt").write_text("torch==2.1\n")
    r = run(
        "--output",
        "json",
        "run_job",
        "--min",
        "1",
        "--max",
        "1",
        "--dry-run",
        "--no-requirements",
        str(project),
        "--",
        "train.py",
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["requirements"] is None and plan["spec"]["requirements"] == ""
