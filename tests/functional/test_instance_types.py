"""GPU or CPU, and whether the image can run a type, come from EC2's DescribeInstanceTypes (the
moto server, with the local cloud's patches), looked up before the plan and cached on disk."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import boto3
import pytest


@pytest.fixture
def describe_calls(monkeypatch):
    """Every DescribeInstanceTypes request the CLI sends over HTTP (a botocore event on each
    client it makes), counted: the gateway and the cache run for real."""
    calls: list[str] = []
    make_client = boto3.session.Session.client

    def client(self, *args, **kwargs):
        c = make_client(self, *args, **kwargs)
        c.meta.events.register(
            "before-send.ec2.DescribeInstanceTypes", lambda request, **_: calls.append(str(request.body))
        )
        return c

    monkeypatch.setattr(boto3.session.Session, "client", client)
    return calls


def dry_run(run, script, *flags):
    return run("--output", "json", "run_job", "--dry-run", "--min", "1", "--max", "2", *flags, str(script))


def cache_files() -> list[Path]:
    return sorted((Path(os.environ["PETCTL_HOME"]) / "cache").glob("instance-types-us-east-1-*.json"))


def test_gr6f_is_a_gpu_type(run, ready):
    r = dry_run(run, ready, "--instance-type", "gr6f.4xlarge")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["gpu"] is True
    r = run("run_job", "--dry-run", "--min", "1", "--max", "2", "--instance-type", "gr6f.4xlarge", str(ready))
    assert "Deep Learning Base OSS Nvidia Driver AMI" in r.stdout and "CUDA torch" in r.stdout
    assert json.loads(dry_run(run, ready, "--instance-type", "c6i.large").stdout)["gpu"] is False


def test_unknown_types_are_refused_in_one_line_and_nothing_is_made(run, ready):
    stacks = boto3.client("cloudformation").list_stacks()["StackSummaries"]
    for flags, named in [
        (
            ["--instance-type", "c6i.large,g5.huge"],
            "--instance-type g5.huge: no such instance type in us-east-1",
        ),
        (
            ["--instance-type", "zz9.large,c6i.large,yy1.small"],
            "--instance-type zz9.large, --instance-type yy1.small",
        ),
        (["--rdzv-instance-type", "t3.tiny"], "--rdzv-instance-type t3.tiny: no such instance type"),
    ]:
        r = run("run_job", "--min", "1", "--max", "2", *flags, str(ready))
        assert r.exit_code == 2 and named in r.stderr, r.output
        assert "aws ec2 describe-instance-types" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert boto3.client("cloudformation").list_stacks()["StackSummaries"] == stacks


def test_types_the_image_cannot_run_are_refused_from_ec2s_facts(run, ready):
    for itype, message in [
        ("c7g.large", "arm64 (Graviton)"),
        ("a1.large", "arm64 (Graviton)"),
        ("inf2.xlarge", "Inferentia/Trainium"),
        ("trn1.2xlarge", "Inferentia/Trainium"),
        ("g4ad.xlarge", "AMD GPU"),  # not in moto's table: the local cloud's patch adds it
        ("p3.2xlarge", "the Deep Learning AMI does not support p3"),  # the same
        ("c5.xlarge,g5.xlarge", "mixes GPU (g5.xlarge) and CPU types"),
        ("c5.xlarge,gr6f.4xlarge", "mixes GPU (gr6f.4xlarge) and CPU types"),
    ]:
        r = run("run_job", "--min", "1", "--max", "1", "--instance-type", itype, str(ready))
        assert r.exit_code == 2 and message in r.stderr and "--instance-type" in r.stderr, (itype, r.output)
        assert len(r.stderr.strip().splitlines()) == 1
    # A Graviton rendezvous server is fine: EC2 says t4g.small is arm64, so the plan
    # gives it the arm64 Amazon Linux 2023 image (the boot picks the arm64 etcd tarball).
    r = dry_run(run, ready, "--rdzv-instance-type", "t4g.small")
    assert r.exit_code == 0, r.output
    params = json.loads(r.output)["parameters"]
    assert params["RdzvInstanceType"] == "t4g.small"
    assert params["RdzvImageId"] == "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-arm64"
    r = dry_run(run, ready, "--instance-type", "c7g.large", "--ami", "ami-0123456789abcdef0")
    assert "Graviton" not in r.output  # --ami: the user picked the image (the AMI lookup decides)


def test_the_answer_is_cached_per_region_and_a_damaged_cache_is_ignored(run, ready, describe_calls):
    flags = ("--instance-type", "g5.xlarge,gr6f.4xlarge")
    assert dry_run(run, ready, *flags).exit_code == 0
    assert len(describe_calls) == 1  # the two worker types and the rendezvous type, one request
    assert dry_run(run, ready, *flags).exit_code == 0
    assert len(describe_calls) == 1  # the second run read the cache
    (cache,) = cache_files()
    assert set(json.loads(cache.read_text())["types"]) == {"g5.xlarge", "gr6f.4xlarge", "t3.small"}
    # a type not cached yet: only it is asked for
    assert dry_run(run, ready, "--instance-type", "g5.xlarge,g6.xlarge").exit_code == 0
    assert len(describe_calls) == 2 and "g6.xlarge" in describe_calls[-1] and "g5" not in describe_calls[-1]
    for damage in ("{not json", '{"types": {"g5.xlarge": {"facts": 3}}}', '{"types": []}', ""):
        cache.write_text(damage)
        r = dry_run(run, ready, *flags)
        assert r.exit_code == 0 and json.loads(r.stdout)["gpu"] is True, (damage, r.output)
    assert len(describe_calls) == 6
    # an entry past its week is asked for again
    data = json.loads(cache.read_text())
    data["types"]["g5.xlarge"]["fetched_at"] = time.time() - 8 * 86400
    cache.write_text(json.dumps(data))
    assert dry_run(run, ready, *flags).exit_code == 0
    assert len(describe_calls) == 7 and "g5.xlarge" in describe_calls[-1]
    assert "gr6f" not in describe_calls[-1]


def test_a_cache_that_cannot_be_written_does_not_fail_the_run(run, ready, describe_calls):
    home = Path(os.environ["PETCTL_HOME"])
    (home / "cache").write_text("a file where the cache directory goes")
    assert dry_run(run, ready, "--instance-type", "g5.xlarge").exit_code == 0
    assert dry_run(run, ready, "--instance-type", "g5.xlarge").exit_code == 0
    assert len(describe_calls) == 2


def test_a_jobs_own_etcd_copy_through_the_cli(run, ready):
    """--rdzv-etcd-url/--rdzv-etcd-sha256: into the stack's EtcdUrl/EtcdSha256; a bad pair is
    refused in one line (exit 2) before anything is created."""
    stacks = boto3.client("cloudformation").list_stacks()["StackSummaries"]
    sha = "0123456789abcdef" * 4
    url = "https://mirror.corp.example/etcd-v3.5.33-linux-amd64.tar.gz"
    r = dry_run(run, ready, "--rdzv-etcd-url", url, "--rdzv-etcd-sha256", sha)
    assert r.exit_code == 0, r.output
    params = json.loads(r.output)["parameters"]
    assert (params["EtcdUrl"], params["EtcdSha256"]) == (url, sha)
    for flags, message in [
        (["--rdzv-etcd-url", url], "--rdzv-etcd-url and --rdzv-etcd-sha256 go together"),
        (["--rdzv-etcd-url", "ftp://x/e.tgz", "--rdzv-etcd-sha256", sha], "is not an s3://BUCKET/KEY"),
        (["--rdzv-etcd-url", url, "--rdzv-etcd-sha256", "xyz"], "is not a SHA-256"),
        (["--rdzv-etcd-url", "s3://elsewhere/etcd.tgz", "--rdzv-etcd-sha256", sha], "petctl/uploads/"),
    ]:
        r = run("run_job", "--min", "1", "--max", "1", *flags, str(ready))
        assert r.exit_code == 2 and message in r.stderr, (flags, r.output)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert boto3.client("cloudformation").list_stacks()["StackSummaries"] == stacks
