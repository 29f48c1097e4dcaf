"""The CloudFormation templates: every variant renders, parses, passes cfn-lint (with our security rules),
and carries the properties moto ignores (IMDSv2, lifecycle hook, spot policy, tags, encrypted volumes)."""

from __future__ import annotations

import functools
import itertools
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import jinja2
import pytest
from cfnlint.api import lint
from cfnlint.config import ManualArgs
from cfnlint.core import get_rules
from cfnlint.decode import cfn_yaml
from cfnlint.helpers import load_plugins

from petctl import naming, templates, tls
from petctl.lint_rules import RULE_IDS, RULES_DIR
from petctl.templates import rendering
from petctl_agent import TERMINAL_EXITS
from petctl_agent.node.preparing import BOOT_DONE
from petctl_agent.settings import Settings
from petctl_agent.spec import LIGHTHOUSE_PORT

INFRA_VARIANTS = [
    {"az_count": az, "create_efs": efs, "create_bucket": bucket}
    for az, efs, bucket in itertools.product((1, 2, 3), (True, False), (True, False))
]
JOB_VARIANTS = [
    {"gpu": gpu, "spot": spot, "ami_override": ami}
    for gpu, spot, ami in itertools.product((False, True), repeat=3)
] + [
    {"gpu": False, "spot": True, "ami_override": False, "instance_types": 3},
    {"gpu": True, "spot": False, "ami_override": False, "instance_types": 2},
    {"gpu": False, "spot": False, "ami_override": False, "bucket_kms": True},
    # profiles recorded with `configure` that give existing instance profiles: no roles in the stack
    {"gpu": False, "spot": False, "ami_override": False, "own_roles": False},
    {"gpu": True, "spot": True, "ami_override": True, "instance_types": 2, "own_roles": False},
    # a warm pool of stopped, pre-booted workers (run_job --warm-pool N)
    {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True},
    {"gpu": True, "spot": False, "ami_override": True, "warm_pool": True, "own_roles": False},
    # live membership: the rendezvous server also runs the job's torchft lighthouse (run_job --live)
    {"gpu": True, "spot": True, "ami_override": False, "live": True},
]
FIVE_TAGS = ("petctl:job", "petctl:user", "petctl:role", "petctl:spec", "petctl:rdzv")


def _id(variant: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items())


@pytest.fixture(scope="session")
def rules():
    """cfn-lint's rules plus ours, loaded once (loading costs more than linting a template)."""
    return get_rules([str(RULES_DIR)], [], [])


def run_lint(text: str, rules) -> list:
    return lint(text, rules=rules, config=ManualArgs(regions=["us-east-1"]))


@functools.cache
def infra(**flags) -> dict:
    """Parsed base template (cached: parsing is the slow part; tests only read it)."""
    return templates.load_template(templates.render_infra(**flags))


@functools.cache
def job(**flags) -> dict:
    """Parsed job template (cached; read-only)."""
    return templates.load_template(templates.render_job(**flags))


def resources_of_type(template: dict, type_: str) -> dict[str, dict]:
    return {name: r for name, r in template["Resources"].items() if r["Type"] == type_}


# --------------------------------------------------------------------------- every variant


@pytest.mark.parametrize(
    ("stack", "flags"),
    [("infra", flags) for flags in INFRA_VARIANTS] + [("job", flags) for flags in JOB_VARIANTS],
    ids=lambda value: _id(value) if isinstance(value, dict) else value,
)
def test_variant_parses_and_lints_clean(stack, flags, rules):
    """Zero errors and zero warnings, cfn-lint's rules and our security rules (petctl/lint_rules)."""
    text = {"infra": templates.render_infra, "job": templates.render_job}[stack](**flags)
    # cfn-lint's own decoder (CloudFormation short tags) and ours must read the same document.
    assert cfn_yaml.loads(text) == templates.load_template(text)
    assert [str(m) for m in run_lint(text, rules)] == []


def test_lint_harness_reports_warnings_and_our_rules(rules):
    """Guard against a silently toothless lint: a warning and one of our errors must both show."""
    text = templates.render_job().replace("Parameters:\n", "Parameters:\n  NeverUsed:\n    Type: String\n", 1)
    text = text.replace("HttpTokens: required", "HttpTokens: optional")
    ids = {m.rule.id for m in run_lint(text, rules)}
    assert {"W2001", "E9101"} <= ids


def test_outputs_match_the_published_names():
    for flags in INFRA_VARIANTS:
        assert tuple(infra(**flags)["Outputs"]) == templates.INFRA_OUTPUTS
    for flags in JOB_VARIANTS:
        assert tuple(job(**flags)["Outputs"]) == templates.JOB_OUTPUTS


def test_templates_come_from_the_installed_package(tmp_path, monkeypatch):
    from importlib import resources

    monkeypatch.chdir(tmp_path)  # nothing relative to the source tree
    package = resources.files(templates.TEMPLATE_PACKAGE)
    for name in ("infra.yaml.j2", "job.yaml.j2", "user_data/worker.sh.j2", "user_data/rdzv.sh.j2"):
        assert package.joinpath(*name.split("/")).is_file(), name
    assert "AWS::EC2::VPC" in templates.render_infra()


def test_strict_undefined_rejects_missing_context():
    with pytest.raises(jinja2.UndefinedError):
        rendering._environment().get_template(templates.JOB_TEMPLATE).render(gpu=False)


@pytest.mark.parametrize(
    "call",
    [
        lambda: templates.render_infra(az_count=0),
        lambda: templates.render_infra(az_count=7),
        lambda: templates.render_infra(az_count="2"),
        lambda: templates.render_infra(create_efs="yes"),
        lambda: templates.render_job(gpu=1),
        lambda: templates.render_job(warm_pool=1),
    ],
)
def test_render_rejects_bad_flags(call):
    with pytest.raises((ValueError, TypeError)):
        call()


# --------------------------------------------------------------------------- base stack structure


@pytest.mark.parametrize("az_count", [1, 2, 3, 6])
def test_one_subnet_and_mount_target_per_az(az_count):
    t = infra(az_count=az_count)
    subnets = resources_of_type(t, "AWS::EC2::Subnet")
    assert len(subnets) == az_count
    azs = [s["Properties"]["AvailabilityZone"] for s in subnets.values()]
    assert azs == [{"Fn::Select": [i, {"Fn::GetAZs": ""}]} for i in range(az_count)]
    for i, subnet in enumerate(subnets.values()):
        derive, by_cidr, explicit = subnet["Properties"]["CidrBlock"]["Fn::If"]
        assert derive == "DeriveSubnetCidrs"
        assert by_cidr == {"Fn::Select": [i, {"Fn::Cidr": [{"Ref": "VpcCidr"}, az_count, 8]}]}
        assert explicit == {"Fn::Select": [i, {"Ref": "SubnetCidrs"}]}
    assert len(resources_of_type(t, "AWS::EC2::SubnetRouteTableAssociation")) == az_count
    mount_targets = resources_of_type(t, "AWS::EFS::MountTarget")
    assert sorted(m["Properties"]["SubnetId"]["Ref"] for m in mount_targets.values()) == sorted(subnets)
    # an existing file system (--efs-id) gets mount targets in this VPC too, or no worker could mount it
    existing = resources_of_type(infra(az_count=az_count, create_efs=False), "AWS::EFS::MountTarget")
    assert len(existing) == az_count
    assert all(m["Properties"]["FileSystemId"] == {"Ref": "ExistingEfsId"} for m in existing.values())


def test_vpc_dns_and_default_route():
    t = infra()
    vpc = t["Resources"]["Vpc"]["Properties"]
    assert vpc["EnableDnsSupport"] is True and vpc["EnableDnsHostnames"] is True
    route = resources_of_type(t, "AWS::EC2::Route")["DefaultRoute"]["Properties"]
    assert route["DestinationCidrBlock"] == "0.0.0.0/0"
    assert route["GatewayId"] == {"Ref": "InternetGateway"}


