"""LiveConfig.from_env: what a worker takes from the agent's environment (pure, no processes)."""

from __future__ import annotations

import pytest

from petctl_agent.live.lighthouse import LighthouseOptions, main
from petctl_agent.live.run import LiveConfig

BASE = {"PETCTL_LIVE_LIGHTHOUSE": "http://10.0.0.5:29510", "PETCTL_LIVE_REPLICA_ID": "i-0abc"}


def test_one_worker_is_the_node_s_replica_group() -> None:
    cfg = LiveConfig.from_env({**BASE, "PETCTL_LOCAL_ADDR": "10.0.1.7"})
    assert (cfg.replica_id, cfg.host, cfg.timeout_s, cfg.drain_file) == ("i-0abc", "10.0.1.7", 10.0, None)


def test_each_local_rank_is_its_own_replica_group() -> None:
    # torchft pairs equal group ranks only: plain DDP needs every rank in the cross-replica group
    env = {**BASE, "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "8"}
    assert LiveConfig.from_env(env).replica_id == "i-0abc-3"


def test_refuses_no_lighthouse_and_wildcard_addresses() -> None:
    with pytest.raises(RuntimeError, match="PETCTL_LIVE_LIGHTHOUSE"):
        LiveConfig.from_env({})
    for wild in ("0.0.0.0", "::", "[::]"):
        with pytest.raises(RuntimeError, match="not a wildcard"):
            LiveConfig.from_env({**BASE, "PETCTL_LOCAL_ADDR": wild})


def test_lighthouse_refuses_a_wildcard_bind() -> None:
    # its /status page and kill endpoint have no authentication: only the job's workers may reach it
    for bind in ("[::]:29510", "0.0.0.0:29510", ":29510"):
        with pytest.raises(SystemExit):
            main(["--bind", bind])
    argv = LighthouseOptions(bind="10.0.0.5:29510").argv()
    assert argv[argv.index("--bind") + 1] == "10.0.0.5:29510"
