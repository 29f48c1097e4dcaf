"""The rendered templates deployed into moto (in process, fake credentials, us-east-1).

What moto 5.2 does not do, and how we deal with it (test_templates.py checks these on the YAML):

* no ``Fn::Cidr`` (an unresolved ``Fn::Select`` over it raises KeyError): infra_parameters() passes
  the /24 subnet CIDRs explicitly (``SubnetCidrs``); the template falls back to Fn::Cidr only when
  that parameter is empty, and moto evaluates only the chosen Fn::If branch;
* AWS::S3::BucketPolicy is skipped with a warning, and a group's LifecycleHookSpecificationList
  ignored: the local cloud's patch (petctl/local/moto_hooks.py) is applied, which creates the hooks;
* launch template MetadataOptions, a role's ManagedPolicyArns, the bucket's
  PublicAccessBlockConfiguration and the ENI's
  ``GroupSet`` and ``Tags`` are ignored (the ENI gets the VPC's default security group);
* a standalone ENI gets a random address that moto does not reserve, so a worker instance can get
  the same one: the local cloud pins it with the ``RdzvPrivateIp`` parameter;
* an ``AWS::SSM::Parameter::Value<...>`` parameter's *Default* is resolved even when a value is
  passed, and moto has no DLAMI public parameter: the GPU job template only deploys in moto with
  ``ami_override=True``;
* an ``AWS::EFS::AccessPoint`` has no ``Ref``/``Fn::GetAtt`` and a file system's
  ``FileSystemPolicy`` is dropped: the local cloud's patch (petctl/local/moto_efs.py) is applied.
"""

from __future__ import annotations

import ast
import base64
import ipaddress
import json
import warnings

import pytest

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from petctl import naming, templates  # noqa: E402
from petctl.local import moto_efs, moto_hooks  # noqa: E402

REGION = "us-east-1"
LOCAL_CIDR = "127.0.0.0/16"  # what the local cloud uses
FIVE_TAGS = ("petctl:job", "petctl:user", "petctl:role", "petctl:spec", "petctl:rdzv")
MOTO_AMI = "ami-12c6146b"  # one of moto's built-in images


@pytest.fixture
def aws(monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings():
        # "Tried to parse AWS::S3::BucketPolicy but it's not supported": known, see above.
        warnings.filterwarnings("ignore", message=".*not supported by moto's CloudFormation.*")
        moto_efs.apply()
        moto_hooks.apply()
        with moto.mock_aws():
            yield


def client(name: str):
    return boto3.client(name, region_name=REGION)


def create(stack: str, template: str, parameters: list[dict]) -> dict[str, str]:
    cf = client("cloudformation")
    source: dict[str, str] = {"TemplateBody": template}
    if len(template.encode()) > 51_200:  # past the inline cap: by URL from S3, as petctl sends a job stack
        s3 = client("s3")
        s3.create_bucket(Bucket="petctl-test-templates")
        s3.put_object(Bucket="petctl-test-templates", Key=f"{stack}.yaml", Body=template.encode())
        source = {"TemplateURL": f"https://petctl-test-templates.s3.{REGION}.amazonaws.com/{stack}.yaml"}
    cf.create_stack(StackName=stack, **source, Parameters=parameters, Capabilities=["CAPABILITY_IAM"])
    (described,) = cf.describe_stacks(StackName=stack)["Stacks"]
    assert described["StackStatus"] == "CREATE_COMPLETE"
    return {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}


def base_stack(az_count: int = 2, **kwargs) -> dict[str, str]:
    return create(
        "petctl-default",
        templates.render_infra(az_count=az_count),
        templates.infra_parameters(vpc_cidr=LOCAL_CIDR, az_count=az_count, **kwargs),
    )


def job_values(base: dict[str, str], job: str, **extra) -> dict:
    subnets = base["SubnetIds"].split(",")
    bucket = base["BucketName"]
    return {
        "JobName": job,
        "User": "alice",
        "MinSize": 2,
        "MaxSize": 4,
        "DesiredCapacity": 3,
        "SubnetIds": subnets,
        "RdzvSubnetId": subnets[0],
        "VpcId": base["VpcId"],
        "SecurityGroupId": base["InstanceSecurityGroupId"],
        "LogGroupName": base["LogGroupName"],
        "EfsId": base["EfsId"],
        "EfsPosixId": naming.efs_posix_id(job),
        "BucketName": bucket,
        "SpecUrl": f"s3://{bucket}/petctl/jobs/{job}/job.json",
        "DistUrl": f"s3://{bucket}/petctl/jobs/{job}/dist/petctl-0.1.0-py3-none-any.whl",
        "TorchVersion": "2.13.0",
        **extra,
    }


def eni_id(stack: str) -> str:
    detail = client("cloudformation").describe_stack_resource(StackName=stack, LogicalResourceId="RdzvEni")
    return detail["StackResourceDetail"]["PhysicalResourceId"]


def instance_tags(group: str) -> list[dict[str, str]]:
    (asg,) = client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[group])[
        "AutoScalingGroups"
    ]
    ids = [i["InstanceId"] for i in asg["Instances"]]
    if not ids:
        return []
    reservations = client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
    return [{t["Key"]: t["Value"] for t in i.get("Tags", [])} for r in reservations for i in r["Instances"]]


