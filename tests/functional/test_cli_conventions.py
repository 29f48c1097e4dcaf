"""Habits users bring from aws-cli, torchx and SkyPilot, against a real moto server."""

from __future__ import annotations

import json


def test_global_options_after_the_command(run):
    assert run("setup").exit_code == 0
    r = run("jobs", "--output", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == []
    r = run("jobs", "-o", "json", "--region", "us-east-1", "--profile", "default")
    assert r.exit_code == 0 and json.loads(r.stdout) == []


def test_debug_logs_every_aws_call_without_secrets(run, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "supersecretvalue")
    r = run("--debug", "setup")
    assert r.exit_code == 0, r.output
    calls = [line for line in r.stderr.splitlines() if line.startswith("debug: aws ")]
    assert any("aws sts.GetCallerIdentity" in c for c in calls)
    assert any("aws cloudformation.CreateStack" in c and "-> 200 in" in c for c in calls)
    create = next(c for c in calls if "cloudformation.CreateStack" in c)
    assert "TemplateBody" in create and "chars>" in create  # long values are cut, not dumped
    assert "supersecretvalue" not in r.stderr
    r = run("jobs")  # without --debug: no call lines
    assert "debug: aws" not in r.stderr


def test_hints_name_the_local_cloud_and_the_profile(run):
    r = run("--profile", "team", "setup")
    assert r.exit_code == 0, r.output
    assert "next: petctl --profile team run-job" in r.stdout


def test_logs_without_since_reads_the_last_hour_only(run):
    import time

    import boto3

    assert run("setup").exit_code == 0
    logs = boto3.client("logs")
    logs.create_log_stream(logGroupName="/petctl/default", logStreamName="old/i-01")
    now = int(time.time() * 1000)
    logs.put_log_events(
        logGroupName="/petctl/default",
        logStreamName="old/i-01",
        logEvents=[
            {"timestamp": now - 2 * 3600 * 1000, "message": "two hours ago"},
            {"timestamp": now, "message": "just now"},
        ],
    )
    r = run("logs", "old")
    assert "just now" in r.stdout and "two hours ago" not in r.stdout
    r = run("logs", "old", "--since", "3h")
    assert "two hours ago" in r.stdout


def test_completion_offers_the_profiles_job_names(run, ready):
    from click.testing import CliRunner

    from petctl.cli import cli

    for name in ("alpha", "beta"):
        assert run("run-job", "--name", name, "--min", "1", "--max", "1", str(ready)).exit_code == 0
    env = {"_PETCTL_COMPLETE": "bash_complete", "COMP_WORDS": "petctl status a", "COMP_CWORD": "2"}
    r = CliRunner().invoke(cli, [], env=env, prog_name="petctl")
    assert "plain,alpha" in r.output and "beta" not in r.output
    env["COMP_WORDS"], env["COMP_CWORD"] = "petctl --profile nobody kill-job ", "4"
    r = CliRunner().invoke(cli, [], env=env, prog_name="petctl")
    assert "alpha" not in r.output  # an unknown profile completes nothing (and does not fail)
