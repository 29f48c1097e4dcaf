"""plan(request, profile, code) is pure: the same inputs give the same plan, and no AWS is reached
(no endpoint, no credentials are set here; a call would fail)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from petctl import jobs
from petctl.config import Profile

PROFILE = Profile(
    name="team",
    region="us-east-1",
    vpc_id="vpc-0123456789abcdef0",
    subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
    security_group_id="sg-0123456789abcdef0",
    efs_id="fs-0123456789abcdef0",
    bucket="team-bucket",
    bucket_kms_key_arn="arn:aws:kms:us-east-1:123456789012:key/abc",
)


@pytest.fixture(autouse=True)
def no_aws(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: a call would fail
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def make_plan(tmp_path, profile=PROFILE, **kw):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    req = jobs.validate_request(jobs.JobRequest(target=str(script), min_nodes=2, max_nodes=4, **kw))
    code = jobs.prepare_code(req)
    return jobs.plan(req, profile, code, user="alice (admin)", region="us-east-1")


def test_plan_of_a_script(tmp_path):
    p = make_plan(tmp_path, name="demo", args=["--epochs", "3"])
    d = p.to_dict()
    assert d["job"] == "demo" and d["stack"] == "petctl-job-demo"
    par = d["parameters"]
    assert (par["MinSize"], par["MaxSize"], par["DesiredCapacity"]) == ("2", "4", "2")
    assert par["User"] == "alice -admin-" and par["BucketKmsKeyArn"] == PROFILE.bucket_kms_key_arn
    assert "WarmPoolSize" not in par and d["warm_pool"] == 0
    assert [u["s3_url"] for u in d["uploads"]] == [
        "s3://team-bucket/petctl/jobs/demo/code/train.py",
        "s3://team-bucket/petctl/jobs/demo/job.json",
        "s3://team-bucket/petctl/jobs/demo/template.yaml",  # the stack is created from it (TemplateURL)
    ]
    assert p.uploads[-1].data == p.template.encode() and p.template_key == "petctl/jobs/demo/template.yaml"
    spec = json.loads(p.uploads[-2].data)
    assert spec == d["spec"] and spec["args"] == ["--epochs", "3"] and spec["code_kind"] == "script"
    assert p.kms_key == PROFILE.bucket_kms_key_arn  # the job roles get this key: uploads use it
    assert make_plan(tmp_path, name="demo", args=["--epochs", "3"]).to_dict() == d


def test_a_directory_is_tarred_before_the_plan(tmp_path):
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "main.py").write_text("print(1)\n")
    (project / ".git").mkdir()
    (project / ".git" / "HEAD").write_text("ref\n")
    req = jobs.validate_request(
        jobs.JobRequest(target=str(project), args=["pkg/main.py", "--lr", "0.1"], name="dirjob")
    )
    code = jobs.prepare_code(req)
    assert (code.kind, code.script, code.args) == ("dir", "pkg/main.py", ["--lr", "0.1"])
    assert tarfile.open(fileobj=io.BytesIO(code.data)).getnames() == ["pkg/main.py"]
    p = jobs.plan(req, PROFILE, code, user="bob", region="us-east-1")
    assert p.spec.code_url == "s3://team-bucket/petctl/jobs/dirjob/code/code.tar.gz"
    assert p.summary()["uploads"][0]["from"] == f"tar of {project}"


def test_configured_instance_profiles_mean_no_job_roles_and_no_kms_upload(tmp_path):
    given = Profile(
        **{
            **PROFILE.to_dict(),
            "worker_instance_profile_arn": "arn:aws:iam::123456789012:instance-profile/w",
            "rdzv_instance_profile_arn": "arn:aws:iam::123456789012:instance-profile/r",
        }
    )
    p = make_plan(tmp_path, given, name="given")
    assert p.kms_key is None and "LogGroupName" not in p.parameter_values


def test_a_warm_pool_is_planned_as_its_size(tmp_path):
    p = make_plan(tmp_path, name="warm", warm_pool=3)
    d = p.to_dict()
    assert d["parameters"]["WarmPoolSize"] == "3" and d["warm_pool"] == 3
    assert "AWS::AutoScaling::WarmPool" in d["template"]
    from petctl import render

    assert "warm pool:    3 stopped instance(s)" in render.plan_text(d)
    assert "warm pool:    none" in render.plan_text(make_plan(tmp_path, name="cold").to_dict())