def test_base_stack_in_local_cidr(aws):
    base = base_stack()
    assert set(base) == set(templates.INFRA_OUTPUTS)
    ec2 = client("ec2")
    subnets = ec2.describe_subnets(SubnetIds=base["SubnetIds"].split(","))["Subnets"]
    assert sorted(s["CidrBlock"] for s in subnets) == ["127.0.0.0/24", "127.0.1.0/24"]
    assert len({s["AvailabilityZone"] for s in subnets}) == 2
    assert all(s["VpcId"] == base["VpcId"] for s in subnets)
    (vpc,) = ec2.describe_vpcs(VpcIds=[base["VpcId"]])["Vpcs"]
    assert vpc["CidrBlock"] == LOCAL_CIDR
    (sg,) = ec2.describe_security_groups(GroupIds=[base["InstanceSecurityGroupId"]])["SecurityGroups"]
    assert sg["IpPermissions"] == []  # the identity EFS admits; traffic between instances is per job
    efs = client("efs")
    (fs,) = efs.describe_file_systems(FileSystemId=base["EfsId"])["FileSystems"]
    assert fs["Encrypted"] is True
    assert len(efs.describe_mount_targets(FileSystemId=base["EfsId"])["MountTargets"]) == 2
    # the policy that confines every job to its access point (kept by the local cloud's moto patch)
    policy = json.loads(efs.describe_file_system_policy(FileSystemId=base["EfsId"])["Policy"])
    assert [st["Sid"] for st in policy["Statement"]] == ["DenyWithoutAccessPoint", "DenyWithoutTls"]
    s3 = client("s3")
    rules = s3.get_bucket_encryption(Bucket=base["BucketName"])["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    (group,) = client("logs").describe_log_groups(logGroupNamePrefix="/petctl/default")["logGroups"]
    assert group["logGroupName"] == base["LogGroupName"] == "/petctl/default"
    assert group["retentionInDays"] == 30
    assert client("iam").list_roles()["Roles"] == []  # each job stack makes its own roles


def test_base_stack_with_existing_efs_and_bucket(aws):
    fs_id = client("efs").create_file_system(CreationToken="mine", Encrypted=True)["FileSystemId"]
    client("s3").create_bucket(Bucket="my-petctl-bucket")
    outputs = create(
        "petctl-default",
        templates.render_infra(az_count=3, create_efs=False, create_bucket=False),
        templates.infra_parameters(vpc_cidr=LOCAL_CIDR, az_count=3, efs_id=fs_id, bucket="my-petctl-bucket"),
    )
    assert outputs["EfsId"] == fs_id and outputs["BucketName"] == "my-petctl-bucket"
    assert len(outputs["SubnetIds"].split(",")) == 3
    assert [b["Name"] for b in client("s3").list_buckets()["Buckets"]] == ["my-petctl-bucket"]


@pytest.mark.parametrize(
    "flags",
    [
        {"gpu": False, "spot": False, "ami_override": False},  # AL2023 resolved through moto's SSM
        {"gpu": False, "spot": True, "ami_override": True},
        {"gpu": True, "spot": True, "ami_override": True},
        # the warm pool (skipped by moto; the local cloud's patches add it) must not stop the
        # stack: the local cloud runs run-job --warm-pool through it
        {"gpu": False, "spot": False, "ami_override": False, "warm_pool": True},
    ],
    ids=lambda f: ",".join(k for k, v in f.items() if v) or "cpu",
)
def test_job_stack_from_base_outputs(aws, flags):
    base = base_stack()
    extra: dict = {}
    if flags["ami_override"]:
        extra["ImageId"] = MOTO_AMI
    elif flags["gpu"]:
        # moto ships the Amazon Linux parameters but not the DLAMI one, and (like AWS) refuses to
        # create names under /aws/: point the SSM-typed parameter at a parameter of our own.
        client("ssm").put_parameter(
            Name="/petctl-test/dlami", Value=MOTO_AMI, Type="String", DataType="aws:ec2:image"
        )
        extra["ImageId"] = "/petctl-test/dlami"
    if flags["spot"]:
        extra["OnDemandBaseCapacity"] = 2
    if flags.get("warm_pool"):
        extra["WarmPoolSize"] = 2
    template = templates.render_job(**flags)
    outputs = create(
        "petctl-job-train-1",
        template,
        templates.job_parameters(template=template, **job_values(base, "train-1", **extra)),
    )

    assert set(outputs) == set(templates.JOB_OUTPUTS)
    assert outputs["WorkerGroupName"] == "petctl-train-1-workers"
    assert outputs["RdzvGroupName"] == "petctl-train-1-rdzv"
    address = outputs["RdzvAddress"]
    assert outputs["RdzvEndpoint"] == f"{address}:2379"
    rdzv_subnet = base["SubnetIds"].split(",")[0]
    (subnet,) = client("ec2").describe_subnets(SubnetIds=[rdzv_subnet])["Subnets"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network(LOCAL_CIDR)
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet["CidrBlock"])
    (eni,) = client("ec2").describe_network_interfaces(NetworkInterfaceIds=[eni_id("petctl-job-train-1")])[
        "NetworkInterfaces"
    ]
    assert eni["PrivateIpAddress"] == address
    assert eni["SubnetId"] == rdzv_subnet  # (moto ignores the ENI's GroupSet and Tags)

    (workers,) = client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["petctl-train-1-workers"]
    )["AutoScalingGroups"]
    assert (workers["MinSize"], workers["MaxSize"], workers["DesiredCapacity"]) == (2, 4, 3)
    # the hooks exist as soon as the stack does, declared on the group: its first instances are held
    hooks = client("autoscaling").describe_lifecycle_hooks(AutoScalingGroupName="petctl-train-1-workers")
    hooks = {h["LifecycleHookName"]: h for h in hooks["LifecycleHooks"]}
    assert set(hooks) == ({"petctl-drain", "petctl-launch"} if flags.get("warm_pool") else {"petctl-drain"})
    drain = hooks["petctl-drain"]
    assert (drain["LifecycleTransition"], drain["DefaultResult"], drain["HeartbeatTimeout"]) == (
        "autoscaling:EC2_INSTANCE_TERMINATING",
        "CONTINUE",
        60,  # the DrainTimeout parameter's default
    )
    if flags.get("warm_pool"):
        launch = hooks["petctl-launch"]
        assert (launch["LifecycleTransition"], launch["DefaultResult"], launch["HeartbeatTimeout"]) == (
            "autoscaling:EC2_INSTANCE_LAUNCHING",
            "ABANDON",
            900,
        )
    assert (
        client("autoscaling").describe_lifecycle_hooks(AutoScalingGroupName="petctl-train-1-rdzv")[
            "LifecycleHooks"
        ]
        == []
    )
    assert sorted(workers["VPCZoneIdentifier"].split(",")) == sorted(base["SubnetIds"].split(","))
    if flags["spot"]:
        distribution = workers["MixedInstancesPolicy"]["InstancesDistribution"]
        assert distribution["OnDemandBaseCapacity"] == 2
        assert distribution["SpotAllocationStrategy"] == "price-capacity-optimized"
    expected = {
        "petctl:job": "train-1",
        "petctl:user": "alice",
        "petctl:spec": f"s3://{base['BucketName']}/petctl/jobs/train-1/job.json",
        "petctl:rdzv": address,
    }
    for group, role, count in (("petctl-train-1-workers", "worker", 3), ("petctl-train-1-rdzv", "rdzv", 1)):
        tags = instance_tags(group)
        assert len(tags) == count, group
        for tag in tags:
            assert set(FIVE_TAGS) <= set(tag)
            assert {k: tag[k] for k in expected} == expected
            assert tag["petctl:role"] == role


