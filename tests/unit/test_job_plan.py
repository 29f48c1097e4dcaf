"""plan(request, profile, code) is pure: the same inputs give the same plan, and no AWS is reached
(no endpoint, no credentials are set here; a call would fail)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from petctl import jobs, render
from petctl.config import Profile
from petctl.errors import ConfigError
from petctl.instance_types import InstanceTypeInfo

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


X86 = ("x86_64",)
# What DescribeInstanceTypes says (the fields petctl reads), as lookups.instance_facts hands it in.
FACTS = {
    f.name: f
    for f in (
        InstanceTypeInfo("c6i.large", X86, 2, 4096),
        InstanceTypeInfo("t3.small", ("x86_64",), 2, 2048),
        InstanceTypeInfo("m7g.large", ("arm64",), 2, 8192),
        InstanceTypeInfo("inf2.xlarge", X86, 4, 16384, neuron=True),
        InstanceTypeInfo("g5.xlarge", X86, 4, 16384, 1, 1, "NVIDIA", "A10G"),
        # a fractional L4: Count 0, LogicalGpuCount 1 (what EC2 and moto answer)
        InstanceTypeInfo("gr6f.4xlarge", X86, 16, 131072, 0, 1, "NVIDIA", "L4"),
        InstanceTypeInfo("p3.2xlarge", X86, 8, 62464, 1, 1, "NVIDIA", "V100"),
        InstanceTypeInfo("g4ad.xlarge", X86, 4, 16384, 1, 1, "AMD", "Radeon Pro V520"),
        InstanceTypeInfo("t4g.small", ("arm64",), 2, 2048),
        InstanceTypeInfo("mac2.metal", ("arm64_mac",), 12, 16384),
    )
}


def make_plan(tmp_path, profile=PROFILE, facts=FACTS, **kw):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    req = jobs.validate_request(jobs.JobRequest(target=str(script), min_nodes=2, max_nodes=4, **kw))
    code = jobs.prepare_code(req)
    return jobs.plan(req, profile, code, facts, user="alice (admin)", region="us-east-1")


def test_gpu_or_cpu_comes_from_the_facts_not_the_name(tmp_path):
    gpu = make_plan(tmp_path, name="gpu", instance_type="gr6f.4xlarge")
    assert gpu.gpu and gpu.to_dict()["gpu"] is True
    assert "Deep Learning Base OSS Nvidia Driver AMI" in render.plan_text(gpu.to_dict())
    assert "CUDA torch" in render.plan_text(gpu.to_dict())
    cpu = make_plan(tmp_path, name="cpu")
    assert not cpu.gpu and "CPU torch" in render.plan_text(cpu.to_dict())
    assert gpu.template != cpu.template  # the GPU variant: the Deep Learning AMI's parameter
    # The same name, described by EC2 as a CPU type, plans as CPU: nothing reads the name.
    as_cpu = {**FACTS, "gr6f.4xlarge": InstanceTypeInfo("gr6f.4xlarge", X86, 16, 131072)}
    assert not make_plan(tmp_path, facts=as_cpu, name="gpu", instance_type="gr6f.4xlarge").gpu


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"instance_type": "c6i.large,g5.xlarge"}, "mixes GPU (g5.xlarge) and CPU types"),
        ({"instance_type": "p3.2xlarge"}, "the Deep Learning AMI does not support p3"),
        ({"instance_type": "m7g.large"}, "--instance-type m7g.large: arm64 (Graviton) types need an image"),
        ({"instance_type": "inf2.xlarge"}, "Inferentia/Trainium types need an image"),
        ({"instance_type": "g4ad.xlarge"}, "AMD GPU types need an image"),
        (
            {"rdzv_instance_type": "mac2.metal"},
            "--rdzv-instance-type mac2.metal is arm64_mac: the rendezvous",
        ),
        ({"instance_type": "m7g.large,g5.xlarge", "ami": "ami-0123456789abcdef0"}, "mixes GPU"),
    ],
)
def test_instance_types_the_image_cannot_run_are_refused(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=None) as e:
        make_plan(tmp_path, name="bad", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_arm64_rendezvous_type_gets_the_arm64_image(tmp_path):
    """Graviton rendezvous types are allowed: the AL2023 arm64 image's SSM parameter;
    the boot picks the arm64 etcd tarball from the instance's own architecture."""
    arm = make_plan(tmp_path, name="arm", rdzv_instance_type="t4g.small")
    params = {p["ParameterKey"]: p["ParameterValue"] for p in arm.parameters}
    assert params["RdzvInstanceType"] == "t4g.small"
    assert params["RdzvImageId"] == "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-arm64"
    x86 = make_plan(tmp_path, name="x86")
    assert "RdzvImageId" not in {p["ParameterKey"] for p in x86.parameters}  # the template's default:
    default = jobs_template_default(x86.template, "RdzvImageId")
    assert default == "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"


