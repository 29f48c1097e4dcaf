"""The base stack's plan and the teardown plan are plain data, made without AWS."""

from __future__ import annotations

import pytest

from petctl.config import Profile
from petctl.errors import ConfigError
from petctl.infra import TeardownPlan
from petctl.infra.setup import plan_setup, validate


def test_setup_plan_is_pure_and_uses_the_profile_cidr():
    profile = Profile(name="team", vpc_cidr="10.9.0.0/16")
    p = plan_setup(
        profile, "alice", az_count=2, vpc_cidr=None, efs_id=None, bucket="my-bucket", log_retention_days=7
    )
    assert p.stack == "petctl-team" and p.vpc_cidr == "10.9.0.0/16" and p.bucket_given
    assert p.tags == {"petctl:profile": "team", "petctl:user": "alice"}
    params = {x["ParameterKey"]: x["ParameterValue"] for x in p.parameters}
    assert params["VpcCidr"] == "10.9.0.0/16"
    assert "AWS::EFS::FileSystem" in p.template


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"az_count": 7}, "--az-count 7 is out of range"),
        ({"efs_id": "nope"}, "for --efs-id"),
        ({"bucket": "Bad_Bucket"}, "for --s3-bucket"),
        ({"vpc_cidr": "10.0.0.0/30"}, "--vpc-cidr"),
    ],
)
def test_setup_flags_are_refused_before_any_call(kw, words):
    args = {"az_count": 2, "vpc_cidr": None, "efs_id": None, "bucket": None, **kw}
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        validate(**args)


def test_teardown_plan_says_what_goes_and_what_stays():
    plan = TeardownPlan(
        profile="team", stack="petctl-team", stack_exists=True, jobs=["a"], efs_id="fs-1", efs_created=True
    )
    assert plan.describe().startswith("delete job(s) a with their instances; base stack petctl-team")
    assert "kept: EFS file system fs-1" in plan.kept() and "--delete-data" in plan.kept()
    plan.delete_data = True
    assert plan.efs_to_delete == ["fs-1"] and plan.kept() is None
    assert "EFS file system fs-1 with every checkpoint on it" in plan.describe()
