"""The agent's settings: every PETCTL_* knob read once, with the documented defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from petctl_agent.rendezvous.config import Config
from petctl_agent.settings import EtcdTls, Settings, env_float, env_int
from petctl_agent.workarounds import WORKAROUNDS

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_documented_ones() -> None:
    s = Settings.from_env({})
    assert s == Settings(efs_mount=Path("/mnt/efs"), agent_dir=Path("/var/lib/petctl"))
    assert (s.efs_wait, s.rdzv_attempt, s.lifecycle_wait, s.status_interval, s.imds_poll) == (
        300,
        300,
        120,
        5,
        1,
    )
    assert s.join_timeout is None and s.failure_grace is None and s.sync_timeout is None
    assert all(s.enabled(n) for n in WORKAROUNDS) and s.cloudwatch and s.etcd_tls is None


def test_from_env_reads_each_knob() -> None:
    env = {
        "PETCTL_IMDS_URL": "http://127.0.0.1:9/i-1/",
        "PETCTL_AGENT_DIR": "/tmp/a",
        "PETCTL_AGENT_JOIN_TIMEOUT": "12",
        "PETCTL_AGENT_LAST_CALL": "2.0",
        "PETCTL_AGENT_SYNC_TIMEOUT": "soon",  # not a number: the default (from drain_timeout)
        "PETCTL_AGENT_RDZV_BACKEND": "etcd-v2",
        "PETCTL_AGENT_NO_CLOUDWATCH": "1",
        "PETCTL_AGENT_NO_FORKSERVER": "yes",
        "PETCTL_ETCD_CACERT": "/tls/ca.pem",
        "PETCTL_ETCD_CERT": "/tls/client.pem",
        "PETCTL_ETCD_KEY": "/tls/client.key",
    }
    s = Settings.from_env(env)
    assert s.imds_url == "http://127.0.0.1:9/i-1" and s.agent_dir == Path("/tmp/a")
    assert (s.join_timeout, s.last_call, s.sync_timeout, s.rdzv_backend) == (12.0, 2, None, "etcd-v2")
    assert not s.cloudwatch and not s.enabled("FORKSERVER") and s.enabled("PDEATHSIG")
    assert s.etcd_tls == EtcdTls("/tls/ca.pem", "/tls/client.pem", "/tls/client.key")
    with pytest.raises(KeyError):
        s.enabled("NOT_A_WORKAROUND")


def test_half_a_tls_setup_is_refused() -> None:
    s = Settings.from_env({"PETCTL_ETCD_CACERT": "/tls/ca.pem"})
    with pytest.raises(ValueError, match="PETCTL_ETCD_CERT, PETCTL_ETCD_KEY unset"):
        _ = s.etcd_tls


def test_env_helpers() -> None:
    assert env_float("X", 1.5, {"X": "2.5"}) == 2.5
    assert (
        env_float("X", 1.5, {"X": ""}) == env_float("X", 1.5, {"X": "abc"}) == env_float("X", 1.5, {}) == 1.5
    )
    assert env_int("X", 3, {"X": "7.0"}) == 7


def test_every_knob_is_documented() -> None:
    src = (REPO / "agent" / "petctl_agent" / "settings.py").read_text()
    names = set(re.findall(r'"(PETCTL_[A-Z_]+)"', src)) - {"PETCTL_AGENT_NO_"}
    doc = (REPO / "docs" / "agent.md").read_text()
    missing = sorted(
        n for n in names if n not in doc and n.replace("_ATTEMPTS", "") + "` / `_ATTEMPTS" not in doc
    )
    assert not missing, f"settings not in docs/agent.md: {missing}"


def test_the_leader_waits_for_a_running_node_as_long_as_its_coordinated_stop() -> None:
    """The sync timeout (how long a membership change's stop waits for the workers' checkpoint)
    and the rendezvous leader's wait for a node of the previous round come from one place: the
    handler the agent builds waits the stop plus the membership check plus a 5 s margin."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from petctl_agent.elastic.handlers import create_rdzv_handler
    from petctl_agent.rendezvous.registry import create_handler

    s = Settings()
    assert [s.sync_timeout_for(d) for d in (0, 12, 600)] == [5.0, 12.0, 30.0]
    assert Settings(sync_timeout=2.0).sync_timeout_for(600) == 2.0
    h = create_rdzv_handler(
        "127.0.0.1:9", "r", 1, 2, "127.0.0.1", 60, backend="petctl-etcd", drain_timeout=600
    )
    assert h.cfg.stop_wait == 30.0 + 1.0 + 5.0 and h.cfg.straggler == 10.0
    h = create_rdzv_handler(
        "127.0.0.1:9", "r", 1, 2, "127.0.0.1", 60, backend="petctl-etcd",
        settings=Settings(sync_timeout=2.0, membership_interval=0.5), drain_timeout=600,
    )  # fmt: skip
    assert h.cfg.stop_wait == 7.5  # shorter than the straggler window: the window applies
    # torchrun's --rdzv-conf: no coordinated stop unless asked for (0: the straggler window)
    params = RendezvousParameters("petctl-etcd", "127.0.0.1:9", "r", 1, 2, "127.0.0.1")
    assert create_handler(params).cfg.stop_wait == 0.0
    params = RendezvousParameters("petctl-etcd", "127.0.0.1:9", "r", 1, 2, "127.0.0.1", stop_wait="40")
    assert create_handler(params).cfg.stop_wait == 40.0
    with pytest.raises(ValueError, match="stop_wait"):
        Config(stop_wait=-1)
