"""`kill-job --delete-checkpoints`' one-shot instance: the real job template's cleanup user data,
run as the local cloud boots an instance (its shims: dnf, mount with the file system policy and
the instance role, aws s3), deletes its own job's directory and nothing of another job's."""

from __future__ import annotations

import base64
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from petctl.local import boot
from tests.local.test_efs_isolation import KEY, aws, jobs, mount  # noqa: F401 - fixtures

__all__ = ["aws", "jobs"]


@pytest.fixture
def imds() -> Iterator[str]:
    """IMDSv2 for one instance: a token, then meta-data/instance-id (all the script reads)."""
    ids: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:  # noqa: N802 - http.server's name
            self._answer(b"token")

        def do_GET(self) -> None:  # noqa: N802
            iid = self.path.strip("/").split("/")[0]
            ok = self.headers.get("X-aws-ec2-metadata-token") == "token" and self.path.endswith("instance-id")
            self._answer(iid.encode() if ok else b"", 200 if ok else 401)

        def _answer(self, body: bytes, code: int = 200) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    del ids


def _run_cleanup(
    tmp_path: Path, aws: tuple[str, Any], jobs: dict, job: str, imds: str
) -> subprocess.CompletedProcess:
    url, client = aws
    ec2 = client("ec2")
    (lt,) = ec2.describe_launch_templates(LaunchTemplateNames=[f"petctl-{job}-cleanup"])["LaunchTemplates"]
    (instance,) = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": lt["LaunchTemplateId"]},
        MinCount=1,
        MaxCount=1,
        SubnetId=jobs["base"]["SubnetIds"],
    )["Instances"]
    iid = instance["InstanceId"]
    (version,) = ec2.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"])[
        "LaunchTemplateVersions"
    ]
    script = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
    boot.check_script(script)
    root, bin_dir, path = boot.prepare(tmp_path / "cleanup" / iid, script)
    env = boot.boot_env(
        {},
        root,
        bin_dir,
        {
            "PETCTL_LOCAL_ROOT": str(root),
            "PETCTL_LOCAL_STATE": str(tmp_path / "state"),
            "PETCTL_LOCAL_IMDS": f"{imds}/{iid}",
            "PETCTL_LOCAL_INSTANCE_ID": iid,
            "PETCTL_LOCAL_AZ": instance["Placement"]["AvailabilityZone"],
            "AWS_ENDPOINT_URL": url,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": KEY,
            "AWS_EC2_METADATA_DISABLED": "true",
        },
    )
    res = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=120)
    res.instance_id = iid  # type: ignore[attr-defined]
    return res


def _report(aws: tuple[str, Any], jobs: dict, job: str, iid: str) -> dict:
    _, client = aws
    body = client("s3").get_object(
        Bucket=jobs["base"]["BucketName"], Key=f"petctl/jobs/{job}/boot/cleanup/{iid}.json"
    )["Body"]
    return json.loads(body.read())


def test_the_cleanup_deletes_its_own_jobs_directory_and_no_other(tmp_path: Path, aws, jobs, imds) -> None:
    efs = tmp_path / "state" / "efs" / jobs["base"]["EfsId"] / "petctl" / "jobs"
    for job in ("job-a", "job-b"):  # each job's worker writes its checkpoints, as training does
        res = mount(tmp_path, aws, jobs, job, f"tls,iam,accesspoint={jobs[job]['ap']},noresvport")
        assert res.returncode == 0, res.stderr
        (efs / job / "checkpoints" / "step-10").mkdir(parents=True)
        (efs / job / "checkpoints" / "step-10" / "rank0.pt").write_text(job)
        (efs / job / ".petctl-job-succeeded").write_text("run")
        (efs / job / "work").mkdir()
    res = _run_cleanup(tmp_path, aws, jobs, "job-a", imds)
    assert res.returncode == 0, res.stdout + res.stderr
    report = _report(aws, jobs, "job-a", res.instance_id)
    assert report["state"] == "deleted" and report["entries"] == 3, report
    assert list((efs / "job-a").iterdir()) == []  # the access point's root stays, empty
    # job-b's files are untouched
    assert (efs / "job-b" / "checkpoints" / "step-10" / "rank0.pt").read_text() == "job-b"
    assert (efs / "job-b" / ".petctl-job-succeeded").exists() and (efs / "job-b" / "work").is_dir()
