"""EFA types through the CLI against the moto server (issue #31): EC2's facts (moto has EfaSupported,
MaximumNetworkCards and EfaInfo for these types), the subnets' MapPublicIpOnLaunch looked up for a
type with several network cards, and the plan a dry run prints."""

from __future__ import annotations

import json

import boto3

from petctl import templates
from petctl.gateway.compute import Compute


def dry_run(run, script, *flags):
    return run("--output", "json", "run_job", "--dry-run", "--min", "2", "--max", "4", *flags, str(script))


def _subnets(profile_data) -> list[str]:
    return profile_data()["subnet_ids"]


def test_moto_answers_the_efa_facts(aws):
    found, unknown = Compute(boto3.client("ec2"), "us-east-1").instance_types(
        ["p5.48xlarge", "p4d.24xlarge", "g5.48xlarge", "c6i.large"]
    )
    assert not unknown
    assert [found[t].efa_interfaces for t in ("p5.48xlarge", "p4d.24xlarge", "g5.48xlarge", "c6i.large")] == [
        32,
        4,
        1,
        0,
    ]


def test_p5_is_refused_in_setups_public_subnets_and_nothing_is_made(run, ready, profile_data):
    stacks = boto3.client("cloudformation").list_stacks()["StackSummaries"]
    r = run("run_job", "--min", "2", "--max", "4", "--instance-type", "p5.48xlarge", str(ready))
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert "no public IPv4" in r.stderr and _subnets(profile_data)[0] in r.stderr and "NAT" in r.stderr
    assert boto3.client("cloudformation").list_stacks()["StackSummaries"] == stacks


def test_p5_in_private_subnets_gets_efa_and_a_placement_group_in_one_zone(run, ready, profile_data):
    ec2 = boto3.client("ec2")
    subnets = _subnets(profile_data)
    for s in subnets:  # what a configured profile's private subnets (behind NAT) look like
        ec2.modify_subnet_attribute(SubnetId=s, MapPublicIpOnLaunch={"Value": False})
    r = dry_run(run, ready, "--instance-type", "p5.48xlarge")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert (plan["efa_interfaces"], plan["placement_group"]) == (32, True)
    assert plan["parameters"]["SubnetIds"] == subnets[0]
    assert plan["spec"]["env"]["FI_PROVIDER"] == "efa"
    assert "WorkerPlacementGroup" in plan["template"] and plan["template"].count("efa-only") == 31

    r = dry_run(run, ready, "--instance-type", "p5.48xlarge", "--no-placement-group")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert (plan["efa_interfaces"], plan["placement_group"]) == (32, False)
    assert plan["parameters"]["SubnetIds"] == ",".join(subnets)
    assert "WorkerPlacementGroup" not in plan["template"]


def test_single_card_efa_and_plain_types_in_public_subnets(run, ready):
    r = dry_run(run, ready, "--instance-type", "g5.48xlarge")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["efa_interfaces"], json.loads(r.stdout)["placement_group"]) == (1, True)
    r = run("run_job", "--dry-run", "--min", "2", "--max", "4", "--instance-type", "g5.48xlarge", str(ready))
    assert "EFA, 1 interface per worker" in r.stdout
    plain = json.loads(dry_run(run, ready, "--instance-type", "c6i.large").stdout)
    assert (plain["efa_interfaces"], plain["placement_group"]) == (0, False)
    t = templates.load_template(plain["template"])
    assert "WorkerPlacementGroup" not in t["Resources"]
    assert "PlacementGroup" not in t["Resources"]["WorkerGroup"]["Properties"]
    assert (
        "NetworkInterfaces" not in t["Resources"]["WorkerLaunchTemplate"]["Properties"]["LaunchTemplateData"]
    )