def test_base_security_group_admits_nothing_and_efs_only_nfs_from_it():
    """The base group is only the identity EFS admits: traffic between instances is per job."""
    t = infra()
    assert not resources_of_type(t, "AWS::EC2::SecurityGroupIngress")  # no self-ingress any more
    assert "SecurityGroupIngress" not in t["Resources"]["InstanceSecurityGroup"]["Properties"]
    sg = {"Fn::GetAtt": ["InstanceSecurityGroup", "GroupId"]}
    (efs_rule,) = t["Resources"]["EfsSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    assert efs_rule == {
        "IpProtocol": "tcp",
        "FromPort": 2049,
        "ToPort": 2049,
        "SourceSecurityGroupId": sg,
        "Description": "NFS from petctl instances",
    }
    for flags in INFRA_VARIANTS:
        for rule in _ingress_rules(infra(**flags)):
            assert "CidrIp" not in rule and "CidrIpv6" not in rule
            assert rule.get("FromPort") != 22


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_job_security_groups_isolate_the_job(flags):
    """Collectives only between this job's workers; etcd 2379 only from this job's workers."""
    t = job(**flags)
    groups = resources_of_type(t, "AWS::EC2::SecurityGroup")
    assert set(groups) == {"WorkerSecurityGroup", "RdzvSecurityGroup"}
    assert all(g["Properties"]["VpcId"] == {"Ref": "VpcId"} for g in groups.values())
    assert t["Parameters"]["VpcId"]["Type"] == "AWS::EC2::VPC::Id"
    worker_sg = {"Fn::GetAtt": ["WorkerSecurityGroup", "GroupId"]}
    rdzv_sg = {"Fn::GetAtt": ["RdzvSecurityGroup", "GroupId"]}
    (self_rule,) = resources_of_type(t, "AWS::EC2::SecurityGroupIngress").values()
    assert self_rule["Properties"]["GroupId"] == worker_sg
    assert self_rule["Properties"]["SourceSecurityGroupId"] == worker_sg
    assert self_rule["Properties"]["IpProtocol"] == "-1"
    assert "SecurityGroupIngress" not in groups["WorkerSecurityGroup"]["Properties"]
    # etcd's port, and a live job's lighthouse (which has no authentication): this job's workers only
    ports = [2379, LIGHTHOUSE_PORT] if flags.get("live") else [2379]
    rules = groups["RdzvSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    assert [r["FromPort"] for r in rules] == ports
    for rule in rules:
        assert rule["IpProtocol"] == "tcp" and rule["FromPort"] == rule["ToPort"]
        assert rule["SourceSecurityGroupId"] == worker_sg
        assert set(rule) == {"IpProtocol", "FromPort", "ToPort", "SourceSecurityGroupId", "Description"}
    for rule in _ingress_rules(t):
        assert "CidrIp" not in rule and "CidrIpv6" not in rule
    base = {"Ref": "SecurityGroupId"}
    lts = _launch_templates(t)
    assert lts["WorkerLaunchTemplate"]["SecurityGroupIds"] == [base, worker_sg]
    assert lts["RdzvLaunchTemplate"]["SecurityGroupIds"] == [base]  # etcd listens on the ENI only
    assert t["Resources"]["RdzvEni"]["Properties"]["GroupSet"] == [base, rdzv_sg]
    # SecurityGroup descriptions accept a restricted character set (no apostrophes)
    for text in [g["Properties"]["GroupDescription"]["Fn::Sub"] for g in groups.values()] + [
        r.get("Description", "") for r in _ingress_rules(t)
    ]:
        assert re.fullmatch(r"[A-Za-z0-9 ._\-:/()#,@\[\]+=&;{}!$*]*", text), text


def _ingress_rules(t: dict) -> list[dict]:
    rules = [r["Properties"] for r in resources_of_type(t, "AWS::EC2::SecurityGroupIngress").values()]
    for sg in resources_of_type(t, "AWS::EC2::SecurityGroup").values():
        rules += sg["Properties"].get("SecurityGroupIngress", [])
    return rules


def test_efs_and_bucket_are_encrypted_private_and_tls_only():
    t = infra()
    assert t["Resources"]["FileSystem"]["Properties"]["Encrypted"] is True
    bucket = t["Resources"]["Bucket"]["Properties"]
    (sse,) = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert sse["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")
    assert set(bucket["PublicAccessBlockConfiguration"].values()) == {True}
    assert len(bucket["PublicAccessBlockConfiguration"]) == 4
    (statement,) = t["Resources"]["BucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Effect"] == "Deny"
    assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_existing_efs_and_bucket_become_parameters():
    t = infra(create_efs=False, create_bucket=False)
    for absent in ("FileSystem", "Bucket", "BucketPolicy"):
        assert absent not in t["Resources"]
    assert "EfsSecurityGroup" in t["Resources"]  # the mount targets in this VPC need it
    assert {"ExistingEfsId", "ExistingBucketName"} <= set(t["Parameters"])
    assert t["Outputs"]["EfsId"]["Value"] == {"Ref": "ExistingEfsId"}
    assert t["Outputs"]["BucketName"]["Value"] == {"Ref": "ExistingBucketName"}


def _policy_statements(t: dict, role: str) -> dict[str, dict]:
    (policy,) = t["Resources"][role]["Properties"]["Policies"]
    return {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}


S3 = "arn:${AWS::Partition}:s3:::${BucketName}"
ASG = "arn:${AWS::Partition}:autoscaling:${AWS::Region}:${AWS::AccountId}:autoScalingGroup:*:autoScalingGroupName/"
LOGS = "arn:${AWS::Partition}:logs:${AWS::Region}:${AWS::AccountId}:log-group:${LogGroupName}"
JOB_TAG = {"StringEquals": {"aws:ResourceTag/petctl:job": {"Ref": "JobName"}}}


def _subs(resource) -> list[str]:
    return [r["Fn::Sub"] for r in (resource if isinstance(resource, list) else [resource])]


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_job_launch_templates_leave_public_addresses_to_the_subnet(flags):
    """docs/contracts.md, "Public IPv4 addresses": setup's subnets map a (billed) public IPv4 to every
    instance; a job never asks for one itself, so in a configured private subnet behind NAT its
    instances have none."""
    for name, data in _launch_templates(job(**flags)).items():
        assert "NetworkInterfaces" not in data and "AssociatePublicIpAddress" not in str(data), name
        assert data["SecurityGroupIds"], name  # groups on the primary interface the subnet makes
    for variant in INFRA_VARIANTS:
        subnets = resources_of_type(infra(**variant), "AWS::EC2::Subnet")
        assert len(subnets) == variant["az_count"]
        assert all(s["Properties"]["MapPublicIpOnLaunch"] is True for s in subnets.values())
        assert not resources_of_type(infra(**variant), "AWS::EC2::NatGateway")


def test_base_stack_has_no_iam():
    for flags in INFRA_VARIANTS:
        t = infra(**flags)
        assert not [r for r in t["Resources"].values() if r["Type"].startswith("AWS::IAM::")]
        assert not {"WorkerInstanceProfileArn", "RdzvInstanceProfileArn", "WorkerRoleArn"} & set(t["Outputs"])


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_job_roles_exist_exactly_with_own_roles(flags):
    t = job(**flags)
    lts = _launch_templates(t)
    if flags.get("own_roles", True):
        assert set(resources_of_type(t, "AWS::IAM::Role")) == {"WorkerRole", "RdzvRole", "CleanupRole"}
        assert set(resources_of_type(t, "AWS::IAM::InstanceProfile")) == {
            "WorkerInstanceProfile",
            "RdzvInstanceProfile",
            "CleanupInstanceProfile",
        }
        assert lts["WorkerLaunchTemplate"]["IamInstanceProfile"] == {
            "Arn": {"Fn::GetAtt": ["WorkerInstanceProfile", "Arn"]}
        }
        assert lts["RdzvLaunchTemplate"]["IamInstanceProfile"] == {
            "Arn": {"Fn::GetAtt": ["RdzvInstanceProfile", "Arn"]}
        }
        assert "LogGroupName" in t["Parameters"] and "WorkerInstanceProfileArn" not in t["Parameters"]
    else:
        assert not [r for r in t["Resources"].values() if r["Type"].startswith("AWS::IAM::")]
        assert lts["WorkerLaunchTemplate"]["IamInstanceProfile"] == {
            "Arn": {"Ref": "WorkerInstanceProfileArn"}
        }
        assert lts["RdzvLaunchTemplate"]["IamInstanceProfile"] == {"Arn": {"Ref": "RdzvInstanceProfileArn"}}
        assert "LogGroupName" not in t["Parameters"]


#: What the SSM agent needs for Session Manager, and nothing that reads parameters.
SESSION_MANAGER_ACTIONS = [
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
]


def test_job_roles_are_least_privilege_across_jobs():
    t = job()
    for role in ("WorkerRole", "RdzvRole"):
        props = t["Resources"][role]["Properties"]
        # No managed policy: AmazonSSMManagedInstanceCore reads every SSM parameter of the account.
        assert "ManagedPolicyArns" not in props
        assert _policy_statements(t, role)["SessionManager"]["Action"] == SESSION_MANAGER_ACTIONS
        assert "RoleName" not in props  # CAPABILITY_IAM is enough
        for statement in _policy_statements(t, role).values():
            assert statement["Effect"] == "Allow" and "NotAction" not in statement
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            assert all("*" not in a for a in actions), statement
            if statement["Resource"] == "*":  # only actions without resource-level permissions
                assert actions in (
                    ["autoscaling:DescribeAutoScalingGroups"],
                    ["ec2:DescribeNetworkInterfaces"],
                    SESSION_MANAGER_ACTIONS,
                )
                continue
            for arn in _subs(statement["Resource"]):
                # every resource names this job (S3 prefix, log streams, groups) or its own file system
                assert (
                    "${JobName}" in arn
                    or (arn == S3 and statement["Action"] == "s3:ListBucket")  # prefix-conditioned
                    or (arn == S3 + "/petctl/uploads/*" and statement["Action"] == "s3:GetObject")
                    or (statement.get("Condition") or {})
                    .get("StringEquals", {})
                    .get("aws:ResourceTag/petctl:job")
                    or arn.endswith(("file-system/${EfsId}", "${LogGroupName}", "${LogGroupName}:*"))
                ), arn
            if any(a.startswith("autoscaling:") for a in actions):
                # name AND tag (StopJob adds its scale-down-only keys: test_scale_limits.py)
                assert statement["Condition"]["StringEquals"] == JOB_TAG["StringEquals"], statement
    worker = _policy_statements(t, "WorkerRole")
    assert worker["ReadJobInputs"]["Action"] == "s3:GetObject"
    assert _subs(worker["ReadJobInputs"]["Resource"]) == [
        S3 + "/petctl/jobs/${JobName}/job.json",
        S3 + "/petctl/jobs/${JobName}/code/*",
        S3 + "/petctl/jobs/${JobName}/dist/*",
        S3 + "/petctl/uploads/*",
    ]
    # etcd TLS: a worker reads the CA certificate and the client pair, never the CA key
    assert worker["ReadEtcdClientCertificate"]["Action"] == "s3:GetObject"
    assert _subs(worker["ReadEtcdClientCertificate"]["Resource"]) == [
        S3 + "/petctl/jobs/${JobName}/tls/" + name for name in tls.WORKER_OBJECTS
    ]
    reads = [r for st in worker.values() if st["Action"] == "s3:GetObject" for r in _subs(st["Resource"])]
    assert not [r for r in reads if "/tls/" in r and not r.endswith(tls.WORKER_OBJECTS)]
    assert worker["WriteJobReports"]["Action"] == "s3:PutObject"
    assert _subs(worker["WriteJobReports"]["Resource"]) == [
        S3 + "/petctl/jobs/${JobName}/status/*",
        S3 + "/petctl/jobs/${JobName}/boot/*",
    ]
    writes = [s for s in worker.values() if "s3:PutObject" in str(s["Action"])]
    assert writes == [worker["WriteJobReports"]]  # never code/, job.json, dist/ or another job
    assert worker["ListJobPrefix"]["Action"] == "s3:ListBucket"
    assert _subs(worker["ListJobPrefix"]["Resource"]) == [S3]
    assert worker["ListJobPrefix"]["Condition"] == {
        "StringLike": {"s3:prefix": [{"Fn::Sub": "petctl/jobs/${JobName}/*"}]}
    }
    assert worker["JobLogStreams"]["Action"] == ["logs:CreateLogStream", "logs:PutLogEvents"]
    assert _subs(worker["JobLogStreams"]["Resource"]) == [LOGS + ":log-stream:${JobName}/*"]
    assert worker["DrainAndReplace"]["Action"] == [
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:RecordLifecycleActionHeartbeat",
        "autoscaling:SetInstanceHealth",
    ]
    assert _subs(worker["DrainAndReplace"]["Resource"]) == [ASG + "petctl-${JobName}-workers"]
    assert worker["StopJob"]["Action"] == "autoscaling:UpdateAutoScalingGroup"
    both_groups = [ASG + "petctl-${JobName}-workers", ASG + "petctl-${JobName}-rdzv"]
    assert _subs(worker["StopJob"]["Resource"]) == both_groups
    assert worker["SharedFileSystem"]["Action"] == [
        "elasticfilesystem:ClientMount",
        "elasticfilesystem:ClientWrite",
    ]
    rdzv = _policy_statements(t, "RdzvRole")
    assert rdzv["AttachRendezvousEni"]["Action"] == "ec2:AttachNetworkInterface"
    assert rdzv["AttachRendezvousEni"]["Condition"] == {
        "StringEquals": {
            "aws:ResourceTag/petctl:role": "rdzv",
            "aws:ResourceTag/petctl:job": {"Ref": "JobName"},
        }
    }
    assert rdzv["PublishBootLog"]["Action"] == "s3:PutObject"
    assert _subs(rdzv["PublishBootLog"]["Resource"]) == [S3 + "/petctl/jobs/${JobName}/boot/*"]
    # reads the job's CA only (it signs etcd's server certificate at boot), never the client key
    # and petctl/uploads/, where a job's own copy of the etcd tarball lies (--rdzv-etcd-url)
    # and the job's spec, whose max_node_failures its give-up reads
    assert [sid for sid, st in rdzv.items() if "s3:GetObject" in str(st["Action"])] == [
        "ReadEtcdCa",
        "ReadEtcdCopy",
        "ReadJobSpec",
    ]
    assert _subs(rdzv["ReadEtcdCopy"]["Resource"]) == [S3 + "/petctl/uploads/*"]
    assert _subs(rdzv["ReadJobSpec"]["Resource"]) == [S3 + "/petctl/jobs/${JobName}/job.json"]
    assert _subs(rdzv["ReadEtcdCa"]["Resource"]) == [
        S3 + "/petctl/jobs/${JobName}/tls/" + name for name in tls.RDZV_OBJECTS
    ]
    for role in (worker, rdzv):  # no role writes tls/ (E9108 holds writes to status/ and boot/)
        assert not [st for st in role.values() if "Put" in str(st["Action"]) and "/tls/" in str(st)]
    # the agent that ends the job deletes the CA key: that object, that action, nothing more
    assert worker["ForgetEtcdCaAtJobEnd"]["Action"] == "s3:DeleteObject"
    assert _subs(worker["ForgetEtcdCaAtJobEnd"]["Resource"]) == [S3 + "/petctl/jobs/${JobName}/tls/ca.key"]
    assert [sid for sid, st in {**worker, **rdzv}.items() if "s3:Delete" in str(st["Action"])] == [
        "ForgetEtcdCaAtJobEnd"
    ]
    assert _subs(rdzv["ReplaceSelf"]["Resource"]) == [ASG + "petctl-${JobName}-rdzv"]
    assert rdzv["ReplaceSelf"]["Action"] == "autoscaling:SetInstanceHealth"
    assert _subs(rdzv["StopJob"]["Resource"]) == both_groups
    # the groups the conditions test really carry the tag
    for group in ("WorkerGroup", "RdzvGroup"):
        tags = t["Resources"][group]["Properties"]["Tags"]
        assert {"Key": "petctl:job", "Value": {"Ref": "JobName"}, "PropagateAtLaunch": True} in tags
    eni_tags = t["Resources"]["RdzvEni"]["Properties"]["Tags"]
    assert {"Key": "petctl:job", "Value": {"Ref": "JobName"}} in eni_tags


def _action_names() -> dict[str, dict]:
    """cfn-lint's copy of the Service Authorization Reference: service -> actions -> resource types."""
    import json
    from pathlib import Path

    import cfnlint

    path = Path(cfnlint.__file__).parent / "data" / "AdditionalSpecs" / "Policies.json"
    return json.loads(path.read_text())


def test_job_role_actions_and_condition_keys_exist_in_the_authorization_reference():
    """Every action is real, supports resource-level permissions where we scope it, and every
    aws:ResourceTag condition is a key of the resource types the action authorizes against."""
    spec = _action_names()
    warm = {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True}
    for t, role in itertools.product((job(), job(**warm)), ("WorkerRole", "RdzvRole")):
        for sid, statement in _policy_statements(t, role).items():
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            for action in actions:
                service, name = action.split(":")
                known = {a.lower(): v for a, v in spec[service]["Actions"].items()}
                assert name.lower() in known, action
                types = known[name.lower()].get("Resources") or []
                if statement["Resource"] == "*":
                    continue
                assert types, f"{action} has no resource-level permissions but {sid} scopes it"
                keys = set((statement.get("Condition") or {}).get("StringEquals", {}))
                if any(k.startswith("aws:ResourceTag/") for k in keys):
                    resources = {r.lower(): v for r, v in spec[service]["Resources"].items()}
                    for rtype in types:
                        assert "aws:ResourceTag/${TagKey}" in resources[rtype.lower()]["ConditionKeys"], (
                            action,
                            rtype,
                        )


def test_log_group_and_profile_tags():
    t = infra()
    log_group = t["Resources"]["LogGroup"]["Properties"]
    assert log_group["LogGroupName"] == {"Fn::Sub": "/petctl/${Profile}"}
    assert log_group["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    taggable = {
        "AWS::EC2::VPC",
        "AWS::EC2::Subnet",
        "AWS::EC2::InternetGateway",
        "AWS::EC2::RouteTable",
        "AWS::EC2::SecurityGroup",
        "AWS::S3::Bucket",
        "AWS::Logs::LogGroup",
        "AWS::IAM::Role",
    }
    profile_tag = {"Key": "petctl:profile", "Value": {"Ref": "Profile"}}
    for name, resource in t["Resources"].items():
        props = resource["Properties"]
        if resource["Type"] in taggable:
            assert profile_tag in props["Tags"], name
        if resource["Type"] == "AWS::EFS::FileSystem":
            assert profile_tag in props["FileSystemTags"]


# --------------------------------------------------------------------------- job stack structure


def _launch_templates(t: dict) -> dict[str, dict]:
    return {
        n: r["Properties"]["LaunchTemplateData"]
        for n, r in resources_of_type(t, "AWS::EC2::LaunchTemplate").items()
    }


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_launch_templates_imdsv2_and_encrypted_root(flags):
    t = job(**flags)
    assert not resources_of_type(t, "AWS::AutoScaling::LaunchConfiguration")
    lts = _launch_templates(t)
    assert set(lts) == {"WorkerLaunchTemplate", "RdzvLaunchTemplate", "CleanupLaunchTemplate"}
    for data in lts.values():
        assert data["MetadataOptions"] == {
            "HttpEndpoint": "enabled",
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 1,
            "InstanceMetadataTags": "enabled",
        }
        (root,) = data["BlockDeviceMappings"]
        assert root["Ebs"]["Encrypted"] is True and root["Ebs"]["VolumeType"] == "gp3"
    worker = lts["WorkerLaunchTemplate"]
    assert worker["BlockDeviceMappings"][0]["DeviceName"] == {"Ref": "RootDeviceName"}


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_image_parameter_per_variant(flags):
    image = job(**flags)["Parameters"]["ImageId"]
    if flags["ami_override"]:
        assert image == {"Type": "AWS::EC2::Image::Id", "Description": image["Description"]}
    else:
        assert image["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
        expected = templates.GPU_AMI_PARAMETER if flags["gpu"] else templates.CPU_AMI_PARAMETER
        assert image["Default"] == expected
    size = job(**flags)["Parameters"]["RootVolumeSize"]
    assert size["MinValue"] == (75 if flags["gpu"] else 8)  # the DLAMI snapshot is 75 GiB


def test_ami_parameters_are_the_public_ssm_paths():
    assert (
        templates.CPU_AMI_PARAMETER == "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
    )
    assert re.fullmatch(
        r"/aws/service/deeplearning/ami/x86_64/[a-z0-9.-]+/latest/ami-id", templates.GPU_AMI_PARAMETER
    )


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_groups_names_sizes_and_five_propagated_tags(flags):
    t = job(**flags)
    groups = resources_of_type(t, "AWS::AutoScaling::AutoScalingGroup")
    assert set(groups) == {"WorkerGroup", "RdzvGroup", "CleanupGroup"}
    worker, rdzv = groups["WorkerGroup"]["Properties"], groups["RdzvGroup"]["Properties"]
    assert worker["AutoScalingGroupName"] == {"Fn::Sub": "petctl-${JobName}-workers"}
    assert rdzv["AutoScalingGroupName"] == {"Fn::Sub": "petctl-${JobName}-rdzv"}
    assert (worker["MinSize"], worker["MaxSize"], worker["DesiredCapacity"]) == (
        {"Ref": "MinSize"},
        {"Ref": "MaxSize"},
        {"Ref": "DesiredCapacity"},
    )
    assert worker["VPCZoneIdentifier"] == {"Ref": "SubnetIds"}
    assert (rdzv["MinSize"], rdzv["MaxSize"], rdzv["DesiredCapacity"]) == ("1", "1", "1")
    assert rdzv["VPCZoneIdentifier"] == [{"Ref": "RdzvSubnetId"}]
    for role, props in (("worker", worker), ("rdzv", rdzv)):
        tags = {tag["Key"]: tag for tag in props["Tags"]}
        assert set(FIVE_TAGS) <= set(tags)
        assert all(tag["PropagateAtLaunch"] is True for tag in tags.values())
        assert tags["petctl:role"]["Value"] == role
        assert tags["petctl:job"]["Value"] == {"Ref": "JobName"}
        assert tags["petctl:user"]["Value"] == {"Ref": "User"}
        assert tags["petctl:spec"]["Value"] == {"Ref": "SpecUrl"}
        assert tags["petctl:rdzv"]["Value"] == {"Fn::GetAtt": ["RdzvEni", "PrimaryPrivateIpAddress"]}


def test_spot_uses_a_price_capacity_optimized_mixed_policy():
    on_demand = job(spot=False)["Resources"]["WorkerGroup"]["Properties"]
    assert "MixedInstancesPolicy" not in on_demand
    assert on_demand["LaunchTemplate"]["LaunchTemplateId"] == {"Ref": "WorkerLaunchTemplate"}
    t = job(spot=True)
    spot = t["Resources"]["WorkerGroup"]["Properties"]
    assert "LaunchTemplate" not in spot
    policy = spot["MixedInstancesPolicy"]
    assert policy["InstancesDistribution"] == {
        "OnDemandBaseCapacity": {"Ref": "OnDemandBaseCapacity"},
        "OnDemandPercentageAboveBaseCapacity": 0,
        "SpotAllocationStrategy": "price-capacity-optimized",
    }
    assert policy["LaunchTemplate"]["LaunchTemplateSpecification"]["LaunchTemplateId"] == {
        "Ref": "WorkerLaunchTemplate"
    }
    assert "OnDemandBaseCapacity" in t["Parameters"]
    assert "OnDemandBaseCapacity" not in job(spot=False)["Parameters"]


@pytest.mark.parametrize("spot", [False, True])
def test_several_instance_types_become_launch_template_overrides(spot):
    t = templates.load_template(templates.render_job(spot=spot, instance_types=3))
    policy = t["Resources"]["WorkerGroup"]["Properties"]["MixedInstancesPolicy"]
    overrides = policy["LaunchTemplate"]["Overrides"]
    assert overrides == [{"InstanceType": {"Fn::Select": [i, {"Ref": "InstanceTypes"}]}} for i in range(3)]
    assert t["Parameters"]["InstanceTypes"]["Type"] == "CommaDelimitedList"
    dist = policy["InstancesDistribution"]
    if spot:
        assert dist["SpotAllocationStrategy"] == "price-capacity-optimized"
    else:  # on-demand only, in the order given
        assert dist == {
            "OnDemandPercentageAboveBaseCapacity": 100,
            "OnDemandAllocationStrategy": "prioritized",
        }
    with pytest.raises(ValueError, match="use 1 to 20"):
        templates.render_job(instance_types=21)


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_lifecycle_hooks_are_declared_on_the_worker_group(flags):
    """AWS adds a group's LifecycleHookSpecificationList before the group launches; an
    AWS::AutoScaling::LifecycleHook resource comes after the group has launched its first
    instances, which the launch hook then never held."""
    t = job(**flags)
    assert resources_of_type(t, "AWS::AutoScaling::LifecycleHook") == {}
    hooks = {
        h["LifecycleHookName"]: h
        for h in t["Resources"]["WorkerGroup"]["Properties"]["LifecycleHookSpecificationList"]
    }
    assert set(hooks) == (
        {naming.LIFECYCLE_HOOK, "petctl-launch"} if flags.get("warm_pool") else {naming.LIFECYCLE_HOOK}
    )
    assert hooks["petctl-drain"] == {
        "LifecycleHookName": "petctl-drain",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
        "DefaultResult": "CONTINUE",
        "HeartbeatTimeout": {"Ref": "DrainTimeout"},
    }
    for name in ("RdzvGroup", "CleanupGroup"):  # no agent there completes an action
        assert "LifecycleHookSpecificationList" not in t["Resources"][name]["Properties"], name


def test_warm_pool_of_stopped_workers_held_until_booted():
    """AWS: a warm pool sits on a group with a plain launch template (no mixed instances policy),
    its size is absolute only with MinSize = MaxGroupPreparedCapacity, and an instance is stopped
    as soon as it has launched unless a launch hook holds it until its boot is done."""
    assert (
        not resources_of_type(job(), "AWS::AutoScaling::WarmPool")
        and "WarmPoolSize" not in job()["Parameters"]
    )
    t = job(warm_pool=True)
    ((name, pool),) = resources_of_type(t, "AWS::AutoScaling::WarmPool").items()
    # every pool instance is held by the launch hook: the group's own, there before the pool
    assert "DependsOn" not in pool
    assert pool["Properties"] == {
        "AutoScalingGroupName": {"Ref": "WorkerGroup"},
        "MinSize": {"Ref": "WarmPoolSize"},
        "MaxGroupPreparedCapacity": {"Ref": "WarmPoolSize"},
        "PoolState": "Stopped",
        "InstanceReusePolicy": {"ReuseOnScaleIn": False},
    }
    assert (
        t["Parameters"]["WarmPoolSize"]["Type"] == "Number"
        and t["Parameters"]["WarmPoolSize"]["MinValue"] == 1
    )
    group = t["Resources"]["WorkerGroup"]["Properties"]
    assert "MixedInstancesPolicy" not in group and "CapacityRebalance" not in group
    assert group["LaunchTemplate"]["LaunchTemplateId"] == {"Ref": "WorkerLaunchTemplate"}
    (launch,) = [
        h for h in group["LifecycleHookSpecificationList"] if h["LifecycleHookName"] == "petctl-launch"
    ]
    assert launch == {
        "LifecycleHookName": "petctl-launch",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING",
        # unanswered (a boot that hung, an agent that never parked): terminate, never InService idle
        "DefaultResult": "ABANDON",
        "HeartbeatTimeout": 900,
    }
    # the boot never completes the launch action (the agent does, once parked or in service: AWS
    # stops a pool instance at once), abandons it on failure, and hands the heartbeats over to the
    # agent once its unit started; its last step tells the agent the boot is over
    script = _user_data(
        {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True}, "WorkerLaunchTemplate"
    )
    lines = [line.strip() for line in script.splitlines()]
    assert "LAUNCH_HOOK=petctl-launch" in lines
    assert "--lifecycle-action-result CONTINUE" not in script
    handover = len(lines) - 1 - lines[::-1].index("stop_heartbeats")
    assert handover > lines.index("systemctl enable --now petctl-agent.service")
    last = [line for line in lines if line and not line.startswith("#")][-1]
    assert last == f"touch {Settings().agent_dir / BOOT_DONE}" and lines.index(last) > handover
    assert lines.index("heartbeats &") > lines.index("INSTANCE_ID=$(retry imds meta-data/instance-id)")
    # pip unpacks a 3 GB CUDA torch: on the root volume, not AL2023's RAM-sized /tmp
    assert lines.index("export TMPDIR=/var/tmp") < min(
        i for i, line in enumerate(lines) if "pip install" in line
    )
    assert (
        '--lifecycle-hook-name "$LAUNCH_HOOK" --instance-id "$INSTANCE_ID" --lifecycle-action-result ABANDON'
        in lines
    )
    # user data never runs again when a pool instance starts: the mount and the agent come back at boot
    assert EFS_FSTAB in script
    assert "systemctl enable --now petctl-agent.service" in lines
    plain = _user_data({"gpu": False, "spot": False, "ami_override": False}, "WorkerLaunchTemplate")
    assert "LAUNCH_HOOK=" in plain and "--lifecycle-action-result CONTINUE" not in plain
    assert 'LAUNCH_HOOK=""' in _user_data(
        {"gpu": False, "spot": False, "ami_override": False}, "RdzvLaunchTemplate"
    )


@pytest.mark.parametrize("kwargs", [{"spot": True}, {"instance_types": 2}])
def test_warm_pool_refused_with_a_mixed_instances_policy(kwargs):
    with pytest.raises(ValueError, match="mixed instances policy"):
        templates.render_job(warm_pool=True, **kwargs)


def test_rendezvous_eni_is_in_the_rdzv_subnet_with_the_instance_group():
    t = job()
    eni = t["Resources"]["RdzvEni"]
    assert eni["Type"] == "AWS::EC2::NetworkInterface"
    assert eni["Properties"]["SubnetId"] == {"Ref": "RdzvSubnetId"}
    assert eni["Properties"]["GroupSet"] == [
        {"Ref": "SecurityGroupId"},
        {"Fn::GetAtt": ["RdzvSecurityGroup", "GroupId"]},
    ]
    assert eni["Properties"]["PrivateIpAddress"] == {
        "Fn::If": ["PinRdzvIp", {"Ref": "RdzvPrivateIp"}, {"Ref": "AWS::NoValue"}]
    }
    assert t["Parameters"]["RdzvPrivateIp"]["Default"] == ""  # EC2 chooses unless pinned
    assert {"Key": "petctl:role", "Value": "rdzv"} in eni["Properties"]["Tags"]
    assert {"Key": "petctl:job", "Value": {"Ref": "JobName"}} in eni["Properties"]["Tags"]
    assert t["Outputs"]["RdzvAddress"]["Value"] == {"Fn::GetAtt": ["RdzvEni", "PrimaryPrivateIpAddress"]}
    assert t["Outputs"]["RdzvEndpoint"]["Value"] == {"Fn::Sub": "${RdzvEni.PrimaryPrivateIpAddress}:2379"}


# --------------------------------------------------------------------------- boot scripts


def _user_data(flags: dict, launch_template: str) -> str:
    data = _launch_templates(job(**flags))[launch_template]
    return data["UserData"]["Fn::Base64"]["Fn::Sub"]


def _substituted(script: str) -> str:
    """What CloudFormation's Fn::Sub would produce, with stand-in values (plain strings only)."""
    values = {"DrainTimeout": "60", "RdzvEni.PrimaryPrivateIpAddress": "10.0.0.10"}
    return re.sub(
        r"\$\{([^!}][^}]*)\}", lambda m: values.get(m.group(1), "v-" + re.sub(r"\W", "", m.group(1))), script
    )


#: The job's directory only, through its access point, with the instance's role, over TLS.
EFS_MOUNT = "retry mount -t efs -o tls,iam,accesspoint=${JobAccessPoint},noresvport ${EfsId}:/ $EFS_JOB_DIR"
EFS_FSTAB = '"${EfsId}:/ $EFS_JOB_DIR efs _netdev,tls,iam,accesspoint=${JobAccessPoint},noresvport 0 0"'


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_each_job_mounts_only_its_own_directory_of_efs(flags):
    """An access point per job, rooted at its directory with its own uid/gid; the worker role may
    mount only through it; the agent's paths (<mount>/petctl/jobs/<job>/...) still resolve."""
    t = job(**flags)
    ap = t["Resources"]["JobAccessPoint"]
    assert ap["Type"] == "AWS::EFS::AccessPoint"
    uid = {"Ref": "EfsPosixId"}
    assert ap["Properties"]["FileSystemId"] == {"Ref": "EfsId"}
    assert ap["Properties"]["PosixUser"] == {"Uid": uid, "Gid": uid}
    assert ap["Properties"]["RootDirectory"] == {
        "Path": {"Fn::Sub": "/petctl/jobs/${JobName}"},
        "CreationInfo": {"OwnerUid": uid, "OwnerGid": uid, "Permissions": "0750"},
    }
    # the root directory is where the agent keeps the job's files (naming / petctl_agent.spec)
    assert naming.checkpoint_dir("x").startswith("petctl/jobs/x/")
    assert t["Parameters"]["EfsPosixId"]["MinValue"] == naming.EFS_POSIX_ID_MIN
    assert t["Parameters"]["EfsPosixId"]["MaxValue"] == naming.EFS_POSIX_ID_MAX
    if flags.get("own_roles", True):
        fs = _policy_statements(t, "WorkerRole")["SharedFileSystem"]
        assert fs["Condition"] == {
            "StringEquals": {"elasticfilesystem:AccessPointArn": {"Fn::GetAtt": ["JobAccessPoint", "Arn"]}}
        }
        assert "elasticfilesystem" not in str(_policy_statements(t, "RdzvRole"))
    script = _user_data(flags, "WorkerLaunchTemplate")
    assert EFS_MOUNT in script and EFS_FSTAB in script
    assert "/mnt/efs efs" not in script and "${EfsId}:/ /mnt/efs" not in script  # never the whole file system


def test_efs_posix_id_is_stable_per_job_and_differs_between_jobs():
    ids = {naming.efs_posix_id(f"job-{i}") for i in range(2000)}
    assert len(ids) == 2000
    assert all(naming.EFS_POSIX_ID_MIN <= i <= naming.EFS_POSIX_ID_MAX for i in ids)
    assert naming.efs_posix_id("train") == naming.efs_posix_id("train")


@pytest.mark.parametrize("az_count", (1, 2))
def test_file_system_policy_denies_mounts_without_access_point_or_tls(az_count):
    """No Allow (anonymous clients, which did not mount with iam, get nothing; IAM clients only
    what their role grants: their job's access point) and two denies nothing can lift."""
    fs = infra(az_count=az_count, create_efs=True, create_bucket=True)["Resources"]["FileSystem"]
    policy = fs["Properties"]["FileSystemPolicy"]
    assert [st["Effect"] for st in policy["Statement"]] == ["Deny", "Deny"]
    client = [
        "elasticfilesystem:ClientMount",
        "elasticfilesystem:ClientWrite",
        "elasticfilesystem:ClientRootAccess",
    ]
    by_sid = {st["Sid"]: st for st in policy["Statement"]}
    assert by_sid["DenyWithoutAccessPoint"]["Action"] == client
    assert by_sid["DenyWithoutAccessPoint"]["Condition"] == {
        "Null": {"elasticfilesystem:AccessPointArn": "true"}
    }
    assert by_sid["DenyWithoutTls"]["Action"] == client
    assert by_sid["DenyWithoutTls"]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert all(st["Principal"] == {"AWS": "*"} for st in policy["Statement"])


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_worker_boot_script(flags):
    script = _user_data(flags, "WorkerLaunchTemplate")
    assert script.startswith("#!/bin/bash\n")
    assert "EFS_JOB_DIR=/mnt/efs/petctl/jobs/${JobName}" in script
    assert EFS_MOUNT in script and EFS_FSTAB in script
    assert "amazon-efs-utils" in script
    assert 'aws s3 cp --region "$REGION" --only-show-errors "${DistUrl}" "$WHEEL"' in script
    assert 'pip install --quiet "$WHEEL[agent]" "torch==${TorchVersion}"' in script
    assert 'pip install --quiet "torch==${TorchVersion}"' in script
    assert ("download.pytorch.org/whl/cpu" in script) is (not flags["gpu"])
    # never an unpinned torch: every torch install names the job's version
    assert all(
        "torch==${TorchVersion}" in line
        for line in script.splitlines()
        if "pip install" in line and "torch" in line
    )
    unit = script.split("<<UNIT\n", 1)[1].split("\nUNIT\n", 1)[0]
    for line in (
        "ExecStart=/opt/petctl/bin/petctl-agent run",
        "Restart=on-failure",
        # the agent's terminal exits, and only those, are not restarted (built from the agent's list)
        "RestartPreventExitStatus=" + " ".join(str(rc) for rc in TERMINAL_EXITS),
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        "TimeoutStopSec=$((${DrainTimeout} + 30))",
        "RequiresMountsFor=/mnt/efs/petctl/jobs/${JobName}",
        "Environment=PETCTL_EFS_MOUNT=/mnt/efs",
        "Environment=PETCTL_ETCD_CACERT=/etc/petctl/tls/ca.pem",
        "Environment=PETCTL_ETCD_CERT=/etc/petctl/tls/client.pem",
        "Environment=PETCTL_ETCD_KEY=/etc/petctl/tls/client.key",
    ):
        assert line in unit.splitlines(), line
    assert ("Environment=PETCTL_LAUNCH_HOOK=petctl-launch" in unit.splitlines()) is flags.get(
        "warm_pool", False
    )
    assert "systemctl enable --now petctl-agent.service" in script
    fetch = (
        'retry aws s3 cp --region "$REGION" --only-show-errors "$JOB_URL/tls/$name" "/etc/petctl/tls/$name"'
    )
    assert fetch in script and "for name in ca.pem client.pem client.key; do" in script
    assert script.index(fetch) < script.index("boot_event deps_installed")


BOOT_FAILURE_LINES = (
    'trap \'boot_failed "$LINENO" "$BASH_COMMAND"\' ERR',
    "GIVE_UP_AFTER=3",
    "JOB_URL=s3://${BucketName}/petctl/jobs/${JobName}",
    "$GIVE_UP /var/log/petctl-boot.log",
    'aws s3 cp --region "$REGION" --only-show-errors "$LOG" "$JOB_URL/boot/$INSTANCE_ID.log"',
    'failures=$(aws s3 ls --region "$REGION" "$JOB_URL/boot/" 2>/dev/null | wc -l)',
    'reports=$(aws s3 ls --region "$REGION" "$JOB_URL/status/" 2>/dev/null | wc -l)',
    'if [ "$failures" -ge "$GIVE_UP_AFTER" ] && [ "$reports" -eq 0 ] ||',
    '[ "$since" -ge "$cap" ]; then',
    'mark=$(aws s3 ls --region "$REGION" "$JOB_URL/boot/progress/mark" 2>/dev/null | awk \'{print $1" "$2}\')',
    "since=0",
    '[ -z "$mark" ] ||',
    "for group in petctl-${JobName}-workers petctl-${JobName}-rdzv; do",
    "--min-size 0 --desired-capacity 0",
    'again aws autoscaling set-instance-health --region "$REGION" --instance-id "$INSTANCE_ID" \\',
    "--health-status Unhealthy --no-should-respect-grace-period",
)


AGENT_DIR = Path(__file__).resolve().parents[2] / "agent" / "petctl_agent"
USER_DATA_DIR = Path(templates.__file__).resolve().parents[2] / "cfn_templates" / "user_data"


@pytest.mark.parametrize(
    "flags", [{}, {"warm_pool": True}, {"live": True}], ids=["plain", "warm_pool", "live"]
)
def test_no_role_may_write_logs_nothing_on_its_instance_writes(flags):
    """Least privilege: CloudWatch Logs grants only for what an instance calls. The worker's agent
    creates its stream and puts events (cloud/logship.py); nothing lists streams there (only the
    CLI's `petctl logs`, with the user's credentials), and nothing on the rendezvous instance ships
    logs at all."""
    t = job(**flags)
    logs_actions = {
        role: sorted(
            a
            for st in _policy_statements(t, role).values()
            for a in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])
            if a.startswith("logs:")
        )
        for role in ("WorkerRole", "RdzvRole", "CleanupRole")
    }
    assert logs_actions == {
        "WorkerRole": ["logs:CreateLogStream", "logs:PutLogEvents"],
        "RdzvRole": [],
        "CleanupRole": [],
    }
    agent = "\n".join(p.read_text() for p in AGENT_DIR.rglob("*.py"))
    boot = "\n".join(p.read_text() for p in USER_DATA_DIR.glob("*.j2"))
    assert "describe_log_streams" not in agent and "aws logs" not in boot
    assert "create_log_stream" in agent and "put_log_events" in agent


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_boot_failure_publishes_the_log_marks_unhealthy_and_gives_up(flags):
    """Both boot scripts: on ERR publish the boot log, let the group replace the instance, and stop
    the job when every node keeps failing (no agent report, GIVE_UP_AFTER boot logs)."""
    for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
        script = _user_data(flags, lt)
        lines = [line.strip() for line in script.splitlines()]
        for expected in BOOT_FAILURE_LINES:
            assert expected in lines, (lt, expected)
        assert script.index("trap 'boot_failed") < script.index("INSTANCE_ID=$(retry imds")
        assert "exit 1" not in script  # an explicit exit would skip the ERR trap: use fail
    assert str(jobs_module().BOOT_FAILURES_TO_FAIL) == "3"  # the CLI's FAILED rule counts the same


