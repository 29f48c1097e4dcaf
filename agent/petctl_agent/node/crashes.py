"""An agent that keeps failing on one instance stops being restarted: its failures are counted
over the instance's life, not in systemd's window.

systemd restarts a failed agent (``Restart=on-failure``) and gives up after 5 starts in 600 s
(``StartLimitBurst``/``StartLimitIntervalSec``, user_data/worker.sh.j2). An agent that fails every
few minutes (a leak that ends in the OOM killer, a crash an hour into the job) never hits that
window and is restarted forever, rejoining and breaking the job each time. So the agent counts
its own unclean ends in ``<agent dir>/agent-runs.json`` (the root volume: it survives a warm-pool
stop and start): a run that began and never recorded its end (killed, crashed) or that ended
with a status systemd restarts. At the ``PETCTL_AGENT_FAILURE_LIMIT``-th (default 5) the agent
refuses to run again, with a terminal exit: its failure is recorded and counted like a failed
boot (node/failure.py), the instance marked Unhealthy and replaced.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("petctl_agent.crashes")

FILE = "agent-runs.json"


class Runs:
    """The agent's runs on this instance (``path``): how many ended unclean."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._began = False

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, state: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except OSError as e:  # never fatal: the count is a guard, not the job
            log.warning("could not record the agent's run in %s (ignored): %s", self.path, e)

    def begin(self) -> tuple[int, str]:
        """Record this run's start; (unclean ends so far, the last one's description)."""
        state = self._read()
        failures, last = int(state.get("failures", 0)), str(state.get("last", ""))
        if state.get("running"):
            failures += 1
            last = f"a run that began {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(state.get('began', 0)))} never ended (killed or crashed)"
        self._write({"running": True, "began": time.time(), "failures": failures, "last": last})
        self._began = True
        return failures, last

    def end(self, clean: bool, why: str = "") -> None:
        """Record this run's end: ``clean`` (exit 0, or a terminal exit systemd does not restart).
        Nothing when this process recorded no start."""
        if not self._began:
            return
        self._began = False
        state = self._read()
        failures = int(state.get("failures", 0)) + (0 if clean else 1)
        last = str(state.get("last", "")) if clean else why
        self._write({"running": False, "failures": failures, "last": last})