def jobs_template_default(template: str, name: str) -> str:
    from petctl.templates import load_template

    return load_template(template)["Parameters"][name]["Default"]


def test_enable_v2_follows_the_backend(tmp_path):
    def exec_start(plan) -> str:
        return next(x for x in plan.template.splitlines() if "ExecStart=$ETCD_BIN" in x)

    from petctl.templates.etcd import ETCD_V2_BACKENDS
    from petctl_agent.spec import RDZV_BACKENDS

    assert {"etcd-v2", "etcd"} <= set(ETCD_V2_BACKENDS)  # torch's fallbacks speak v2 (python-etcd)
    for backend in RDZV_BACKENDS:
        start = exec_start(make_plan(tmp_path, name="v2", rdzv_backend=backend))
        assert (" --enable-v2 " in start) == (backend in ETCD_V2_BACKENDS), backend


ETCD_SHA = "ab" * 32


def test_a_jobs_own_etcd_copy_goes_into_the_stack(tmp_path):
    for url in (
        "s3://team-bucket/petctl/uploads/etcd-v3.5.33-linux-amd64.tar.gz",
        "https://mirror.corp/etcd.tgz",
    ):
        p = make_plan(tmp_path, name="mirror", rdzv_etcd_url=url, rdzv_etcd_sha256=ETCD_SHA.upper())
        params = {x["ParameterKey"]: x["ParameterValue"] for x in p.parameters}
        assert (params["EtcdUrl"], params["EtcdSha256"]) == (url, ETCD_SHA)
        assert f"t3.small: your copy {url} (SHA-256 abababababab...)" in render.plan_text(p.to_dict())
    plain = make_plan(tmp_path, name="plain")
    assert not {"EtcdUrl", "EtcdSha256"} & {x["ParameterKey"] for x in plain.parameters}
    assert "t3.small: the official 3.5.33 release, SHA-256 pinned" in render.plan_text(plain.to_dict())


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"rdzv_etcd_url": "https://m/e.tgz"}, "--rdzv-etcd-url and --rdzv-etcd-sha256 go together"),
        ({"rdzv_etcd_sha256": ETCD_SHA}, "--rdzv-etcd-url and --rdzv-etcd-sha256 go together"),
        (
            {"rdzv_etcd_url": "http://m/e.tgz", "rdzv_etcd_sha256": ETCD_SHA},
            "is not an s3://BUCKET/KEY or https://",
        ),
        ({"rdzv_etcd_url": "https://m/a b.tgz", "rdzv_etcd_sha256": ETCD_SHA}, "is not an s3://BUCKET/KEY"),
        (
            {"rdzv_etcd_url": "https://m/e.tgz", "rdzv_etcd_sha256": "abc"},
            "--rdzv-etcd-sha256 'abc' is not a SHA-256",
        ),
        ({"rdzv_etcd_url": "s3://team-bucket/petctl/uploads/", "rdzv_etcd_sha256": ETCD_SHA}, "is a prefix"),
        (
            {"rdzv_etcd_url": "s3://other-bucket/etcd.tgz", "rdzv_etcd_sha256": ETCD_SHA},
            "is outside s3://team-bucket/petctl/uploads/, the only place the job's rendezvous role may read",
        ),
    ],
)
def test_a_bad_etcd_copy_is_refused_in_one_line(tmp_path, kw, message):
    with pytest.raises(ConfigError) as e:
        make_plan(tmp_path, name="bad", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_with_ami_any_architecture_and_gpu_is_planned(tmp_path):
    ami = "ami-0123456789abcdef0"
    assert not make_plan(tmp_path, name="arm", instance_type="m7g.large", ami=ami).gpu
    assert make_plan(tmp_path, name="old", instance_type="p3.2xlarge", ami=ami).gpu


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
    p = jobs.plan(req, PROFILE, code, FACTS, user="bob", region="us-east-1")
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
    assert "warm pool:    3 stopped instance(s)" in render.plan_text(d)
    assert "warm pool:    none" in render.plan_text(make_plan(tmp_path, name="cold").to_dict())


def test_live_runs_the_lighthouse_beside_etcd_for_the_job_s_workers_only(tmp_path):
    from petctl.templates import load_template
    from petctl_agent.spec import LIGHTHOUSE_PORT, TORCHFT_VERSION

    live = make_plan(tmp_path, name="live", live=True)
    plain = make_plan(tmp_path, name="plain")
    assert live.spec.live and not plain.spec.live
    assert live.spec.lighthouse_port == LIGHTHOUSE_PORT
    t, p = load_template(live.template), load_template(plain.template)
    # the lighthouse's port opens to this job's workers only (it has no authentication)
    ingress = t["Resources"]["RdzvSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    lh = [r for r in ingress if r["FromPort"] == LIGHTHOUSE_PORT]
    assert len(lh) == 1 and lh[0]["ToPort"] == LIGHTHOUSE_PORT and "CidrIp" not in lh[0]
    assert lh[0]["SourceSecurityGroupId"] == {"Fn::GetAtt": ["WorkerSecurityGroup", "GroupId"]}
    plain_ports = [
        r["FromPort"] for r in p["Resources"]["RdzvSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    ]
    assert plain_ports == [2379]
    # its boot: torchft and petctl without their dependencies (no torch), a unit bound to the ENI
    assert f'"torchft=={TORCHFT_VERSION}"' in live.template and "--no-deps" in live.template
    start = next(x for x in live.template.splitlines() if "petctl_agent.live.lighthouse" in x)
    assert (
        f'--unit --bind "$ENI_IP:{LIGHTHOUSE_PORT}" > /etc/systemd/system/petctl-lighthouse.service' in start
    )
    assert "petctl_agent.live.lighthouse" not in plain.template
    # the rendezvous role reads the job's wheel only when it runs the lighthouse
    assert "ReadPetctlWheel" in live.template and "ReadPetctlWheel" not in plain.template
    # live jobs get their own names: a --live run never finds a restart-path twin
    assert jobs.default_job_name(jobs.JobRequest(target="x.py", live=True)) != jobs.default_job_name(
        jobs.JobRequest(target="x.py")
    )


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            {"instance_type": "m7g.large", "ami": "ami-0123456789abcdef0"},
            "--live: --instance-type m7g.large is arm64",
        ),
        ({"rdzv_instance_type": "t4g.small"}, "--live: --rdzv-instance-type t4g.small is arm64"),
        ({"rdzv_backend": "etcd-v2"}, "--live goes with the default rendezvous (petctl-etcd)"),
    ],
)
def test_live_refuses_what_torchft_cannot_run(tmp_path, kw, message):
    with pytest.raises(ConfigError) as e:
        make_plan(tmp_path, name="live", live=True, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_rendezvous_server_is_sized_by_max(tmp_path):
    # etcd spends ~0.5 ms of CPU per keepalive, one per node a second: past a t3.small's 0.4 vCPU
    # baseline (200 nodes leave room), a non-burstable type with room for twice the load
    from petctl.jobs.request import default_rdzv_instance_type

    assert [default_rdzv_instance_type(n) for n in (1, 200, 201, 2000, 2001, 4000, 4001, 10_000)] == [
        "t3.small", "t3.small", "c6i.large", "c6i.large", "c6i.xlarge", "c6i.xlarge", "c6i.2xlarge", "c6i.2xlarge",
    ]  # fmt: skip
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")

    def planned(**kw) -> str:
        req = jobs.validate_request(jobs.JobRequest(target=str(script), min_nodes=2, **kw))
        plan = jobs.plan(req, PROFILE, jobs.prepare_code(req), FACTS, user="alice", region="us-east-1")
        return {p["ParameterKey"]: p["ParameterValue"] for p in plan.parameters}["RdzvInstanceType"]

    assert planned(max_nodes=4) == "t3.small"
    assert planned(max_nodes=500) == "c6i.large"
    assert planned(max_nodes=500, rdzv_instance_type="t3.small") == "t3.small"  # given: kept
    # a job named before the sizing keeps its name (the default resolves to what it was)
    given = jobs.validate_request(
        jobs.JobRequest(target=str(script), max_nodes=4, rdzv_instance_type="t3.small")
    )
    default = jobs.validate_request(jobs.JobRequest(target=str(script), max_nodes=4))
    assert jobs.default_job_name(given) == jobs.default_job_name(default)