@pytest.mark.parametrize("flags", JOB_VARIANTS[:4], ids=_id)
def test_an_agent_unit_that_fails_for_good_gives_up_like_a_failed_boot(flags):
    """The agent's unit starts petctl-agent-failed.service when it ends failed (its start limit hit:
    an agent that cannot even start), which runs the boot's own give-up script with the agent's
    journal as the log, and skips a failure the agent already recorded (78, 79)."""
    script = _user_data(flags, "WorkerLaunchTemplate")
    lines = [line.strip() for line in script.splitlines()]
    agent_unit = script[script.index("petctl-agent.service <<UNIT") :]
    assert "OnFailure=petctl-agent-failed.service" in agent_unit[: agent_unit.index("[Service]")]
    failed_unit = script[script.index("petctl-agent-failed.service <<UNIT") :]
    failed_unit = failed_unit[: failed_unit.index("\nUNIT\n")]
    assert "Type=oneshot" in failed_unit and "ExecStart=$GIVE_UP agent" in failed_unit
    assert "journalctl -u petctl-agent.service -n 40 -o cat --no-pager" in lines
    skip = 'if aws s3 ls --region "$REGION" "$JOB_URL/boot/$INSTANCE_ID.log" >/dev/null 2>&1; then'
    assert skip in lines and script.index(skip) < script.index(
        'aws s3 cp --region "$REGION" --only-show-errors "$LOG"'
    )
    # the environment it runs with is written once the instance id is known
    assert script.index("INSTANCE_ID=$(retry imds") < script.index("> /var/lib/petctl/give-up.env")


