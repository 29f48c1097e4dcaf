"""setup copies etcd's pinned release into the bucket, and run-job points the rendezvous boot at
that copy: no boot depends on GitHub. A download that does not match its pin is never copied.

The release files come from a server on 127.0.0.1 (``PETCTL_ETCD_RELEASE_BASE``, the conftest's
``Releases``); the pins are the test's own tarballs' SHA-256, so the copy path runs for real.
"""

from __future__ import annotations

import hashlib
import json

import boto3
from conftest import Releases

from petctl.infra import etcd_copy
from petctl.templates import etcd


def _serve(tarballs: dict[str, bytes]) -> None:
    Releases.files = {
        f"/v{etcd.ETCD_VERSION}/etcd-v{etcd.ETCD_VERSION}-linux-{arch}.tar.gz": data
        for arch, data in tarballs.items()
    }


def _plan(run, script) -> dict:
    r = run("--output", "json", "run_job", "--dry-run", "--min", "1", "--max", "2", str(script))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_setup_copies_the_pinned_release_and_jobs_boot_from_it(run, monkeypatch, tmp_path):
    tarballs = {"amd64": b"etcd for x86_64", "arm64": b"etcd for arm64"}
    monkeypatch.setattr(etcd, "ETCD_SHA256", {a: hashlib.sha256(d).hexdigest() for a, d in tarballs.items()})
    _serve(tarballs)
    r = run("setup")
    assert r.exit_code == 0, r.output
    assert "not copied" not in r.output
    bucket = json.loads((tmp_path / "home" / "profiles" / "default.json").read_text())["bucket"]
    s3 = boto3.client("s3")
    for arch, data in tarballs.items():
        obj = s3.get_object(Bucket=bucket, Key=etcd_copy.key(arch))
        assert obj["Body"].read() == data
        assert obj.get("ServerSideEncryption")  # encrypted like every upload

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    par = _plan(run, script)["parameters"]
    assert par["EtcdUrl"] == f"s3://{bucket}/{etcd_copy.key('amd64')}"
    assert par["EtcdSha256"] == etcd.ETCD_SHA256["amd64"]
    graviton = run(
        "--output",
        "json",
        "run_job",
        "--dry-run",
        "--min",
        "1",
        "--max",
        "2",
        "--rdzv-instance-type",
        "t4g.small",
        str(script),
    )
    assert json.loads(graviton.stdout)["parameters"]["EtcdUrl"].endswith(etcd_copy.key("arm64"))
    text = run("run_job", "--dry-run", "--min", "1", "--max", "2", str(script)).stdout
    assert f"the {etcd.ETCD_VERSION} release from s3://{bucket}/petctl/uploads/etcd/" in text

    # a job's own copy wins over the bucket's
    own = f"s3://{bucket}/petctl/uploads/mine.tar.gz"
    r = run(
        "--output",
        "json",
        "run_job",
        "--dry-run",
        "--min",
        "1",
        "--max",
        "2",
        "--rdzv-etcd-url",
        own,
        "--rdzv-etcd-sha256",
        "ab" * 32,
        str(script),
    )
    assert json.loads(r.stdout)["parameters"]["EtcdUrl"] == own


def test_a_release_that_does_not_match_its_pin_is_never_copied(run, tmp_path):
    _serve({"amd64": b"tampered", "arm64": b"tampered too"})  # the real pins: these cannot match
    r = run("setup")
    assert r.exit_code == 0, r.output  # the boot can still download and check it itself
    assert "not the pinned" in r.output and "download it from GitHub at boot" in r.output
    bucket = json.loads((tmp_path / "home" / "profiles" / "default.json").read_text())["bucket"]
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=etcd_copy.PREFIX)
    assert listed.get("KeyCount", 0) == 0
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert "EtcdUrl" not in _plan(run, script)["parameters"]  # GitHub's, with the pin


def test_setup_without_a_reachable_release_warns_and_goes_on(run):
    r = run("setup")  # the release server has no files: a 404, as a mirror without them
    assert r.exit_code == 0, r.output
    assert r.output.count("was not copied into") == 2  # one line per architecture
