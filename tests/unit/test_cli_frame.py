"""The CLI frame: help, version, aliases, light start-up, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from petctl import __version__
from petctl.cli import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="petctl")


def test_help_lists_product_command_names():
    r = invoke("--help")
    assert r.exit_code == 0
    for name in (
        "setup",
        "teardown",
        "configure",
        "run-job",
        "scale",
        "status",
        "list-hosts",
        "logs",
        "jobs",
        "kill-job",
        "upload",
    ):
        assert f"  {name} " in r.stdout, name
    assert "run_job" not in r.stdout.split("Commands:")[1]  # the aliases work, unlisted


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and __version__ in r.stdout


@pytest.mark.parametrize(
    "alias,canonical", [("run_job", "run-job"), ("kill_job", "kill-job"), ("list_hosts", "list-hosts")]
)
def test_underscore_names_of_the_original_tool_still_work(alias, canonical):
    r = invoke(alias, "--help")
    assert r.exit_code == 0
    assert f"petctl {canonical} [OPTIONS]" in r.stdout


def test_local_group_takes_both_spellings():
    for name in ("kill-instance", "kill_instance", "spot_interrupt", "restart_rdzv"):
        r = invoke("local", name, "--help")
        assert r.exit_code == 0 and "Usage: petctl local" in r.stdout, name


def test_global_options_work_after_the_command():
    from petctl.cli import hoist_global_options

    def none(name):
        return set()

    assert hoist_global_options(["jobs", "--output", "json"], none) == ["--output", "json", "jobs"]
    assert hoist_global_options(["status", "j", "--profile", "p", "-o=json"], none) == [
        "--profile",
        "p",
        "-o=json",
        "status",
        "j",
    ]
    # the training script's own options after -- are never taken
    assert hoist_global_options(["run-job", "t.py", "--", "--debug", "--region", "x"], none) == [
        "run-job",
        "t.py",
        "--",
        "--debug",
        "--region",
        "x",
    ]
    # nor an option the command defines itself (configure --region)
    assert hoist_global_options(["configure", "--region", "eu-west-1"], lambda n: {"--region"}) == [
        "configure",
        "--region",
        "eu-west-1",
    ]
    r = invoke("status", "somejob", "--profile", "bad/name")
    assert r.exit_code == 2 and "profile name 'bad/name' is invalid" in r.stderr


def test_script_arguments_without_double_dash_get_a_hint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = invoke("run-job", "--min", "1", "--max", "1", str(script), "--epochs", "2")
    assert r.exit_code == 2 and "No such option '--epochs'" in r.stderr
    assert "the training script's arguments go after --" in r.stderr and "-- --epochs" in r.stderr
    r = invoke("run-job", "--min", "1", "--max", "1", str(script), "extra")
    assert r.exit_code == 2 and "go after --" in r.stderr


def test_hints_carry_local_when_it_is_used():
    from petctl import ui

    ui.set_prog(local=True)
    assert ui.cmd("status j") == "petctl --local status j"
    ui.set_prog(profile="team")
    assert ui.cmd("kill-job j") == "petctl --profile team kill-job j"
    ui.set_prog()
    assert ui.cmd("setup") == "petctl setup"


def test_no_color_strips_styles(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    r = CliRunner().invoke(cli, ["run-job", "--min", "1", "--max", "1", "s3://b/x/"], color=True)
    assert "\x1b[" not in r.output
    monkeypatch.delenv("NO_COLOR")
    r = CliRunner().invoke(
        cli, ["--no-color", "run-job", "--min", "1", "--max", "1", "s3://b/x/"], color=True
    )
    assert "\x1b[" not in r.output


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\n"
        "from petctl.cli import cli\n"
        "try:\n    cli(['--help'], prog_name='petctl')\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('boto3', 'botocore', 'torch', 'moto', 'jinja2') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY=\n" in out, out


def test_bad_profile_name_is_one_line_error():
    r = invoke("--profile", "bad/name", "jobs")
    assert r.exit_code == 2
    assert "profile name 'bad/name' is invalid" in r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--min", "0", "--max", "2"], "--min 0 is invalid"),
        (["--min", "3", "--max", "2"], "--max 2 is smaller than --min 3"),
        (["--min", "1", "--max", "2", "--size", "5"], "--size 5 is outside [--min 1, --max 2]"),
        (["--min", "1", "--max", "2", "--name", "Bad_Name"], "job name 'Bad_Name' is invalid"),
        (["--min", "1", "--max", "2", "--instance-type", "huge"], "'huge' is not an EC2 instance type"),
        (["--min", "1", "--max", "2", "--nproc-per-node", "zero"], "--nproc-per-node 'zero' is invalid"),
        (["--min", "1", "--max", "2", "--ami", "img-1"], "--ami 'img-1' is not an AMI id"),
    ],
)
def test_run_job_validates_before_anything(tmp_path, args, message):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = invoke("run_job", *args, str(script))
    assert r.exit_code == 2
    assert message in r.stderr, r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.output


def test_run_job_missing_target(tmp_path):
    r = invoke("run_job", "--min", "1", "--max", "1", str(tmp_path / "nope.py"))
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_run_job_directory_needs_script(tmp_path):
    r = invoke("run_job", "--min", "1", "--max", "1", str(tmp_path))
    assert r.exit_code == 2 and "give the script inside it" in r.stderr


def test_run_job_without_setup_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path / "home"))
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = invoke("--profile", "fresh", "run_job", "--min", "1", "--max", "1", str(script))
    assert r.exit_code == 2
    assert "unknown profile 'fresh'" in r.stderr and "petctl --profile fresh setup" in r.stderr
    # A profile that exists but lacks resources says what is missing.
    assert invoke("--profile", "fresh", "configure", "--region", "us-east-1").exit_code == 0
    r = invoke("--profile", "fresh", "run_job", "--min", "1", "--max", "1", str(script))
    assert r.exit_code == 2
    assert "profile 'fresh' is not set up" in r.stderr and "`petctl --profile fresh setup`" in r.stderr


def test_unknown_profile_teardown():
    r = invoke("--profile", "ghost", "teardown")
    assert r.exit_code == 2
    assert "unknown profile 'ghost'" in r.stderr


def test_bad_since_duration():
    r = invoke("logs", "somejob", "--since", "yesterday")
    assert r.exit_code == 2 and "--since 'yesterday' is not a duration" in r.stderr


def test_s3_prefix_target_is_refused():
    r = invoke("run_job", "--min", "1", "--max", "1", "s3://bucket/code/")
    assert r.exit_code == 2 and "is a prefix" in r.stderr


def test_profile_names_must_make_valid_stack_names():
    for bad in ("my_team", "job-x"):
        r = invoke("--profile", bad, "jobs")
        assert r.exit_code == 2 and f"profile name {bad!r} is invalid" in r.stderr


def test_aws_profile_with_dots_maps_to_a_petctl_profile(monkeypatch):
    from petctl import config

    monkeypatch.delenv("PETCTL_PROFILE", raising=False)
    monkeypatch.setenv("AWS_PROFILE", "dev.admin")
    assert config.resolve_profile_name(None) == "dev-admin"


def test_local_help_does_not_start_the_local_cloud(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_LOCAL_DIR", str(tmp_path / "local"))
    r = invoke("--local", "run_job", "--help")
    assert r.exit_code == 0
    assert not (tmp_path / "local" / "cloud.json").exists()
    script = tmp_path / "train.py"
    script.write_text("x")
    r = invoke("--local", "run_job", "--min", "3", "--max", "1", str(script))
    assert r.exit_code == 2 and not (tmp_path / "local" / "cloud.json").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--torch-version", "2.1.0"], "--torch-version '2.1.0' is not supported"),
        (["--torch-version", "3.0.0"], "--torch-version '3.0.0' is not supported"),
        (["--torch-version", "latest"], "--torch-version 'latest' is not supported"),
        (["--max-restarts", "-1"], "--max-restarts -1 is out of range"),
        (["--max-node-failures", "0"], "--max-node-failures 0 is out of range"),
        (["--join-timeout", "5"], "--join-timeout 5 is out of range"),
    ],
)
def test_run_job_rejects_bad_new_options_in_one_line(tmp_path, flags, message):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = invoke("run_job", "--min", "1", "--max", "1", *flags, str(script))
    assert r.exit_code == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_user_tag_values_are_sanitized():
    from petctl import jobs

    assert jobs.sanitize_tag_value("alice") == "alice"
    assert jobs.sanitize_tag_value("DOMAIN\\bob (admin)") == "DOMAIN-bob -admin-"
    assert jobs.sanitize_tag_value("é" * 200) == "-" * 128
    assert jobs.sanitize_tag_value("") == "unknown"


def test_rdzv_backend_choices_match_the_agents():
    from petctl.cli import run_job
    from petctl_agent.spec import RDZV_BACKENDS

    (opt,) = [p for p in run_job.params if p.name == "rdzv_backend"]
    assert tuple(opt.type.choices) == RDZV_BACKENDS  # the CLI offers exactly what the agent runs


def test_warm_pool_is_refused_with_spot_in_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = invoke("run-job", "--min", "1", "--max", "2", "--spot", "--warm-pool", "1", str(script))
    assert r.exit_code == 2 and "--warm-pool cannot go with --spot" in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