def test_user_data_is_substituted_with_stack_values(aws):
    base = base_stack()
    create(
        "petctl-job-train-2", templates.render_job(), templates.job_parameters(**job_values(base, "train-2"))
    )
    ec2 = client("ec2")
    (lt,) = ec2.describe_launch_templates(LaunchTemplateNames=["petctl-train-2-workers"])["LaunchTemplates"]
    (version,) = ec2.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"])[
        "LaunchTemplateVersions"
    ]
    data = version["LaunchTemplateData"]
    script = base64.b64decode(data["UserData"]).decode()
    (ap,) = client("efs").describe_access_points(FileSystemId=base["EfsId"])["AccessPoints"]
    assert ap["RootDirectory"]["Path"] == "/petctl/jobs/train-2"
    uid = naming.efs_posix_id("train-2")
    assert ap["PosixUser"] == {"Uid": uid, "Gid": uid}
    mount = (
        f"mount -t efs -o tls,iam,accesspoint={ap['AccessPointId']},noresvport {base['EfsId']}:/ $EFS_JOB_DIR"
    )
    assert mount in script and "EFS_JOB_DIR=/mnt/efs/petctl/jobs/train-2" in script
    assert f"s3://{base['BucketName']}/petctl/jobs/train-2/dist/petctl-0.1.0-py3-none-any.whl" in script
    assert "TimeoutStopSec=$((60 + 30))" in script  # DrainTimeout default
    assert "${" not in script  # every CloudFormation reference resolved
    assert data["BlockDeviceMappings"][0]["Ebs"]["Encrypted"] is True


