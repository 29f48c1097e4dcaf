"""`petctl configure` records existing resources; each bad value is named."""

from __future__ import annotations

GOOD = [
    "--region",
    "eu-west-1",
    "--subnet-ids",
    "subnet-0123456789abcdef0,subnet-0fedcba9876543210",
    "--security-group-id",
    "sg-0123456789abcdef0",
    "--efs-id",
    "fs-0123456789abcdef0",
    "--s3-bucket",
    "my-training-bucket",
    "--worker-instance-profile-arn",
    "arn:aws:iam::123456789012:instance-profile/petctl-worker",
    "--rdzv-instance-profile-arn",
    "arn:aws:iam::123456789012:instance-profile/petctl-rdzv",
]


def test_configure_by_flags_makes_profile_ready(run, profile_data):
    r = run("--profile", "ops", "configure", *GOOD)
    assert r.exit_code == 0, r.output
    assert "ready for jobs" in r.stdout
    data = profile_data("ops")
    assert data["region"] == "eu-west-1"
    assert data["subnet_ids"] == ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"]
    assert data["log_group"] == "/petctl/ops"


def test_configure_partial_reports_missing(run):
    r = run("--output", "json", "configure", "--region", "us-west-2")
    assert r.exit_code == 0
    assert '"missing_for_jobs"' in r.stdout and "subnet_ids" in r.stdout


def test_configure_rejects_bad_subnet_naming_it(run):
    r = run("configure", "--subnet-ids", "subnet-0123456789abcdef0,subnet-XYZ")
    assert r.exit_code == 2
    assert "'subnet-XYZ' for --subnet-ids is not a subnet id" in r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.output


def test_configure_prompts_on_terminal_input(run, monkeypatch, profile_data):
    monkeypatch.setattr("petctl.cli._stdin_is_terminal", lambda: True)
    answers = "\n".join(
        [
            "eu-west-1",
            "subnet-0123456789abcdef0",
            "sg-0123456789abcdef0",
            "fs-0123456789abcdef0",
            "my-training-bucket",
            "arn:aws:iam::123456789012:instance-profile/w",
            "arn:aws:iam::123456789012:instance-profile/r",
        ]
    )
    r = run("--profile", "typed", "configure", input=answers + "\n")
    assert r.exit_code == 0, r.output
    assert profile_data("typed")["efs_id"] == "fs-0123456789abcdef0"


def test_configure_without_values_off_terminal_is_an_error(run):
    r = run("configure")
    assert r.exit_code == 2 and "no values given" in r.stderr


def test_configure_show(run):
    run("configure", "--region", "us-west-2")
    r = run("--output", "json", "configure", "--show")
    assert r.exit_code == 0 and '"region": "us-west-2"' in r.stdout