DELETE_WARM_POOL = 'aws autoscaling delete-warm-pool --region "$REGION" --auto-scaling-group-name "petctl-${JobName}-workers" \\'


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_no_boot_pipeline_ends_in_head(flags):
    """The boot scripts run under ``set -o pipefail``: ``cmd | head -n 1`` fails the boot with exit
    141 whenever ``cmd`` writes after head has exited (SIGPIPE; CI saw it on ``etcd --version``)."""
    for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
        script = _user_data(flags, lt)
        assert "set -Eeuo pipefail" in script, lt
        assert not re.search(r"\|\s*head\b", script), (lt, re.findall(r".*\|\s*head\b.*", script))


@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_boot_failure_gives_up_on_the_warm_pool_first(flags):
    """A group at zero keeps its warm pool (MinSize = MaxGroupPreparedCapacity): giving up deletes
    it, or its failing boots would be replaced forever. Both roles may, with a warm pool only."""
    warm = bool(flags.get("warm_pool"))
    for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
        script = _user_data(flags, lt)
        lines = [line.strip() for line in script.splitlines()]
        assert (DELETE_WARM_POOL in lines) is warm, lt
        # the boot's last event is published before the scale to zero, which may end this instance
        assert script.index('"kind\\": \\"boot_failed') < script.index("gave_up=1"), lt
        if warm:
            assert lines[lines.index(DELETE_WARM_POOL) + 1] == "--force-delete || true"
            # after the boot event and the scale to zero: the deletion may terminate this instance
            # (and the boot event comes before the scale to zero, which may end it too)
            assert lines[lines.index(DELETE_WARM_POOL) - 1] == 'if [ "$gave_up" -eq 1 ]; then'
            assert script.index('"kind\\": \\"boot_failed') < script.index("gave_up=1")
            assert script.index("gave_up=1") < script.index(DELETE_WARM_POOL)
            assert script.index(DELETE_WARM_POOL) < script.index("aws autoscaling set-instance-health")
    if flags.get("own_roles", True):
        t = job(**flags)
        for role in ("WorkerRole", "RdzvRole"):
            stop = _policy_statements(t, role)["StopJob"]
            actions = ["autoscaling:UpdateAutoScalingGroup"] + ["autoscaling:DeleteWarmPool"] * warm
            assert (stop["Action"] if warm else [stop["Action"]]) == actions, role
            assert stop["Condition"]["StringEquals"] == {"aws:ResourceTag/petctl:job": {"Ref": "JobName"}}