def test_pinned_rendezvous_address(aws):
    base = base_stack()
    outputs = create(
        "petctl-job-train-3",
        templates.render_job(),
        templates.job_parameters(**job_values(base, "train-3", RdzvPrivateIp="127.0.0.254")),
    )
    assert outputs["RdzvAddress"] == "127.0.0.254"
    assert outputs["RdzvEndpoint"] == "127.0.0.254:2379"
    worker_ips = [
        i["PrivateIpAddress"]
        for r in client("ec2").describe_instances()["Reservations"]
        for i in r["Instances"]
    ]
    assert "127.0.0.254" not in worker_ips
    assert all(tags["petctl:rdzv"] == "127.0.0.254" for tags in instance_tags("petctl-train-3-workers"))


def _document(doc) -> dict:
    """A role policy as moto returns it: a dict, JSON, or (moto 5.2, from CloudFormation) a repr."""
    if not isinstance(doc, str):
        return doc
    try:
        return json.loads(doc)
    except ValueError:
        return ast.literal_eval(doc)


def _roles_of(stack: str) -> dict[str, dict]:
    cf, iam = client("cloudformation"), client("iam")
    found = {}
    for r in cf.list_stack_resources(StackName=stack)["StackResourceSummaries"]:
        if r.get("ResourceType") == "AWS::IAM::Role":
            name = r["PhysicalResourceId"].rsplit("/", 1)[-1]
            found[r["LogicalResourceId"]] = {
                "role": iam.get_role(RoleName=name)["Role"],
                "policies": {
                    p: _document(iam.get_role_policy(RoleName=name, PolicyName=p)["PolicyDocument"])
                    for p in iam.list_role_policies(RoleName=name)["PolicyNames"]
                },
            }
    return found


