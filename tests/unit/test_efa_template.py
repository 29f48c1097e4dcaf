"""EFA types (p4d, p5, p5e, p5en, p6, ...) train multi-node over EFA (issue #31): the worker launch
template names one EFA interface per network card, the workers share a cluster placement group in
one zone unless run-job --no-placement-group, a type with several cards is refused in subnets that
map public addresses, and the workers' environment selects libfabric's efa provider. Pure: the
facts are what DescribeInstanceTypes answers (moto's data, which has these fields)."""

from __future__ import annotations

import pytest
from cfnlint.api import lint
from cfnlint.config import ManualArgs
from cfnlint.core import get_rules
from cfnlint.decode import cfn_yaml

from petctl import jobs, render, templates
from petctl.config import Profile
from petctl.errors import ConfigError
from petctl.instance_types import InstanceTypeInfo
from petctl.lint_rules import RULES_DIR

PROFILE = Profile(
    name="team",
    region="us-east-1",
    vpc_id="vpc-0123456789abcdef0",
    subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
    security_group_id="sg-0123456789abcdef0",
    efs_id="fs-0123456789abcdef0",
    bucket="team-bucket",
)
SUBNET_A, SUBNET_B = PROFILE.subnet_ids


def _ec2(name: str, cards: int, efa: int | None, gpus: int = 8) -> dict:
    """One DescribeInstanceTypes entry, the fields petctl reads (as moto and EC2 answer them)."""
    net: dict = {"MaximumNetworkCards": cards, "EfaSupported": efa is not None}
    if efa is not None:
        net["EfaInfo"] = {"MaximumEfaInterfaces": efa}
    d = {
        "InstanceType": name,
        "ProcessorInfo": {"SupportedArchitectures": ["x86_64"]},
        "VCpuInfo": {"DefaultVCpus": 192},
        "MemoryInfo": {"SizeInMiB": 2097152},
        "NetworkInfo": net,
    }
    if gpus:
        d["GpuInfo"] = {"Gpus": [{"Name": "H100", "Manufacturer": "NVIDIA", "Count": gpus}]}
    return d


FACTS = {
    f.name: f
    for f in (
        InstanceTypeInfo.from_ec2(_ec2("p5.48xlarge", 32, 32)),
        InstanceTypeInfo.from_ec2(_ec2("p4d.24xlarge", 4, 4)),
        InstanceTypeInfo.from_ec2(_ec2("g5.48xlarge", 1, 1)),
        InstanceTypeInfo.from_ec2(_ec2("g5.xlarge", 1, None, gpus=1)),
        InstanceTypeInfo.from_ec2(_ec2("c6i.large", 1, None, gpus=0)),
        InstanceTypeInfo.from_ec2(_ec2("t3.small", 1, None, gpus=0)),
    )
}


