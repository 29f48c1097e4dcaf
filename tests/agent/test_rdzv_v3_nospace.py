"""etcd out of space: at its backend quota etcd raises its NOSPACE alarm and refuses every write
(and txn) until its history is compacted, its database defragmented and the alarm disarmed.
The handler says so in one line (``no_space``, and to ``on_no_space``: the agent publishes it,
``petctl status`` shows it), and says when it ends. The fix is the one docs/rendezvous.md gives,
run here with ``etcdctl`` on a real etcd started with a tiny ``--quota-backend-bytes``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Etcd, wait_for

from petctl_agent.rendezvous import Config, PetctlRendezvousHandler
from petctl_agent.rendezvous import etcdv3 as v3

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd binary not on PATH")


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[Etcd]:
    e = Etcd(tmp_path / "etcd")
    e.flags[e.flags.index("--quota-backend-bytes") + 1] = str(512 * 1024)
    e.start()
    yield e
    e.stop()


def _etcdctl(e: Etcd, *args: str) -> str:
    exe = shutil.which("etcdctl")
    if exe is None:
        pytest.skip("etcdctl not on PATH")
    env = {**os.environ, "ETCDCTL_API": "3"}
    cmd = [exe, f"--endpoints=http://{e.endpoint}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=30).stdout


def test_out_of_space_is_said_in_one_line_and_the_documented_fix_clears_it(small_etcd: Etcd) -> None:
    c = v3.Client(small_etcd.endpoint)
    with pytest.raises(v3.NoSpace, match="database space exceeded"):
        for i in range(100):
            c.put(f"/fill/{i}", "x" * 65536)
    assert c.alarms() == ["NOSPACE"]
    said: list[str | None] = []
    h = PetctlRendezvousHandler("t-nospace", small_etcd.endpoint, 1, 1, "127.0.0.1", config=Config())
    h.on_no_space = said.append
    got: dict[str, object] = {}
    threading.Thread(target=lambda: got.update(info=h.next_rendezvous()), daemon=True).start()
    try:
        line = wait_for(lambda: h.no_space, 10, "the handler to say etcd is out of space")
        assert line.startswith("etcd is out of space: ") and "\n" not in line, line
        assert "database space exceeded" in line and "disarmed" in line
        wait_for(lambda: said, 5, "on_no_space to be told")  # told just after no_space is set
        assert said == [line]
        # the fix, as docs/rendezvous.md gives it (here the space is the fill's live keys: delete them)
        _etcdctl(small_etcd, "del", "--prefix", "/fill/")
        rev = json.loads(_etcdctl(small_etcd, "endpoint", "status", "--write-out=json"))[0]["Status"][
            "header"
        ]["revision"]
        _etcdctl(small_etcd, "compact", str(rev))
        _etcdctl(small_etcd, "defrag")
        _etcdctl(small_etcd, "alarm", "disarm")
        wait_for(lambda: "info" in got, 20, "the round after the fix")
        wait_for(lambda: h.no_space is None, 10, "the handler to see the alarm gone")
        wait_for(lambda: len(said) > 1, 5, "on_no_space to be told the alarm is gone")
        assert said == [line, None]
    finally:
        h.leave()


def test_the_agent_publishes_the_line_and_its_end_as_events() -> None:
    """What the agent hangs on ``on_no_space``: one ``rdzv_no_space`` event with the line, one
    ``rdzv_space_ok`` when it ends (what ``petctl status`` reads: tests/unit/test_job_state.py)."""
    from types import SimpleNamespace

    from petctl_agent.cloud.status import EVENT_KINDS
    from petctl_agent.elastic.agent import PetctlElasticAgent

    got: list[tuple[str, dict]] = []
    fake = SimpleNamespace(
        pub=SimpleNamespace(event=lambda kind, **data: got.append((kind, data))),
        watch=SimpleNamespace(round=3),
    )
    PetctlElasticAgent._no_space(fake, "etcd is out of space: x")  # type: ignore[arg-type]
    PetctlElasticAgent._no_space(fake, None)  # type: ignore[arg-type]
    assert got == [
        ("rdzv_no_space", {"round": 3, "detail": "etcd is out of space: x"}),
        ("rdzv_space_ok", {"round": 3}),
    ]
    assert {k for k, _ in got} <= set(EVENT_KINDS)
