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
    monkeypatch.setattr("petctl.commands.common.stdin_is_terminal", lambda: True)
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


def test_configure_prompts_check_each_answer_and_ask_again(aws, monkeypatch):
    """On a terminal: a bad answer is refused as it is typed and asked again; the region
    defaults to AWS_REGION as in aws-cli."""
    import os
    import pty
    import select
    import sys
    import time

    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    answers = {
        "subnet ids": ["subnet-bad!", "subnet-0abc1234"],
        "security group id": ["sg-0abc1234"],
        "efs id": ["fs-0abc1234"],
        "bucket": ["my-petctl-bucket"],
        "worker instance profile arn": ["arn:aws:iam::123456789012:instance-profile/w"],
        "rdzv instance profile arn": ["arn:aws:iam::123456789012:instance-profile/r"],
        "region": [""],  # take the default offered
    }
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(
            sys.executable,
            [sys.executable, "-m", "petctl.cli", "--profile", "typed", "configure"],
            dict(os.environ),
        )
    screen, asked, deadline = "", 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096).decode(errors="replace")
        except OSError:
            chunk = ""
        if not chunk:
            break
        screen += chunk
        tail = screen[asked:]
        if tail.rstrip().endswith(":"):
            label = tail.rstrip().rsplit("\n", 1)[-1].lower()
            key = next(k for k in answers if label.startswith(k))
            os.write(fd, (answers[key].pop(0) if len(answers[key]) > 1 else answers[key][0]).encode() + b"\r")
            asked = len(screen)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, screen
    assert "region [eu-west-1]:" in screen
    assert "'subnet-bad!' for --subnet-ids is not a subnet id" in screen
    assert screen.lower().count("subnet ids:") == 2  # asked again after the bad answer
    assert "ready for jobs" in screen
