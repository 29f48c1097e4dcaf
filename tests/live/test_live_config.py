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


def test_lighthouse_runs_without_torch(tmp_path) -> None:
    # The rendezvous instance installs torchft without its dependencies (no torch): the lighthouse
    # must load torchft's compiled module without importing the package, whose __init__ imports torch.
    import subprocess
    import sys
    import time

    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' raises ImportError
        "from petctl_agent.live.lighthouse import main\n"
        "sys.exit(main(['--bind', '127.0.0.1:0']))\n"
    )
    log = tmp_path / "lighthouse.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while b"lighthouse listening on http://127.0.0.1:" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "torch" not in log.read_text().lower().replace("torchft", "")
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_nccl_for_a_model_on_a_gpu_gloo_on_the_cpu_unless_asked() -> None:
    import torch

    from petctl_agent.live.run import pick_backend

    cpu_model = torch.nn.Linear(2, 2)
    assert pick_backend(LiveConfig.from_env(BASE), cpu_model) == "gloo"
    if torch.cuda.is_available():  # on a GPU machine (scripts/gpu_check.sh runs this suite's logic too)
        assert pick_backend(LiveConfig.from_env(BASE), torch.nn.Linear(2, 2).cuda()) == "nccl"
    assert pick_backend(LiveConfig.from_env({**BASE, "PETCTL_LIVE_BACKEND": "nccl"}), cpu_model) == "nccl"
    # two groups on one GPU cannot both be NCCL ranks of it: gloo is the way to say so
    assert LiveConfig.from_env({**BASE, "PETCTL_LIVE_BACKEND": "gloo"}).backend == "gloo"
    with pytest.raises(RuntimeError, match="PETCTL_LIVE_BACKEND='mpi'"):
        LiveConfig.from_env({**BASE, "PETCTL_LIVE_BACKEND": "mpi"})


def test_the_rendezvous_server_s_unit_for_the_lighthouse(capsys) -> None:
    import sys

    assert main(["--unit", "--bind", "10.0.0.5:29510"]) == 0
    text = capsys.readouterr().out
    assert f"ExecStart={sys.executable} -m petctl_agent.live.lighthouse --bind 10.0.0.5:29510\n" in text
    assert "Restart=always\n" in text and "Environment=RUST_LOG=warn\n" in text
    assert text.endswith("WantedBy=multi-user.target\n")
    with pytest.raises(SystemExit):  # never a unit that listens everywhere
        main(["--unit", "--bind", "0.0.0.0:29510"])