def test_job_stack_makes_its_own_roles_and_security_groups(aws):
    """Two jobs: each gets its own roles (policies naming only its prefix, streams and groups) and
    its own security groups (etcd 2379 only from that job's workers)."""
    base = base_stack()
    ec2 = client("ec2")
    made = {}
    for job in ("train-a", "train-a-2"):  # one name a prefix of the other: petctl-train-a-* would match both
        template = templates.render_job()
        create(
            f"petctl-job-{job}",
            template,
            templates.job_parameters(template=template, **job_values(base, job)),
        )
        made[job] = _roles_of(f"petctl-job-{job}")
        assert set(made[job]) == {"WorkerRole", "RdzvRole", "CleanupRole"}
    for job, roles in made.items():
        other = "train-a-2" if job == "train-a" else "train-a"
        for logical, found in roles.items():
            text = str(found["policies"])
            assert f"petctl/jobs/{job}/" in text and f"petctl/jobs/{other}/" not in text, logical
            for group in ("workers", "rdzv"):  # exact group names: no petctl-train-a-* wildcard
                assert f"autoScalingGroupName/petctl-{other}-{group}'" not in text
            # only the workers' agent ships logs (nothing on the rendezvous or cleanup instance does)
            assert (f":log-stream:{job}/*" in text) == (logical == "WorkerRole"), logical
        worker_doc = roles["WorkerRole"]["policies"]["petctl-worker"]
        writes = [s for s in worker_doc["Statement"] if "s3:PutObject" in str(s["Action"])]
        (write,) = writes
        bucket = base["BucketName"]
        assert write["Resource"] == [
            f"arn:aws:s3:::{bucket}/petctl/jobs/{job}/status/*",
            f"arn:aws:s3:::{bucket}/petctl/jobs/{job}/boot/*",
        ]
        scoped = [
            s
            for s in worker_doc["Statement"]
            if str(s["Action"]).count("autoscaling:") and s["Resource"] != "*"
        ]
        assert scoped and all(
            s["Condition"]["StringEquals"] == {"aws:ResourceTag/petctl:job": job} for s in scoped
        )

        # launch templates use this job's instance profiles and security groups
        def resource(logical, stack=f"petctl-job-{job}"):
            detail = client("cloudformation").describe_stack_resource(
                StackName=stack, LogicalResourceId=logical
            )
            return detail["StackResourceDetail"]["PhysicalResourceId"]

        worker_sg, rdzv_sg = resource("WorkerSecurityGroup"), resource("RdzvSecurityGroup")
        (lt,) = ec2.describe_launch_templates(LaunchTemplateNames=[f"petctl-{job}-workers"])[
            "LaunchTemplates"
        ]
        (version,) = ec2.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"])[
            "LaunchTemplateVersions"
        ]
        data = version["LaunchTemplateData"]
        assert sorted(data["SecurityGroupIds"]) == sorted([base["InstanceSecurityGroupId"], worker_sg])
        profile_arn = data["IamInstanceProfile"]["Arn"]
        assert profile_arn.startswith("arn:aws:iam::") and ":instance-profile/" in profile_arn
        (profile_role,) = client("iam").get_instance_profile(
            InstanceProfileName=profile_arn.rsplit("/", 1)[1]
        )["InstanceProfile"]["Roles"]
        assert profile_role["Arn"] == roles["WorkerRole"]["role"]["Arn"]
        groups = {
            g["GroupId"]: g
            for g in ec2.describe_security_groups(GroupIds=[worker_sg, rdzv_sg])["SecurityGroups"]
        }
        assert all(g["VpcId"] == base["VpcId"] for g in groups.values())
        (self_rule,) = groups[worker_sg]["IpPermissions"]
        assert self_rule["IpProtocol"] == "-1"
        assert [p["GroupId"] for p in self_rule["UserIdGroupPairs"]] == [worker_sg]
        (etcd_rule,) = groups[rdzv_sg]["IpPermissions"]
        assert (etcd_rule["IpProtocol"], etcd_rule["FromPort"], etcd_rule["ToPort"]) == ("tcp", 2379, 2379)
        assert [p["GroupId"] for p in etcd_rule["UserIdGroupPairs"]] == [worker_sg]
        assert etcd_rule["IpRanges"] == []


def test_job_stack_with_given_instance_profiles(aws):
    """A `configure` profile that records instance profiles: the stack makes no roles and uses them."""
    base = base_stack()
    iam = client("iam")
    arns = {}
    for kind in ("worker", "rdzv"):
        iam.create_role(RoleName=f"mine-{kind}", AssumeRolePolicyDocument="{}")
        arns[kind] = iam.create_instance_profile(InstanceProfileName=f"mine-{kind}")["InstanceProfile"]["Arn"]
        iam.add_role_to_instance_profile(InstanceProfileName=f"mine-{kind}", RoleName=f"mine-{kind}")
    template = templates.render_job(own_roles=False)
    values = job_values(
        base, "train-4", WorkerInstanceProfileArn=arns["worker"], RdzvInstanceProfileArn=arns["rdzv"]
    )
    del values["LogGroupName"]
    create("petctl-job-train-4", template, templates.job_parameters(template=template, **values))
    assert _roles_of("petctl-job-train-4") == {}
    ec2 = client("ec2")
    for kind, name in (("worker", "workers"), ("rdzv", "rdzv")):
        (lt,) = ec2.describe_launch_templates(LaunchTemplateNames=[f"petctl-train-4-{name}"])[
            "LaunchTemplates"
        ]
        (version,) = ec2.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"])[
            "LaunchTemplateVersions"
        ]
        assert version["LaunchTemplateData"]["IamInstanceProfile"]["Arn"] == arns[kind]
