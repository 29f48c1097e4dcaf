"""A script that makes its own master ``TCPStore`` on ``MASTER_PORT`` (as scripts written before
torchrun shared its store do) trains under petctl, with rank 0's agent serving the store (the
default, as under torchrun) and with torchrun's switch ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
in the job's ``run-job --env`` (the script's rank 0 serves it).

With the agent's store, the script's master cannot bind the port (the agent listens on it), and
torch, told ``TORCHELASTIC_USE_AGENT_STORE=True``, ignores that failure ("failed to bind ...
ignoring the error", TCPStore.cpp): its rank 0 is a client of the agent's store like the others.

Real agents, a real etcd, real torch workers (bench/harness.py).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

OWN_STORE = """\
import os
from datetime import timedelta

import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                      timeout=timedelta(seconds=60), wait_for_workers=False)
store.add("ranks", 1)
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
dist.barrier()
assert int(store.get("ranks")) == world  # one store for every rank
os.makedirs("outputs", exist_ok=True)
with open(f"outputs/agent-store-{rank}", "w") as f:
    f.write(os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "unset"))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("switch", [None, "1"], ids=["agent-store", "torchrun-switch"])
def test_a_script_that_makes_its_own_master_store_trains(make_cluster, switch: str | None) -> None:
    c = make_cluster(job="own-store", min_nodes=2, max_nodes=2, spec_extra={"max_restarts": 0})
    script = c.tmp / "code" / "own_store.py"
    script.write_text(OWN_STORE)
    doc = json.loads(c.spec_path.read_text())
    doc.update(code_url=f"file://{script}", script="own_store.py")
    if switch is not None:  # export_worker_env puts the job's env in the agent's own
        doc["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = switch
    c.spec_path.write_text(json.dumps(doc))
    nodes = [c.add_node(), c.add_node()]
    c.wait(lambda: all(n.proc.poll() is not None for n in nodes), 180, "every agent to end")
    c.assert_succeeded(nodes)
    seen = {(c.work_dir / "outputs" / f"agent-store-{r}").read_text() for r in range(2)}
    assert seen == {"False" if switch == "1" else "True"}, seen
