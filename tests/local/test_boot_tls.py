"""etcd TLS through the real rendezvous boot script on the local cloud: a job stack rendered from
cfn_templates (no workers), its CA made by petctl/tls.py and put where run_job puts it; the
instance signs etcd's certificate with the host's openssl and serves https on its 127.x ENI
address, to this job's client certificate only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from localcloud_helpers import Cloud, wait_for

from petctl import naming, templates, tls
from petctl.local import etcd_release

BUCKET = "petctl-local-test"
RDZV_EVENTS = ["launched", "deps_installed", "eni_attached", "etcd_started"]


def _job_stack(cloud: Cloud, job: str, **extra: str) -> dict[str, Any]:
    """The job stack as run_job creates it, with no workers, after uploading the job's TLS objects;
    ``extra``: more stack parameters."""
    net = cloud.network()
    objects = tls.make_job_tls(job)
    for name, data in objects.items():
        cloud.s3.put_object(Bucket=BUCKET, Key=f"petctl/jobs/{job}/tls/{name}", Body=data)
    spec = {
        "version": 1,
        "job_name": job,
        "min_nodes": 1,
        "max_nodes": 1,
        "code_url": "s3://x/y",
        "script": "y",
    }
    cloud.s3.put_object(Bucket=BUCKET, Key=f"petctl/jobs/{job}/job.json", Body=json.dumps(spec).encode())
    sg = cloud.ec2.create_security_group(GroupName=f"sg-{job}", Description="base", VpcId=net["vpc"])[
        "GroupId"
    ]
    params = templates.job_parameters(
        JobName=job,
        User="tester",
        MinSize=0,
        MaxSize=1,
        DesiredCapacity=0,
        SubnetIds=[net["subnet"]],
        RdzvSubnetId=net["subnet"],
        VpcId=net["vpc"],
        SecurityGroupId=sg,
        LogGroupName="/petctl/test",
        EfsId=net["efs"],
        EfsPosixId=naming.efs_posix_id(job),
        BucketName=BUCKET,
        SpecUrl=f"s3://{BUCKET}/petctl/jobs/{job}/job.json",
        DistUrl=f"s3://{BUCKET}/petctl/jobs/{job}/dist/petctl-0-py3-none-any.whl",
        TorchVersion="2.13.0",
        **extra,
    )
    import boto3

    cfn = boto3.session.Session(
        aws_access_key_id="petctl-local", aws_secret_access_key="petctl-local", region_name="us-east-1"
    ).client("cloudformation", endpoint_url=cloud.url)
    # from a TemplateURL in the bucket, as run-job sends it: a job template is over the 51,200-byte
    # inline cap (the local cloud enforces it, as CloudFormation does)
    key = f"petctl/jobs/{job}/template.yaml"
    cloud.s3.put_object(Bucket=BUCKET, Key=key, Body=templates.render_job().encode())
    cfn.create_stack(
        StackName=f"petctl-job-{job}",
        TemplateURL=f"https://{BUCKET}.s3.us-east-1.amazonaws.com/{key}",
        Parameters=params,
        Capabilities=["CAPABILITY_IAM"],
    )
    return objects


def _get(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, context=context, timeout=5) as resp:
        return resp.read().decode()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _v3(base: str, op: str, body: dict[str, Any], context: ssl.SSLContext) -> dict[str, Any]:
    req = urllib.request.Request(f"{base}/v3/kv/{op}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, context=context, timeout=5) as resp:
        return json.loads(resp.read())


def _v3_get(base: str, key: str, context: ssl.SSLContext) -> str | None:
    kvs = _v3(base, "range", {"key": _b64(key)}, context).get("kvs") or []
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


def test_rdzv_boot_serves_etcd_over_tls_to_the_jobs_clients_only(cloud: Cloud, tmp_path: Path) -> None:
    job = "boot-tls"
    objects = _job_stack(cloud, job)

    def booted() -> Any:
        assert not [r for i in cloud.instances(job) for r in i["refused"]]
        rdzv = cloud.instances(job, "rdzv")
        return rdzv and rdzv[0]["boot"]["state"] in ("done", "failed") and rdzv[0]

    rdzv = wait_for(booted, timeout=120, what="the rendezvous boot", poll=1)
    log = Path(rdzv["log"]).read_text()
    assert rdzv["boot"]["state"] == "done", log[-3000:]
    # the boot's own check, over TLS with its client certificate, on the address workers dial
    assert f"https://{rdzv['bind_ip']}:2379 is healthy" in log
    assert "rejected connection" not in log  # etcd's own gateway accepts its certificate
    assert "check file permission" not in log  # its data dir is 0700
    events = json.loads(
        cloud.s3.get_object(Bucket=BUCKET, Key=f"petctl/jobs/{job}/boot/events/{rdzv['instance_id']}.json")[
            "Body"
        ].read()
    )
    assert [e["kind"] for e in events["events"]] == RDZV_EVENTS

    # The CA key is gone from the instance; what is left is root-only.
    d = Path(rdzv["root"]) / "etc" / "petctl" / "tls"
    assert sorted(p.name for p in d.iterdir()) == [
        "ca.pem",
        "check.key",
        "check.pem",
        "server.key",
        "server.pem",
    ]
    assert d.stat().st_mode & 0o777 == 0o700 and all(p.stat().st_mode & 0o777 == 0o600 for p in d.iterdir())

    # A worker of this job (its CA, its client certificate) reads and writes v3 keys on the ENI
    # (etcd's JSON gateway); the v2 API is off (only torch's v2 fallbacks turn it on).
    for name, data in objects.items():
        (tmp_path / name).write_bytes(data)
    ip = rdzv["bind_ip"]
    worker = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    worker.load_cert_chain(tmp_path / "client.pem", tmp_path / "client.key")
    base = f"https://{ip}:2379"
    _v3(base, "put", {"key": _b64("petctl-tls"), "value": _b64("ok")}, worker)
    assert _v3_get(base, "petctl-tls", worker) == "ok"
    with pytest.raises(urllib.error.HTTPError):
        _get(f"{base}/v2/keys/petctl-tls", worker)

    # The boot wrote its token once etcd answered: <instance id>-<random> (docs/contracts.md).
    token = _v3_get(base, "/petctl/etcd-boot-token", worker)
    assert re.fullmatch(re.escape(rdzv["instance_id"]) + r"-[0-9a-f]{32}", token or ""), token
    assert f"petctl boot: etcd boot token {token}" in log
    # Create-if-absent: the boot's own write, run again with another token (as a second boot on
    # the same data would), leaves the first one.
    script = (Path(rdzv["root"]).parent / "user-data.sh").read_text()
    functions = [
        re.search(rf"^{name}\(\) {{\n.*?^}}$", script, re.M | re.S)
        for name in ("etcdctl", "write_boot_token")
    ]
    tls_dir = re.search(r"^TLS=(\S+)$", script, re.M)
    assert all(functions) and tls_dir
    again = subprocess.run(
        ["bash", "-c", "\n".join([f"TLS={tls_dir.group(1)}", "BOOT_TOKEN=second-boot", *(m.group(0) for m in functions), "write_boot_token"])],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == "FAILURE", again.stdout + again.stderr
    assert _v3_get(base, "/petctl/etcd-boot-token", worker) == token
    # The etcd is the package binary standing in for the pinned release, unpacked by the boot's
    # own checksum-and-unpack step into its /opt/etcd/bin (docs/local.md).
    assert sorted(p.name for p in (Path(rdzv["root"]) / "opt" / "etcd" / "bin").iterdir()) == [
        "etcd",
        "etcdctl",
    ]
    assert "etcd Version: 3.5" in log

    # Plain http, TLS without a client certificate, and another job's certificate are all refused.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _get(f"http://{ip}:2379/health")
    anonymous = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _get(f"{base}/health", anonymous)
    other = tls.make_job_tls("someone-else")
    for name, data in other.items():
        (tmp_path / f"other-{name}").write_bytes(data)
    stranger = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    stranger.load_cert_chain(tmp_path / "other-client.pem", tmp_path / "other-client.key")
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _get(f"{base}/health", stranger)


def test_a_jobs_own_etcd_copy_is_checked_before_it_is_unpacked(cloud: Cloud, tmp_path: Path) -> None:
    """run-job --rdzv-etcd-url s3://...: the boot fetches the copy from S3 (the aws shim, moto) and
    checks the SHA-256 the job gave; no local substitution. A wrong one fails the boot loudly
    (boot_failed, the mismatch as its error) and leaves no etcd to run; the right one boots."""
    tarball, sha256 = etcd_release.local_release(tmp_path)
    url = f"s3://{BUCKET}/petctl/uploads/etcd-copy.tar.gz"
    cloud.network()  # (makes the bucket: this test may be the first on the daemon to need it)
    cloud.s3.put_object(Bucket=BUCKET, Key="petctl/uploads/etcd-copy.tar.gz", Body=tarball.read_bytes())
    wrong = hashlib.sha256(b"not the copy").hexdigest()
    _job_stack(cloud, "copy-bad", EtcdUrl=url, EtcdSha256=wrong)
    _job_stack(cloud, "copy-good", EtcdUrl=url, EtcdSha256=sha256)

    def first_boot(job: str) -> Any:
        rdzv = cloud.instances(job, "rdzv")
        return rdzv and rdzv[0]["boot"]["state"] in ("done", "failed") and rdzv[0]

    good = wait_for(lambda: first_boot("copy-good"), timeout=120, what="the good copy's boot", poll=1)
    log = Path(good["log"]).read_text()
    assert good["boot"]["state"] == "done", log[-3000:]
    assert f"https://{good['bind_ip']}:2379 is healthy" in log

    bad = wait_for(lambda: first_boot("copy-bad"), timeout=120, what="the bad copy's boot", poll=1)
    assert bad["boot"]["state"] == "failed"
    message = f"etcd tarball {url} has SHA-256 {sha256}, not the expected {wrong}: not installed"

    def failed_event() -> Any:
        try:
            body = cloud.s3.get_object(
                Bucket=BUCKET, Key=f"petctl/jobs/copy-bad/boot/events/{bad['instance_id']}.json"
            )["Body"].read()
        except cloud.s3.exceptions.NoSuchKey:
            return None
        events = json.loads(body)["events"]
        return events[-1]["kind"] == "boot_failed" and events

    events = wait_for(failed_event, timeout=60, what="the bad copy's boot_failed event", poll=1)
    assert [e["kind"] for e in events] == ["launched", "boot_failed"]
    assert events[-1]["error"] == f"petctl boot: error: {message}" or message in events[-1]["error"], events
    assert not (Path(bad["root"]) / "opt" / "etcd" / "bin" / "etcd").exists()