@pytest.fixture(autouse=True)
def no_aws(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: a call would fail
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def make_plan(tmp_path, public=frozenset(), **kw):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    req = jobs.validate_request(jobs.JobRequest(target=str(script), min_nodes=2, max_nodes=4, **kw))
    return jobs.plan(
        req, PROFILE, jobs.prepare_code(req), FACTS, user="alice", region="us-east-1", public_subnets=public
    )


def _worker(plan) -> tuple[dict, dict, dict]:
    t = templates.load_template(plan.template)
    r = t["Resources"]
    return t, r["WorkerLaunchTemplate"]["Properties"]["LaunchTemplateData"], r["WorkerGroup"]["Properties"]


# --------------------------------------------------------------------------- facts


def test_efa_facts_come_from_describe_instance_types():
    p5 = FACTS["p5.48xlarge"]
    assert (p5.efa, p5.network_cards, p5.max_efa_interfaces, p5.efa_interfaces) == (True, 32, 32, 32)
    assert FACTS["p4d.24xlarge"].efa_interfaces == 4
    assert FACTS["g5.48xlarge"].efa_interfaces == 1
    assert FACTS["g5.xlarge"].efa_interfaces == 0 and not FACTS["g5.xlarge"].efa
    assert InstanceTypeInfo.from_dict(p5.to_dict()) == p5
    old = p5.to_dict()
    del old["efa"]  # cached before EFA facts existed: damaged, so looked up again (never "no EFA")
    with pytest.raises(KeyError):
        InstanceTypeInfo.from_dict(old)


# --------------------------------------------------------------------------- templates


def test_p5_workers_get_32_efa_interfaces_in_a_cluster_placement_group(tmp_path):
    plan = make_plan(tmp_path, name="big", instance_type="p5.48xlarge")
    assert (plan.efa_interfaces, plan.placement_group) == (32, True)
    t, lt, group = _worker(plan)
    nics = lt["NetworkInterfaces"]
    assert [n["NetworkCardIndex"] for n in nics] == list(range(32))
    assert [(n["DeviceIndex"], n["InterfaceType"]) for n in nics] == [(0, "efa")] + [(1, "efa-only")] * 31
    worker_sg = {"Fn::GetAtt": ["WorkerSecurityGroup", "GroupId"]}
    for n in nics:
        assert n["Groups"] == [{"Ref": "SecurityGroupId"}, worker_sg] and n["DeleteOnTermination"] is True
        assert "SubnetId" not in n and "AssociatePublicIpAddress" not in n
    # a launch template with interfaces takes its groups there, never also as SecurityGroupIds
    assert "SecurityGroupIds" not in lt
    pg = t["Resources"]["WorkerPlacementGroup"]
    assert pg["Type"] == "AWS::EC2::PlacementGroup" and pg["Properties"]["Strategy"] == "cluster"
    assert group["PlacementGroup"] == {"Ref": "WorkerPlacementGroup"}
    # one zone: the group gets one subnet, the rendezvous server's
    assert plan.parameter_values["SubnetIds"] == SUBNET_A == plan.parameter_values["RdzvSubnetId"]
    # EFA's rule: all traffic in from and out to the group itself; nothing from outside the job
    egress = t["Resources"]["WorkerSecurityGroupSelfEgress"]["Properties"]
    assert egress["GroupId"] == egress["DestinationSecurityGroupId"] == worker_sg
    assert egress["IpProtocol"] == "-1"
    ingress = t["Resources"]["WorkerSecurityGroupSelfIngress"]["Properties"]
    assert ingress["SourceSecurityGroupId"] == worker_sg and ingress["IpProtocol"] == "-1"
    assert "CidrIp" not in plan.template.replace("CidrIpv", "")  # no open ingress anywhere
    text = render.plan_text(plan.to_dict())
    assert "EFA, 32 interfaces per worker" in text and "cluster placement group" in text


def test_a_type_without_efa_gets_no_interfaces_and_no_placement_group(tmp_path):
    for itype in ("g5.xlarge", "c6i.large"):
        plan = make_plan(tmp_path, name="small", instance_type=itype, public=set(PROFILE.subnet_ids))
        t, lt, group = _worker(plan)
        assert (plan.efa_interfaces, plan.placement_group) == (0, False)
        assert "NetworkInterfaces" not in lt and lt["SecurityGroupIds"]
        assert "PlacementGroup" not in group
        assert not [r for r in t["Resources"].values() if r["Type"] == "AWS::EC2::PlacementGroup"]
        assert "WorkerSecurityGroupSelfEgress" not in t["Resources"]
        assert plan.parameter_values["SubnetIds"] == ",".join(PROFILE.subnet_ids)
        assert not any(k.startswith("FI_") for k in plan.spec.env)
        assert "network:" not in render.plan_text(plan.to_dict())


def test_no_placement_group_keeps_efa_and_every_subnet(tmp_path):
    plan = make_plan(tmp_path, name="big", instance_type="p5.48xlarge", no_placement_group=True)
    assert (plan.efa_interfaces, plan.placement_group) == (32, False)
    t, lt, group = _worker(plan)
    assert len(lt["NetworkInterfaces"]) == 32
    assert "PlacementGroup" not in group and "WorkerPlacementGroup" not in t["Resources"]
    assert plan.parameter_values["SubnetIds"] == ",".join(PROFILE.subnet_ids)
    assert "no placement group (--no-placement-group)" in render.plan_text(plan.to_dict())


def test_no_placement_group_keeps_default_job_names():
    """Jobs named before the flag existed keep their names; the flag changes the name."""
    plain = jobs.JobRequest(target="s3://b/train.py")
    assert jobs.default_job_name(plain) == jobs.default_job_name(jobs.JobRequest(target="s3://b/train.py"))
    assert jobs.default_job_name(plain) != jobs.default_job_name(
        jobs.JobRequest(target="s3://b/train.py", no_placement_group=True)
    )


def test_several_efa_cards_are_refused_in_public_subnets_in_one_line(tmp_path):
    for public in ({SUBNET_A}, {SUBNET_A, SUBNET_B}):
        with pytest.raises(ConfigError) as e:
            make_plan(tmp_path, name="big", instance_type="p5.48xlarge", public=public)
        msg = e.value.format_message()
        assert "\n" not in msg and SUBNET_A in msg and "no public IPv4" in msg
        assert "NAT" in msg and "configure --subnet-ids" in msg
    # without the placement group the workers use every subnet: any public one is refused
    with pytest.raises(ConfigError, match=SUBNET_B):
        make_plan(
            tmp_path, name="big", instance_type="p4d.24xlarge", public={SUBNET_B}, no_placement_group=True
        )
    # with it, only the first subnet is used: a public second one does not matter
    assert (
        make_plan(tmp_path, name="big", instance_type="p4d.24xlarge", public={SUBNET_B}).efa_interfaces == 4
    )
    # one network card: one interface, and the subnet's public address as before
    one = make_plan(tmp_path, name="one", instance_type="g5.48xlarge", public=set(PROFILE.subnet_ids))
    assert one.efa_interfaces == 1 and one.placement_group
    (nic,) = _worker(one)[1]["NetworkInterfaces"]
    assert (nic["NetworkCardIndex"], nic["DeviceIndex"], nic["InterfaceType"]) == (0, 0, "efa")


def test_types_with_different_efa_cards_are_not_efa(tmp_path):
    """One launch template for every --instance-type: EFA only when they all take the same interfaces."""
    plan = make_plan(tmp_path, name="mix", instance_type="p5.48xlarge,p4d.24xlarge", public={SUBNET_A})
    assert (plan.efa_interfaces, plan.placement_group) == (0, False)
    assert "NetworkInterfaces" not in _worker(plan)[1]


def test_efa_environment_for_the_workers(tmp_path):
    p5 = make_plan(tmp_path, name="big", instance_type="p5.48xlarge")
    assert p5.spec.env == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    # g5's EFA has no device RDMA: the provider only
    assert make_plan(tmp_path, name="gg", instance_type="g5.48xlarge").spec.env == {"FI_PROVIDER": "efa"}
    # the user's --env wins
    mine = make_plan(tmp_path, name="big", instance_type="p5.48xlarge", env={"FI_EFA_USE_DEVICE_RDMA": "0"})
    assert mine.spec.env["FI_EFA_USE_DEVICE_RDMA"] == "0" and mine.spec.env["FI_PROVIDER"] == "efa"
    assert "NCCL_PROTO" not in p5.spec.env


# --------------------------------------------------------------------------- lint and size

EFA_VARIANTS = [
    {"gpu": True, "efa_interfaces": 32, "placement_group": True},
    {"gpu": True, "efa_interfaces": 4, "placement_group": False, "spot": True, "instance_types": 2},
    {"gpu": True, "efa_interfaces": 1, "placement_group": True, "warm_pool": True, "own_roles": False},
]


@pytest.fixture(scope="module")
def rules():
    return get_rules([str(RULES_DIR)], [], [])


@pytest.mark.parametrize("flags", EFA_VARIANTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_efa_variants_lint_clean(flags, rules):
    """Zero errors and warnings from cfn-lint and petctl's own rules, as for every other variant."""
    text = templates.render_job(**flags)
    assert cfn_yaml.loads(text) == templates.load_template(text)
    assert [str(m) for m in lint(text, rules=rules, config=ManualArgs(regions=["us-east-1"]))] == []


def test_largest_efa_template_fits_the_template_url_cap():
    largest = templates.render_job(
        gpu=True,
        spot=True,
        ami_override=True,
        instance_types=20,
        bucket_kms=True,
        efa_interfaces=32,
        placement_group=True,
    )
    plain = templates.render_job(gpu=True, spot=True, ami_override=True, instance_types=20, bucket_kms=True)
    assert len(largest.encode()) <= templates.TEMPLATE_URL_MAX_BYTES
    # the interfaces are a loop: each costs a few lines, not a copy of the template
    assert len(largest) - len(plain) < 32 * 200


@pytest.mark.parametrize("bad", [-1, 65, True, "4"])
def test_render_refuses_bad_efa_counts(bad):
    with pytest.raises((ValueError, TypeError)):
        templates.render_job(efa_interfaces=bad)