def jobs_module():
    from petctl import jobs

    return jobs


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("warm_pool", [False, True], ids=["", "warm_pool"])
@pytest.mark.parametrize("boots,reports", [(1, 0), (3, 0), (3, 1)])
def test_boot_failure_trap_runs(tmp_path, boots, reports, warm_pool):
    """Run the worker boot script with stand-in commands and a failing dnf: the trap publishes,
    marks unhealthy, and scales the groups to zero only at 3 boot logs with no agent report (after
    deleting the warm pool, when there is one)."""
    flags = {"gpu": False, "spot": False, "ami_override": False, "warm_pool": warm_pool}
    script = _substituted(_user_data(flags, "WorkerLaunchTemplate"))
    script = script.replace("/var/log/petctl-boot.log", str(tmp_path / "boot.log"))
    # its state dir too: the real /var/lib/petctl is shared by every run of this test (xdist's
    # workers, other checkouts), and one run's give-up.env used to change another's verdict
    script = script.replace("/var/lib/petctl", str(tmp_path / "var-lib-petctl"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    stubs = {
        "aws": f"""echo "aws $*" >> {calls}
case "$*" in
  "s3 ls"*/boot/*) for i in $(seq 1 {boots}); do echo "2025-01-01 00:00:00 10 i-$i.log"; done ;;
  "s3 ls"*/status/*) [ {reports} -gt 0 ] && echo "2025-01-01 00:00:00 10 i-1.json" || exit 1 ;;
esac""",
        "curl": "echo i-0123456789abcdef0",
        "dnf": "echo 'no mirror'; exit 1",
        "sleep": "exit 0",
        # the give-up's last resort: never this machine's
        "shutdown": f'echo "shutdown $*" >> {tmp_path / "shutdowns"}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    import os

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    # (the warm pool's launch hook heartbeats run beside the boot: test_launch_hook_heartbeats_...)
    made = [c for c in calls.read_text().splitlines() if "record-lifecycle-action-heartbeat" not in c]
    assert made[0].startswith("aws s3 cp") and made[0].endswith("/boot/i-0123456789abcdef0.log")
    assert made[-1].startswith("aws autoscaling set-instance-health")
    given_up = [c for c in made if "update-auto-scaling-group" in c or "delete-warm-pool" in c]
    if boots >= 3 and not reports:
        assert [c.split("--auto-scaling-group-name ")[1].split()[0] for c in given_up] == [
            "petctl-v-JobName-workers",
            "petctl-v-JobName-rdzv",
        ] + ["petctl-v-JobName-workers"] * warm_pool
        assert ("delete-warm-pool" in given_up[-1]) is warm_pool
    else:
        assert given_up == []
    log = (tmp_path / "boot.log").read_text()
    assert "giving up after 8 attempts: dnf install" in log
    assert "petctl boot: FAILED (exit 1)" in log


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_launch_hook_heartbeats_while_the_boot_runs_and_stop_before_abandon(tmp_path):
    """A warm-pool boot longer than the hook's timeout is not cut off: heartbeats go out while it
    runs (every second here instead of 300 s), for the job's worker group and hook, and stop before
    the boot abandons (or completes) the action: none after it."""
    flags = {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True}
    script = _substituted(_user_data(flags, "WorkerLaunchTemplate"))
    assert "HEARTBEAT_EVERY=300\n" in script and "HEARTBEAT_FOR=5400\n" in script
    script = script.replace("HEARTBEAT_EVERY=300\n", "HEARTBEAT_EVERY=1\n")
    script = script.replace("/var/log/petctl-boot.log", str(tmp_path / "boot.log"))
    # its state dir too: the real /var/lib/petctl is shared by every run of this test (xdist's
    # workers, other checkouts), and one run's give-up.env used to change another's verdict
    script = script.replace("/var/lib/petctl", str(tmp_path / "var-lib-petctl"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, slow = tmp_path / "calls", tmp_path / "slow-once"
    real_sleep = shutil.which("sleep")
    stubs = {
        "aws": f'echo "aws $*" >> {calls}; case "$*" in "s3 ls"*) exit 1 ;; esac',
        "curl": "echo i-0123456789abcdef0",
        # the first install takes 3.5 s, then every attempt fails at once: the boot fails
        "dnf": f"[ -e {slow} ] || {{ touch {slow}; {real_sleep} 3.5; }}; exit 1",
        # retry's back-off is skipped; the heartbeat loop's 1 s sleeps are real
        "sleep": f'[ "$1" = 1 ] && exec {real_sleep} 1; exit 0',
        # the give-up's last resort: never this machine's
        "shutdown": f'echo "shutdown $*" >> {tmp_path / "shutdowns"}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    import os
    import time

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    time.sleep(2.5)  # a loop left running would beat again by now
    made = calls.read_text().splitlines()
    beats = [i for i, c in enumerate(made) if "record-lifecycle-action-heartbeat" in c]
    assert len(beats) >= 2, made
    for i in beats:
        assert made[i].split() == [
            "aws", "autoscaling", "record-lifecycle-action-heartbeat", "--region", "v-AWSRegion",
            "--auto-scaling-group-name", "petctl-v-JobName-workers", "--lifecycle-hook-name", "petctl-launch",
            "--instance-id", "i-0123456789abcdef0",
        ]  # fmt: skip
    (abandon,) = [i for i, c in enumerate(made) if "--lifecycle-action-result ABANDON" in c]
    assert max(beats) < abandon


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("lt", ["WorkerLaunchTemplate", "RdzvLaunchTemplate"])
def test_a_give_up_whose_aws_calls_all_fail_still_ends_the_instance(tmp_path, lt):
    """Every AWS call fails (the API unreachable): the give-up schedules a power-off before any
    call, tries the calls that end the instance or the job a bounded number of times, and ends.
    Without the last resort the instance stayed in service, idle and billed, forever."""
    flags = {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True}
    script = _substituted(_user_data(flags, lt))
    script = script.replace("/var/log/petctl-boot.log", str(tmp_path / "boot.log"))
    state = tmp_path / "var-lib-petctl"
    script = script.replace("/var/lib/petctl", str(state))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    stubs = {
        # boot/ already holds 3 failures and no agent ever reported: the give-up stops the job
        "aws": f"""echo "aws $*" >> {calls}
case "$*" in "s3 ls"*/boot/*) for i in 1 2 3; do echo "2025-01-01 00:00:00 10 i-$i.log"; done ;; esac
echo "Could not connect to the endpoint URL" >&2; exit 255""",
        "curl": "echo i-0123456789abcdef0",
        "dnf": "echo 'no mirror'; exit 1",
        "etcdctl": "exit 1",
        "sleep": f'echo "sleep $*" >> {calls}',
        "shutdown": f'echo "shutdown $*" >> {calls}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    import os

    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stdout[-2000:]
    made = [c for c in calls.read_text().splitlines() if "heartbeat" not in c]
    give_up = made.index(next(c for c in made if c.startswith("aws s3 cp") and c.endswith(".log")))
    # scheduled before the give-up's first AWS call, and (systemd keeps it) whatever follows
    assert made[give_up - 1] == "shutdown -h +10 petctl: this node gave up; powering off (last resort)"
    assert sum(c.startswith("shutdown") for c in made) == 1
    for group in ("workers", "rdzv"):
        tries = [c for c in made if "update-auto-scaling-group" in c and f"petctl-v-JobName-{group}" in c]
        assert len(tries) == 3, group
    health = [i for i, c in enumerate(made) if "set-instance-health" in c]
    assert len(health) == 3 and made[health[0] + 1 : health[-1]] == [
        c
        for c in made[health[0] + 1 : health[-1]]
        if c.startswith(("sleep", "aws autoscaling set-instance-health"))
    ]
    assert [made[i + 1] for i in health[:2]] == ["sleep 10", "sleep 20"]
    assert health[-1] == len(made) - 1  # then it ends: the power-off is already scheduled

    if lt == "WorkerLaunchTemplate":
        # the agent unit's give-up (OnFailure=), with the boot's environment: a node that recorded its
        # own failure has nothing more to send, and still schedules the power-off first
        calls.write_text("")
        (bin_dir / "aws").write_text(f'#!/bin/bash\necho "aws $*" >> {calls}\nexit 0\n')
        env = {**os.environ, "MONITOR_SERVICE_RESULT": "exit-code"}
        res = subprocess.run(
            ["bash", str(state / "petctl-give-up"), "agent"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "the agent already recorded its failure" in res.stdout
        made = calls.read_text().splitlines()
        assert made[0].startswith("shutdown -h +10 ") and made[1].startswith("aws s3 ls")
        # the agent's own last resort after its job ended (node/lifecycle.py power_off), as the boot
        # writes it (after its dnf, which failed here)
        start = script.index(f"cat > {state}/petctl-power-off <<'POWER_OFF'")
        end = script.index("\n", script.index(f"chmod 755 {state}/petctl-power-off"))
        subprocess.run(["bash", "-c", script[start:end]], check=True, timeout=60)
        calls.write_text("")
        res = subprocess.run(
            [str(state / "petctl-power-off"), "the job succeeded, but"],
            env={},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert calls.read_text().splitlines() == ["shutdown -h now petctl: the job succeeded, but"]
        unit = script[script.index("petctl-agent.service <<UNIT") :]
        assert f"Environment=PETCTL_AGENT_POWER_OFF={state}/petctl-power-off" in unit.splitlines()


def test_rdzv_boot_script():
    script = _user_data({"gpu": False, "spot": False, "ami_override": False}, "RdzvLaunchTemplate")
    assert 'install_etcd "${EtcdUrl}" "${EtcdSha256}" /opt/etcd/bin' in script  # test_etcd_install.py
    assert "attach-network-interface" in script and "--device-index 1" in script
    assert "until attach_eni; do" in script  # retried while the old instance still holds it
    exec_start = next(line for line in script.splitlines() if line.startswith("ExecStart="))
    assert "--enable-v2" not in exec_start  # only for torch's v2 fallbacks (test_etcd_install.py)
    # TLS only, client certificates from the job's CA (docs/contracts.md, etcd TLS)
    assert "--listen-client-urls https://$ENI_IP:2379,https://127.0.0.1:2379" in exec_start
    assert "--advertise-client-urls https://$ENI_IP:2379 " in exec_start
    for flag in (
        "--cert-file $TLS/server.pem",
        "--key-file $TLS/server.key",
        "--client-cert-auth",
        "--trusted-ca-file $TLS/ca.pem",
    ):
        assert flag in exec_start
    assert "http://" not in exec_start.replace("http://127.0.0.1:2380", "")  # peers: loopback only
    lines = script.splitlines()
    assert lines.index("rm -f $TLS/ca.key") < lines.index("systemctl enable --now petctl-etcd.service")
    health = lines.index('retry etcdctl --endpoints "https://$ENI_IP:2379" endpoint health')
    assert health < lines.index("boot_event etcd_started")
    assert "ENI_IP=${RdzvEni.PrimaryPrivateIpAddress}" in script
    assert "systemctl enable --now petctl-etcd.service" in script
    assert 'fail "rendezvous ENI $ENI_ID is still attached elsewhere after 15 minutes"' in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("flags", JOB_VARIANTS, ids=_id)
def test_boot_scripts_are_valid_bash(flags, tmp_path):
    for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
        script = tmp_path / f"{lt}.sh"
        script.write_text(_substituted(_user_data(flags, lt)))
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_boot_scripts_never_use_bash_braces():
    """Inside Fn::Sub every ${...} is CloudFormation's: bash variables must be written $name."""
    declared = set(job(ami_override=True)["Parameters"]) | set(job()["Resources"])
    for flags in JOB_VARIANTS:
        for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
            for ref in re.findall(r"\$\{([^}]*)\}", _user_data(flags, lt)):
                assert ref.startswith("AWS::") or ref.split(".")[0] in declared, ref


# --------------------------------------------------------------------------- parameters


def test_infra_parameters_defaults_and_local_cidr():
    params = templates.parameters_dict(templates.infra_parameters(vpc_cidr="127.0.0.0/16"))
    assert params == {
        "VpcCidr": "127.0.0.0/16",
        "SubnetCidrs": "127.0.0.0/24,127.0.1.0/24",
        "Profile": "default",
        "LogRetentionDays": "30",
        "EfsBackup": "DISABLED",
    }
    three = templates.infra_parameters(
        az_count=3, efs_id="fs-0123456789abcdef0", bucket="my-bucket", profile="p1"
    )
    assert templates.parameters_dict(three)["SubnetCidrs"] == "10.0.0.0/24,10.0.1.0/24,10.0.2.0/24"
    assert templates.parameters_dict(three)["ExistingEfsId"] == "fs-0123456789abcdef0"
    assert templates.parameters_dict(three)["ExistingBucketName"] == "my-bucket"


@pytest.mark.parametrize("flags", INFRA_VARIANTS, ids=_id)
def test_infra_parameters_fit_the_template(flags):
    params = templates.infra_parameters(
        az_count=flags["az_count"],
        efs_id=None if flags["create_efs"] else "fs-0123456789abcdef0",
        bucket=None if flags["create_bucket"] else "my-bucket",
    )
    names, required = templates.template_parameters(templates.render_infra(**flags))
    given = set(templates.parameters_dict(params))
    assert given <= names and required <= given


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vpc_cidr": "10.0.0.1/16"}, "not a valid network CIDR"),
        ({"vpc_cidr": "banana"}, "not a valid network CIDR"),
        ({"vpc_cidr": "10.0.0.0/8"}, "between /16"),
        ({"vpc_cidr": "10.0.0.0/24"}, "to hold 2 /24 subnets"),
        ({"vpc_cidr": "fd00::/56"}, "IPv4"),
        ({"az_count": 9}, "az_count=9"),
        ({"profile": "bad profile"}, "'bad profile'"),
        ({"log_retention_days": 31}, "log_retention_days=31"),
        ({"efs_id": "efs-123"}, "'efs-123'"),
        ({"bucket": "Bad_Bucket"}, "'Bad_Bucket'"),
    ],
)
def test_infra_parameters_reject_bad_values_by_name(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        templates.infra_parameters(**kwargs)


def test_subnet_cidrs_equal_fn_cidr_semantics():
    # Fn::Cidr [block, n, 8] = the first n /24 blocks, in address order.
    assert templates.subnet_cidrs("10.20.0.0/16", 4) == [f"10.20.{i}.0/24" for i in range(4)]
    assert templates.subnet_cidrs("192.168.4.0/22", 4) == [f"192.168.{i}.0/24" for i in range(4, 8)]


JOB_VALUES = {
    "JobName": "train-1",
    "User": "alice",
    "MinSize": 2,
    "MaxSize": 4,
    "DesiredCapacity": 3,
    "SubnetIds": ["subnet-aaaa1111", "subnet-bbbb2222"],
    "RdzvSubnetId": "subnet-aaaa1111",
    "VpcId": "vpc-12345678",
    "SecurityGroupId": "sg-12345678",
    "LogGroupName": "/petctl/default",
    "EfsId": "fs-12345678",
    "EfsPosixId": "123456",
    "BucketName": "bucket",
    "SpecUrl": "s3://bucket/petctl/jobs/train-1/job.json",
    "DistUrl": "s3://bucket/petctl/jobs/train-1/dist/petctl-0.1.0-py3-none-any.whl",
    "TorchVersion": "2.13.0",
}


def test_job_parameters_builds_the_list():
    params = templates.parameters_dict(
        templates.job_parameters(**JOB_VALUES, InstanceType=None, DrainTimeout=90)
    )
    assert params["SubnetIds"] == "subnet-aaaa1111,subnet-bbbb2222"
    assert params["MinSize"] == "2" and params["DrainTimeout"] == "90"
    assert "InstanceType" not in params  # None = the template's default


@pytest.mark.parametrize("missing", sorted(JOB_VALUES))
def test_job_parameters_names_what_is_missing(missing):
    values = {k: v for k, v in JOB_VALUES.items() if k != missing}
    template = templates.render_job()  # exact: LogGroupName is required only with own roles
    with pytest.raises(ValueError, match=f"missing or empty: {missing}$"):
        templates.job_parameters(template=template, **values)
    with pytest.raises(ValueError, match=missing):
        templates.job_parameters(template=template, **{**values, missing: ""})


def test_job_parameters_rejects_unknown_names_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown job stack parameter.*Jobname"):
        templates.job_parameters(**JOB_VALUES, Jobname="x")
    with pytest.raises(ValueError, match="MinSize=2, DesiredCapacity=5, MaxSize=4"):
        templates.job_parameters(**{**JOB_VALUES, "DesiredCapacity": 5})


def test_job_parameters_exact_for_a_given_variant():
    spot = templates.render_job(spot=True, ami_override=True)
    with pytest.raises(ValueError, match="ImageId, OnDemandBaseCapacity"):
        templates.job_parameters(template=spot, **JOB_VALUES)
    params = templates.job_parameters(
        template=spot, **JOB_VALUES, ImageId="ami-12c6146b", OnDemandBaseCapacity=2
    )
    assert templates.parameters_dict(params)["OnDemandBaseCapacity"] == "2"
    with pytest.raises(ValueError, match="unknown.*OnDemandBaseCapacity"):
        templates.job_parameters(template=templates.render_job(), **JOB_VALUES, OnDemandBaseCapacity=2)


def test_job_parameters_cover_every_required_template_parameter():
    for flags in JOB_VARIANTS:
        names, required = templates.template_parameters(templates.render_job(**flags))
        extra = {"ImageId"} if flags["ami_override"] else set()
        extra |= {"OnDemandBaseCapacity"} if flags["spot"] else set()
        extra |= {"InstanceTypes"} if flags.get("instance_types", 1) > 1 else set()
        extra |= {"BucketKmsKeyArn"} if flags.get("bucket_kms") else set()
        extra |= {"WarmPoolSize"} if flags.get("warm_pool") else set()
        if flags.get("own_roles", True):
            assert required == set(JOB_VALUES) | extra
        else:  # existing instance profiles instead of the log group the job's own roles write to
            roles = {"WorkerInstanceProfileArn", "RdzvInstanceProfileArn"}
            assert required == set(JOB_VALUES) - {"LogGroupName"} | roles | extra


# --------------------------------------------------------------------------- our cfn-lint rules


def _template(resources: str) -> str:
    return "AWSTemplateFormatVersion: '2010-09-09'\nResources:\n" + textwrap.indent(
        textwrap.dedent(resources), "  "
    )


#: An EC2 instance role; a snippet appends what it tests to the role's Properties.
_ROLE = """
        R:
          Type: AWS::IAM::Role
          Properties:
            AssumeRolePolicyDocument:
              Version: '2012-10-17'
              Statement:
                - {Effect: Allow, Principal: {Service: ec2.amazonaws.com}, Action: sts:AssumeRole}
"""
#: The role with one inline policy; a snippet appends the policy's statements.
_ROLE_POLICY = (
    _ROLE
    + """\
            Policies:
              - PolicyName: p
                PolicyDocument:
                  Version: '2012-10-17'
                  Statement:
"""
)

BAD_SNIPPETS = {
    "E9101": """
        Lt:
          Type: AWS::EC2::LaunchTemplate
          Properties:
            LaunchTemplateData:
              InstanceType: t3.micro
              MetadataOptions:
                HttpTokens: optional
        """,
    "E9102": """
        Sg:
          Type: AWS::EC2::SecurityGroup
          Properties:
            GroupDescription: open
            SecurityGroupIngress:
              - {IpProtocol: tcp, FromPort: 22, ToPort: 22, CidrIp: 0.0.0.0/0}
        Open6:
          Type: AWS::EC2::SecurityGroupIngress
          Properties:
            GroupId: !GetAtt Sg.GroupId
            IpProtocol: tcp
            FromPort: 443
            ToPort: 443
            CidrIpv6: ::/0
        """,
    "E9103": """
        Fs:
          Type: AWS::EFS::FileSystem
          Properties:
            Encrypted: false
        """,
    "E9104": """
        B:
          Type: AWS::S3::Bucket
          Properties:
            PublicAccessBlockConfiguration:
              BlockPublicAcls: true
              BlockPublicPolicy: false
        """,
    "E9105": """
        Lc:
          Type: AWS::AutoScaling::LaunchConfiguration
          Properties:
            ImageId: ami-12c6146b
            InstanceType: t3.micro
        """,
    "E9106": _ROLE
    + """\
            ManagedPolicyArns:
              - !Sub arn:${AWS::Partition}:iam::aws:policy/AmazonS3FullAccess
        """,
    "E9107": """
        B:
          Type: AWS::S3::Bucket
          Properties:
            BucketEncryption:
              ServerSideEncryptionConfiguration:
                - ServerSideEncryptionByDefault: {SSEAlgorithm: AES256}
            PublicAccessBlockConfiguration:
              {BlockPublicAcls: true, BlockPublicPolicy: true, IgnorePublicAcls: true, RestrictPublicBuckets: true}
        """,
    "E9108": _ROLE_POLICY
    + """\
                    - Effect: Allow
                      Action: [s3:GetObject, s3:PutObject]
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/*
                    - Effect: Allow
                      Action: s3:Put*
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/x/status/*
                    - Effect: Allow
                      Action: s3:PutObject
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${AWS::StackName}/boot/*
                    - Effect: Allow
                      Action: s3:GetObject
                      Resource: "*"
                    - Effect: Allow
                      Action: [s3:DeleteObject, s3:PutObject]
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/tls/ca.key
                    - Effect: Allow
                      Action: s3:Delete*
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/tls/ca.key
                    - Effect: Allow
                      Action: s3:DeleteObject
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/tls/ca.key
        """,
    "E9109": """
        Lt:
          Type: AWS::EC2::LaunchTemplate
          Properties:
            LaunchTemplateData:
              MetadataOptions: {HttpTokens: required}
              UserData:
                Fn::Base64: !Sub |
                  #!/bin/bash
                  etcd --listen-client-urls http://${Ip}:2379,https://127.0.0.1:2379 --advertise-client-urls https://${Ip}:2379 --cert-file s.pem --key-file s.key --client-cert-auth --trusted-ca-file ca.pem
                  etcd --listen-client-urls https://${Ip}:2379 --advertise-client-urls https://${Ip}:2379 --cert-file s.pem --key-file s.key
        """,
    "E9110": _ROLE_POLICY
    + """\
                    - Effect: Allow
                      Action: s3:Get*
                      Resource: !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/*
                    - Effect: Allow
                      Action: s3:GetObject
                      Resource:
                        - !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/tls/ca.key
                        - !Sub arn:${AWS::Partition}:s3:::bucket/petctl/jobs/${JobName}/tls/client.key
        """,
    "E9111": _ROLE
    + """\
            ManagedPolicyArns:
              - !Sub arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore
            Policies:
              - PolicyName: p
                PolicyDocument:
                  Version: '2012-10-17'
                  Statement:
                    - Effect: Allow
                      Action: [ssm:UpdateInstanceInformation, ssm:Get*]
                      Resource: "*"
                    - Effect: Allow
                      Action: ssmmessages:OpenDataChannel
                      Resource: "*"
        """,
    "E9112": """
        Fs:
          Type: AWS::EFS::FileSystem
          Properties:
            Encrypted: true
            FileSystemPolicy:
              Version: '2012-10-17'
              Statement:
                - Effect: Deny
                  Principal: {AWS: "*"}
                  Action: elasticfilesystem:ClientMount
                  Condition: {"Null": {elasticfilesystem:AccessPointArn: "true"}}
                - Effect: Allow
                  Principal: {AWS: "*"}
                  Action: [elasticfilesystem:ClientMount, elasticfilesystem:ClientWrite]
        """,
    "E9113": """
        Lt:
          Type: AWS::EC2::LaunchTemplate
          Properties:
            LaunchTemplateData:
              MetadataOptions: {HttpTokens: required}
              UserData:
                Fn::Base64: !Sub |
                  #!/bin/bash
                  echo "${Fs}:/ /mnt/efs efs _netdev,tls,noresvport 0 0" >> /etc/fstab
                  mount -t efs -o tls,iam,noresvport ${Fs}:/ /mnt/efs
                  mount -t efs ${Fs}:/ /mnt/other
                  mount -t efs -o tls,iam,accesspoint=${Ap} ${Fs}:/ /mnt/fine
        """,
}


def test_rules_dir_loads_each_of_our_rules_once():
    """cfn-lint loads every rule file of the directory by path: all our rules, none twice, nothing else."""
    assert sorted(r.id for r in load_plugins(str(RULES_DIR))) == sorted(RULE_IDS)


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_security_rule_fires_on_a_bad_snippet(rule_id, rules):
    ids = [m.rule.id for m in run_lint(_template(BAD_SNIPPETS[rule_id]), rules)]
    assert rule_id in ids
    # two ingress rules; two bucket defects; five write statements outside one job's reports (the
    # CA key only with s3:DeleteObject alone: the last statement passes)
    # an http URL and a launch without client certificates; a wildcard over both keys, and one
    # policy reading both
    # policy reading both; a managed policy and a wildcard reading SSM parameters
    # EFS: a deny of one action only, no TLS deny, an Allow; an fstab line, a mount without the
    # access point, a mount without options
    expected = {
        "E9102": 2,
        "E9104": 2,
        "E9108": 5,
        "E9109": 2,
        "E9110": 3,
        "E9111": 2,
        "E9112": 3,
        "E9113": 3,
    }
    expected = expected.get(rule_id, 1)
    assert ids.count(rule_id) == expected


def test_open_ingress_rule_sees_through_parameter_defaults(rules):
    text = "Parameters:\n  Cidr:\n    Type: String\n    Default: 0.0.0.0/0\n" + _template(
        """
        Sg:
          Type: AWS::EC2::SecurityGroup
          Properties:
            GroupDescription: open by default
            SecurityGroupIngress:
              - {IpProtocol: tcp, FromPort: 80, ToPort: 80, CidrIp: !Ref Cidr}
        """
    )
    assert "E9102" in [m.rule.id for m in run_lint(text, rules)]


def test_user_data_is_plain_ascii():
    """Fn::Base64 encodes UTF-8 but cloud-init and bash on minimal images are happiest with ASCII."""
    for flags in JOB_VARIANTS:
        for lt in ("WorkerLaunchTemplate", "RdzvLaunchTemplate"):
            assert _user_data(flags, lt).isascii()
