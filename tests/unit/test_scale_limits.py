"""An instance's role may scale its job's groups down, never up: UpdateAutoScalingGroup is allowed
only without MaxSize (autoscaling:MaxSize absent) and with MinSize 0 if given. DesiredCapacity has no
condition key; with MaxSize out of reach, AWS itself keeps it at or under the job's --max."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from petctl import templates

ROOT = Path(__file__).resolve().parents[2]
SCALE_DOWN = {
    "Null": {"autoscaling:MaxSize": "true"},
    "NumericEqualsIfExists": {"autoscaling:MinSize": 0},
}


def _update_statements(flags: dict) -> list[tuple[str, dict]]:
    t = templates.load_template(templates.render_job(**flags))
    found = []
    for role in ("WorkerRole", "RdzvRole"):
        (policy,) = t["Resources"][role]["Properties"]["Policies"]
        for s in policy["PolicyDocument"]["Statement"]:
            actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
            if "autoscaling:UpdateAutoScalingGroup" in actions:
                found.append((f"{role}/{s['Sid']}", s))
    return found


@pytest.mark.parametrize("warm_pool", [False, True])
def test_update_auto_scaling_group_cannot_raise_max_or_min(warm_pool):
    statements = _update_statements({"warm_pool": warm_pool})
    assert [name for name, _ in statements] == ["WorkerRole/StopJob", "RdzvRole/StopJob"]
    for name, s in statements:
        assert s["Effect"] == "Allow"
        for key, value in SCALE_DOWN.items():
            assert s["Condition"][key] == value, name
        assert s["Condition"]["StringEquals"] == {"aws:ResourceTag/petctl:job": {"Ref": "JobName"}}


def test_the_instances_own_scale_down_calls_satisfy_the_condition():
    """What the boot script and the agent send: MinSize and DesiredCapacity 0, never MaxSize."""
    boot = (ROOT / "cfn_templates/user_data/common.sh.j2").read_text()
    agent = "\n".join(p.read_text() for p in (ROOT / "agent").rglob("*.py"))
    cli_calls = re.findall(r"update-auto-scaling-group[^\n]*\\\n[^\n]*", boot) + re.findall(
        r"update-auto-scaling-group[^\n\\]*$", boot, flags=re.M
    )
    py_calls = re.findall(r"update_auto_scaling_group\(([^)]*)\)", agent, flags=re.S)
    assert cli_calls and py_calls
    for call in cli_calls:
        assert "--max-size" not in call and "--min-size 0" in call and "--desired-capacity 0" in call
    for call in py_calls:
        assert "MaxSize" not in call and "MinSize=0" in call and "DesiredCapacity=0" in call


def test_no_instance_role_grants_another_way_to_scale_up():
    for flags in ({}, {"warm_pool": True}, {"spot": True, "instance_types": 2}):
        t = templates.load_template(templates.render_job(**flags))
        for role in ("WorkerRole", "RdzvRole"):
            (policy,) = t["Resources"][role]["Properties"]["Policies"]
            actions = set(
                itertools.chain.from_iterable(
                    s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
                    for s in policy["PolicyDocument"]["Statement"]
                )
            )
            assert not actions & {
                "autoscaling:SetDesiredCapacity",
                "autoscaling:PutWarmPool",
                "autoscaling:ExecutePolicy",
                "autoscaling:PutScheduledUpdateGroupAction",
                "autoscaling:*",
            }, role
