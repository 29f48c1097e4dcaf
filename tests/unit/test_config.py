from __future__ import annotations

import os

import pytest

from petctl import config
from petctl.errors import ConfigError


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PETCTL_HOME", str(tmp_path))
    return tmp_path


def test_profile_roundtrip_is_private_and_atomic(home):
    p = config.Profile(name="dev", region="eu-west-1", subnet_ids=["subnet-0123456789abcdef0"])
    path = config.save_profile(p)
    assert path == home / "profiles" / "dev.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert config.load_profile("dev") == p
    assert not list((home / "profiles").glob(".tmp-*"))


def test_missing_profile_is_empty_unless_required():
    assert config.load_profile("nope").region is None
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        config.load_profile("nope", must_exist=True)


def test_corrupt_profile_names_the_file(home):
    (home / "profiles").mkdir()
    (home / "profiles" / "x.json").write_text("{not json")
    with pytest.raises(ConfigError, match="x.json is unreadable"):
        config.load_profile("x")


@pytest.mark.parametrize(
    "kind,value",
    [
        ("subnet_id", "subnet-12"),
        ("security_group_id", "sg_0123456789"),
        ("efs_id", "efs-01234567"),
        ("bucket", "Bad_Bucket"),
        ("region", "moon-1"),
        ("instance_profile_arn", "arn:aws:iam::12:role/x"),
    ],
)
def test_bad_ids_are_named(kind, value):
    with pytest.raises(ConfigError) as e:
        config.validate_id(kind, value, "--flag")
    assert repr(value) in str(e.value) and "--flag" in str(e.value)


def test_precedence_flag_env_profile(monkeypatch):
    p = config.Profile(name="x", region="eu-west-1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert config.resolve_region(None, p) == "eu-west-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert config.resolve_region(None, p) == "us-west-2"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert config.resolve_region(None, p) == "ap-south-1"
    assert config.resolve_region("ca-central-1", p) == "ca-central-1"
    monkeypatch.setenv("AWS_PROFILE", "awsprof")
    assert config.resolve_profile_name(None) == "awsprof"
    monkeypatch.setenv("PETCTL_PROFILE", "petprof")
    assert config.resolve_profile_name(None) == "petprof"
    assert config.resolve_profile_name("flag") == "flag"
    os.environ.pop("AWS_PROFILE", None)
