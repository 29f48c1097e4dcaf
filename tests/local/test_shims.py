"""The boot shims and the script mapping, without a daemon: each shim refuses what it does not
model (exit 2, loudly), and the path/loopback rewrite touches exactly the instance's paths."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from petctl.local import boot, shims


def run_shim(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    root = tmp_path / "root"
    (root / "etc" / "systemd" / "system").mkdir(parents=True, exist_ok=True)
    base = {
        "PATH": os.environ["PATH"],
        "PETCTL_LOCAL_ROOT": str(root),
        "PETCTL_LOCAL_STATE": str(tmp_path / "state"),
        "PETCTL_LOCAL_IMDS": "http://127.0.0.1:9/i-0",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_REGION": "us-east-1",
    }
    return subprocess.run(
        [sys.executable, "-I", str(shims.SCRIPT), *argv],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["dnf", "install", "amazon-efs-utils"],  # no -y: a boot cannot answer a prompt
        ["dnf", "-y", "remove", "python3.11"],
        ["dnf", "install", "-y", "nginx"],  # no local stand-in
        ["mount", "-t", "nfs4", "host:/", "/x"],
        ["mount", "-t", "efs", "-o", "tls,ro,hard", "fs-12345678:/", "ROOT/mnt/efs"],
        ["mount", "-t", "efs", "fs-12345678:/sub", "ROOT/mnt/efs"],
        ["mount", "-t", "efs", "fs-12345678:/", "/mnt/efs"],  # not mapped into the root
        ["systemctl", "restart", "petctl-agent.service"],
        ["systemctl", "enable", "--now", "a.service", "b.service"],
        ["aws", "s3", "sync", "s3://b/p", "ROOT/x"],
        ["aws", "s3", "cp", "--recursive", "s3://b/p", "ROOT/x"],
        ["aws", "s3", "cp", "s3://b/k", "/etc/passwd"],  # outside the root
        ["aws", "--region", "eu-west-1", "s3", "ls", "s3://b/"],
        ["aws", "ec2", "terminate-instances", "--instance-ids", "i-1"],
        ["aws", "autoscaling", "set-instance-health", "--instance-id", "i-1", "--health-status", "Dead"],
        [
            "aws",
            "autoscaling",
            "complete-lifecycle-action",
            "--auto-scaling-group-name",
            "g",
            "--lifecycle-hook-name",
            "h",
            "--instance-id",
            "i-1",
            "--lifecycle-action-result",
            "MAYBE",
        ],
        [
            "aws",
            "autoscaling",
            "complete-lifecycle-action",
            "--lifecycle-hook-name",
            "h",
            "--instance-id",
            "i-1",
            "--lifecycle-action-result",
            "CONTINUE",
        ],
        # which group?
        [
            "aws",
            "autoscaling",
            "record-lifecycle-action-heartbeat",
            "--lifecycle-hook-name",
            "h",
            "--instance-id",
            "i-1",
        ],
        [
            "aws",
            "autoscaling",
            "record-lifecycle-action-heartbeat",
            "--auto-scaling-group-name",
            "g",
            "--lifecycle-hook-name",
            "h",
            "--instance-id",
            "i-1",
            "--lifecycle-action-result",
            "CONTINUE",
        ],
        ["aws", "autoscaling", "delete-warm-pool", "--force-delete"],  # which group?
        [
            "aws",
            "autoscaling",
            "delete-warm-pool",
            "--auto-scaling-group-name",
            "g",
            "--cli-input-json",
            "{}",
        ],
        ["curl", "-sSf", "https://pypi.org/simple/"],  # nothing but IMDS
        ["curl", "-k", "http://169.254.169.254/latest/meta-data/"],
        ["curl", "-fsSL", "-o", "ROOT/x", "https://github.com/etcd-io/etcd/archive/v3.5.33.tar.gz"],
        ["ip", "addr"],
        ["ip", "-6", "-o", "addr", "show"],
        ["python3.11", "-c", "print(1)"],
        ["python3.11", "-m", "venv", "/opt/petctl"],  # not mapped into the root
        ["pip", "ENV", "uninstall", "torch"],
        ["pip", "ENV", "install", "torch"],  # never an unpinned torch
        ["pip", "ENV", "install", "--index-url", "https://example.com/simple", "torch==2.13.0"],
        ["pip", "ENV", "install", "--pre", "numpy"],
        ["shutdown", "-r", "now"],  # power-off only
        ["shutdown", "-h", "12:30"],  # now or +N minutes
    ],
    ids=lambda a: " ".join(a[:3]),
)
def test_each_shim_refuses_what_it_does_not_model(tmp_path: Path, argv: list[str]) -> None:
    argv = [a.replace("ROOT", str(tmp_path / "root")).replace("ENV", str(tmp_path / "env")) for a in argv]
    res = run_shim(tmp_path, *argv)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"{argv[0]} (petctl local shim): REFUSED:" in res.stderr
    # and noted where `petctl local status` shows it (the instance's `refused`)
    assert (tmp_path / "root" / "run" / "petctl-local" / "refused").read_text().startswith(argv[0] + " ")


def test_aws_shim_never_calls_outside_the_local_cloud(tmp_path: Path) -> None:
    res = run_shim(
        tmp_path, "aws", "s3", "ls", "s3://b/", env={"AWS_ENDPOINT_URL": "https://s3.amazonaws.com"}
    )
    assert res.returncode == 2 and "refusing to call AWS" in res.stderr


def test_aws_delete_warm_pool_reaches_moto_and_ends_the_pools_instances(tmp_path: Path) -> None:
    """A boot that gives up deletes the worker group's warm pool (common.sh.j2): through the shim,
    against moto with the local cloud's warm pools, the pool and its instance are gone."""
    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    from petctl.local import moto_patches

    moto_patches.apply()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        url = "http://{}:{}".format(*server.get_host_and_port())
        # moto's backends live in this process, shared by every server of it: start from none
        requests.post(f"{url}/moto-api/reset", timeout=10)
        session = boto3.session.Session(
            aws_access_key_id="petctl-local", aws_secret_access_key="petctl-local", region_name="us-east-1"
        )
        ec2, asg = session.client("ec2", endpoint_url=url), session.client("autoscaling", endpoint_url=url)
        vpc = ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.78.0/24")["Subnet"]["SubnetId"]
        template = ec2.create_launch_template(
            LaunchTemplateName="wp",
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.medium"},
        )["LaunchTemplate"]["LaunchTemplateId"]
        asg.create_auto_scaling_group(
            AutoScalingGroupName="petctl-demo-workers",
            LaunchTemplate={"LaunchTemplateId": template},
            MinSize=0,
            MaxSize=2,
            DesiredCapacity=0,
            VPCZoneIdentifier=subnet,
        )
        asg.put_warm_pool(AutoScalingGroupName="petctl-demo-workers", MinSize=1, MaxGroupPreparedCapacity=1)
        (warm,) = asg.describe_warm_pool(AutoScalingGroupName="petctl-demo-workers")["Instances"]
        res = run_shim(
            tmp_path,
            "aws",
            "autoscaling",
            "delete-warm-pool",
            "--region",
            "us-east-1",
            "--auto-scaling-group-name",
            "petctl-demo-workers",
            "--force-delete",
            env={
                "AWS_ENDPOINT_URL": url,
                "AWS_ACCESS_KEY_ID": "petctl-local",
                "AWS_SECRET_ACCESS_KEY": "petctl-local",
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )
        assert res.returncode == 0, (res.stdout, res.stderr)
        # A launch hook heartbeat reaches moto as the local cloud patches it: without a lifecycle
        # action to extend (the local cloud emulates no launch hook) the call fails as AWS's does.
        beat = run_shim(
            tmp_path,
            *"aws autoscaling record-lifecycle-action-heartbeat --region us-east-1".split(),
            *"--auto-scaling-group-name petctl-demo-workers --lifecycle-hook-name petctl-launch".split(),
            *("--instance-id", warm["InstanceId"]),
            env={
                "AWS_ENDPOINT_URL": url,
                "AWS_ACCESS_KEY_ID": "petctl-local",
                "AWS_SECRET_ACCESS_KEY": "petctl-local",
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )
        assert beat.returncode == 254 and "RecordLifecycleActionHeartbeat" in beat.stderr, beat.stderr
        pool = asg.describe_warm_pool(AutoScalingGroupName="petctl-demo-workers")
        assert not pool.get("WarmPoolConfiguration") and not pool["Instances"]
        (reservation,) = ec2.describe_instances(InstanceIds=[warm["InstanceId"]])["Reservations"]
        assert reservation["Instances"][0]["State"]["Name"] == "terminated"
    finally:
        server.stop()


def test_pip_checks_requirements_against_this_machine(tmp_path: Path) -> None:
    import torch

    have = torch.__version__.split("+")[0]
    ok = run_shim(tmp_path, "pip", str(tmp_path / "env"), "install", "--quiet", f"torch=={have}", "pip")
    assert ok.returncode == 0, ok.stderr
    other = run_shim(tmp_path, "pip", str(tmp_path / "env"), "install", "torch==2.2.0")
    assert other.returncode == 1 and "--torch-version" in other.stderr
    missing = run_shim(tmp_path, "pip", str(tmp_path / "env"), "install", "surely-not-installed-pkg")
    assert missing.returncode == 1 and "No matching distribution" in missing.stderr


def test_a_kept_environment_gets_the_pip_shim_of_now(tmp_path: Path) -> None:
    # The job's environment stays in the state dir across petctl versions; one made when the
    # shims were a single file has a pip shim naming that file.
    venv = ["python3.11", "-m", "venv", str(tmp_path / "root" / "opt" / "petctl")]
    made = run_shim(tmp_path, *venv, env={"PETCTL_LOCAL_JOB": "j"})
    assert made.returncode == 0, made.stderr
    pip = tmp_path / "state" / "venvs" / "j" / "petctl" / "bin" / "pip"
    now = pip.read_text()
    pip.write_text(now.replace(str(shims.SCRIPT), str(shims.SCRIPT.parent.with_suffix(".py"))))
    again = run_shim(tmp_path, *venv, env={"PETCTL_LOCAL_JOB": "j"})
    assert again.returncode == 0, again.stderr
    assert pip.read_text() == now
    res = subprocess.run([str(pip), "install", "pip"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "this machine's pip" in res.stderr, res.stderr


def test_dnf_logs_what_stands_in(tmp_path: Path) -> None:
    res = run_shim(tmp_path, "dnf", "install", "-y", "amazon-efs-utils", "python3.11")
    assert res.returncode == 0 and "provided by the mount shim" in res.stderr


@pytest.mark.parametrize(
    "unit, error",
    [
        ("[Service]\nExecStart=/bin/true\nUser=nobody\n", "Service.User not emulated"),
        ("[Service]\nType=forking\nExecStart=/bin/true\n", "Type=forking"),
        ("[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=graphical.target\n", "WantedBy"),
        ("[Service]\nRestart=always\n", "exactly one ExecStart"),
        ("[Service]\nExecStart=/bin/true\nRestart=on-abort\n", "Restart=on-abort not emulated"),
        ("[Timer]\nOnBootSec=1\n", "[Timer]"),
    ],
)
def test_unknown_unit_keys_are_refused(unit: str, error: str) -> None:
    with pytest.raises(shims.Refused, match=error.replace("[", r"\[").replace("]", r"\]")):
        shims.parse_unit(unit)


AGENT_UNIT = """[Unit]
StartLimitIntervalSec=600
StartLimitBurst=5
[Service]
ExecStart=/opt/petctl/bin/petctl-agent run
Restart=on-failure
RestartSec=10
RestartPreventExitStatus=78 79
"""


@pytest.mark.parametrize(
    "rc, starts, verdict",
    [
        (1, [], None),  # a crash: restarted
        (-9, [], None),  # SIGKILL is unclean: restarted
        (78, [], "status 78 is in RestartPreventExitStatus="),  # the agent's terminal exits
        (79, [], "status 79 is in RestartPreventExitStatus="),
        (0, [], "exited cleanly (status 0)"),
        (-15, [], "exited cleanly (SIGTERM)"),
        (1, [0.0, 100.0, 200.0, 300.0, 400.0], "start limit hit (5 starts within 600s)"),
        (1, [-300.0, 100.0, 200.0, 300.0, 400.0], None),  # one start left the window
    ],
)
def test_restart_follows_systemds_rules(rc: int, starts: list[float], verdict: str | None) -> None:
    """systemd.service(5): Restart=on-failure restarts on a non-zero status or an unclean signal,
    never a status listed in RestartPreventExitStatus=, and not past the start limit."""
    from petctl.local.shims.systemctl import restart_delay, restart_verdict

    spec = shims.parse_unit(AGENT_UNIT)
    assert restart_verdict(spec, rc, starts, 500.0) == verdict
    assert restart_delay(spec) == 10.0
    plain = shims.parse_unit("[Service]\nExecStart=/bin/true\n")  # Restart= defaults to no
    assert restart_verdict(plain, 1, [], 0.0) == "Restart=no" and restart_delay(plain) == 0.1
    cleared = shims.parse_unit(AGENT_UNIT + "RestartPreventExitStatus=\n")  # an empty value resets the list
    assert restart_verdict(cleared, 78, [], 0.0) is None
    always = shims.parse_unit(AGENT_UNIT.replace("Restart=on-failure", "Restart=always"))  # etcd's unit
    assert restart_verdict(always, 0, [], 0.0) is None and restart_verdict(always, -15, [], 0.0) is None
    assert restart_verdict(always, 78, [], 0.0) == "status 78 is in RestartPreventExitStatus="


def test_on_failure_starts_when_the_unit_ends_failed() -> None:
    """systemd.unit(5): OnFailure= units start when the unit enters "failed" (a non-zero status,
    an unclean signal, the start limit hit), with systemd.exec(5)'s MONITOR_* variables; a clean
    end starts nothing."""
    from petctl.local.shims.systemctl import on_failure

    unit = AGENT_UNIT.replace("[Service]", "OnFailure=petctl-agent-failed.service\n[Service]")
    spec = shims.parse_unit(unit)
    limit = "start limit hit (5 starts within 600s)"
    assert on_failure(spec, "a.service", 1, limit) == (
        ["petctl-agent-failed.service"],
        {
            "MONITOR_UNIT": "a.service",
            "MONITOR_SERVICE_RESULT": "start-limit-hit",
            "MONITOR_EXIT_CODE": "exited",
            "MONITOR_EXIT_STATUS": "1",
        },
    )
    names, env = on_failure(spec, "a.service", -9, limit)
    assert names and env["MONITOR_EXIT_CODE"] == "killed" and env["MONITOR_EXIT_STATUS"] == "KILL"
    names, env = on_failure(spec, "a.service", 78, "status 78 is in RestartPreventExitStatus=")
    assert names and env["MONITOR_SERVICE_RESULT"] == "exit-code" and env["MONITOR_EXIT_STATUS"] == "78"
    assert on_failure(spec, "a.service", 0, "exited cleanly (status 0)") == ([], {})
    assert on_failure(spec, "a.service", -15, "exited cleanly (SIGTERM)") == ([], {})
    assert on_failure(shims.parse_unit(AGENT_UNIT), "a.service", 1, limit) == ([], {})  # none listed
    with pytest.raises(shims.Refused, match="only NAME.service"):
        shims.parse_unit("[Unit]\nOnFailure=rescue.target\n[Service]\nExecStart=/bin/true\n")
    assert shims.parse_unit("[Service]\nType=oneshot\nExecStart=/bin/true\n")


def test_journalctl_prints_a_units_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local journal of a unit: the instance log's stretches after each of its starts."""
    from petctl.local.shims.journal import journalctl

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "i-1.log").write_text(
        "boot line\n"
        "==> petctl local systemd: starting a.service: /x run\n"
        "first\n"
        "==> petctl local systemd: starting b.service: /y\n"
        "other\n"
        "==> petctl local systemd: starting a.service: /x run\n"
        "second\n"
        "ModuleNotFoundError: No module named 'z'\n"
    )
    monkeypatch.setenv("PETCTL_LOCAL_STATE", str(tmp_path))
    monkeypatch.setenv("PETCTL_LOCAL_INSTANCE_ID", "i-1")
    journalctl(["-u", "a.service", "-n", "2", "-o", "cat", "--no-pager"])
    assert capsys.readouterr().out == "second\nModuleNotFoundError: No module named 'z'\n"
    journalctl(["-u", "a.service"])
    assert capsys.readouterr().out == "first\nsecond\nModuleNotFoundError: No module named 'z'\n"
    journalctl(["-u", "c.service"])
    assert capsys.readouterr().out == "-- No entries --\n"
    with pytest.raises(shims.Refused):
        journalctl(["-f"])


def test_rewrite_maps_instance_paths_and_loopback_only() -> None:
    root = Path("/s/instances/i-1/root")
    script = (
        "#!/bin/bash\n"
        "exec > >(tee -a /var/log/petctl-boot.log) 2>&1\n"
        'echo "fs-1:/ /mnt/efs efs _netdev 0 0" >> /etc/fstab\n'
        "ExecStart=/opt/petctl/bin/petctl-agent run\n"
        "X=$(/opt/etcd/bin/python -c 'print(1)') Y='/var/lib/etcd' Z=\"/srv\"\n"
        "curl http://169.254.169.254/latest/ > /dev/null\n"
        "aws s3 cp s3://bucket/var/x /tmp/x; cat /usr/share/x /proc/1/stat\n"
        "--listen-peer-urls http://127.0.0.1:2380 --other 127.0.0.10 /optional /etcetera\n"
        'printf subjectAltName=IP:$ENI_IP,IP:127.0.0.1 > "$TLS/server.ext"; TLS=/etc/petctl/tls\n'
    )
    out = boot.rewrite(script, root, loopback="127.0.5.6")
    assert out.splitlines() == [
        "#!/bin/bash",
        "exec > >(tee -a /s/instances/i-1/root/var/log/petctl-boot.log) 2>&1",
        'echo "fs-1:/ /s/instances/i-1/root/mnt/efs efs _netdev 0 0" >> /s/instances/i-1/root/etc/fstab',
        "ExecStart=/s/instances/i-1/root/opt/petctl/bin/petctl-agent run",
        "X=$(/s/instances/i-1/root/opt/etcd/bin/python -c 'print(1)') Y='/s/instances/i-1/root/var/lib/etcd'"
        ' Z="/s/instances/i-1/root/srv"',
        "curl http://169.254.169.254/latest/ > /dev/null",
        "aws s3 cp s3://bucket/var/x /tmp/x; cat /usr/share/x /proc/1/stat",
        "--listen-peer-urls http://127.0.5.6:2380 --other 127.0.0.10 /optional /etcetera",
        # etcd's certificate names the address its loopback URL really has; its files stay in the root
        'printf subjectAltName=IP:$ENI_IP,IP:127.0.5.6 > "$TLS/server.ext"; TLS=/s/instances/i-1/root/etc/petctl/tls',
    ]
    with pytest.raises(boot.BootError, match="quoting"):
        boot.rewrite(script, Path("/tmp/my dir/root"))


@pytest.mark.parametrize(
    "user_data, error",
    [("", "no user data"), ("#cloud-config\nruncmd: []\n", "not a bash script"), ("#!/bin/bash\n", "only")],
)
def test_only_bash_user_data_boots(user_data: str, error: str) -> None:
    with pytest.raises(boot.BootError, match=error):
        boot.check_script(user_data)


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl not installed")
def test_openssl_runs_for_real_in_an_instance(tmp_path: Path) -> None:
    """The rendezvous boot signs etcd's certificate with the host's openssl (as on Amazon Linux)."""
    _, bin_dir, _ = boot.prepare(tmp_path / "i-1", "#!/bin/bash\ntrue\n")
    assert (bin_dir / "openssl").resolve() == Path(shutil.which("openssl")).resolve()
    res = subprocess.run(["openssl", "version"], env={"PATH": str(bin_dir)}, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("OpenSSL")
