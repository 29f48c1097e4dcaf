"""Validation of a job request: refused before anything is made, one line saying why (exit 2)."""

from __future__ import annotations

import pytest

from petctl import jobs
from petctl.errors import ConfigError


def request(tmp_path, **kw):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return jobs.JobRequest(target=str(script), min_nodes=1, max_nodes=4, **kw)


def test_warm_pool_defaults_to_none_and_keeps_job_names(tmp_path):
    req = jobs.validate_request(request(tmp_path))
    assert req.warm_pool == 0
    named = jobs.default_job_name(req, "p")
    assert named == jobs.default_job_name(jobs.validate_request(request(tmp_path, warm_pool=0)), "p")
    assert named != jobs.default_job_name(jobs.validate_request(request(tmp_path, warm_pool=2)), "p")


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"warm_pool": -1}, "out of range"),
        ({"warm_pool": 101}, "out of range"),
        ({"warm_pool": 5}, "more than --max 4"),
        ({"warm_pool": 1, "spot": True}, "--spot"),
        ({"warm_pool": 1, "instance_type": "c5.large,c6i.large"}, "mixed instances policy"),
    ],
)
def test_warm_pool_refusals(tmp_path, kw, words):
    with pytest.raises(ConfigError) as e:
        jobs.validate_request(request(tmp_path, **kw))
    assert e.value.exit_code == 2
    message = e.value.format_message()
    assert words in message and "\n" not in message


def test_warm_pool_within_max_is_accepted(tmp_path):
    assert jobs.validate_request(request(tmp_path, warm_pool=4)).warm_pool == 4
