"""A live job's state on the shared filesystem, for the one loss its peers cannot cover: all of them.

A live job keeps its state in its workers: a newcomer pulls it from a live peer, nothing is read
back from disk. So when every replica group is gone at once (the last node of the job lost, every
spot node reclaimed in one notice), the next workers would start from step 0 without a word. Here
the quorum's first replica group writes the model, the optimizer and the manager's step counts to
``$PETCTL_CHECKPOINT_DIR/live.pt`` every ``PETCTL_LIVE_CHECKPOINT_SECONDS`` (300; 0: never)
after a committed step, atomically (a temporary file, fsync, rename); a worker that starts loads it
before its first quorum. The first quorum then does the rest: a worker that loaded an older step
than its live peers hold heals from them (torchft takes the highest step), and workers that all
loaded it go on from it.

The write blocks its replica group for its length (the others wait at the next step's
all-reduce): about the state's size over the filesystem's write rate, every interval.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from petctl_agent import knobs

log = logging.getLogger("petctl_agent.live")

FILE = "live.pt"
DEFAULT_SECONDS = 300.0


class Durable:
    """The live state's copy on the shared filesystem (see the module's docstring)."""

    def __init__(self, directory: str | None, every_s: float) -> None:
        self.dir = Path(directory) if directory else None
        self.every_s = every_s
        self._last = time.monotonic()

    @classmethod
    def from_env(cls, env: Any) -> Durable:
        every = float(env.get("PETCTL_LIVE_CHECKPOINT_SECONDS") or DEFAULT_SECONDS)
        if every < 0:
            raise RuntimeError(f"PETCTL_LIVE_CHECKPOINT_SECONDS={every:g}: give seconds (0: never)")
        return cls(knobs.checkpoint_dir(env), every)

    @property
    def path(self) -> Path | None:
        return self.dir / FILE if self.dir is not None else None

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, manager: Any) -> int | None:
        """Put the saved state into ``model``, ``optimizer`` and ``manager``; the step it holds, or
        None when there is none. A file that does not load raises: a silent fresh start is the
        loss this exists to prevent."""
        path = self.path
        if path is None or not path.exists():
            return None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            sd = torch.load(path, map_location=device, weights_only=True)
        except Exception as e:
            raise RuntimeError(
                f"{path} does not load ({type(e).__name__}: {e}): move it away to start afresh"
            ) from e
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        manager.load_state_dict(sd["manager"])
        log.info("live state loaded from %s at step %d", path, sd["manager"]["step"])
        return int(sd["manager"]["step"])

    def due(self) -> bool:
        return self.path is not None and self.every_s > 0 and time.monotonic() - self._last >= self.every_s

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, manager: Any) -> float:
        """Write the state now (the caller is the quorum's first replica group); seconds taken."""
        path = self.path
        assert path is not None
        t0 = time.monotonic()
        self._last = t0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
        state = {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "manager": manager.state_dict(),
        }
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself
        finally:
            os.close(fd)
        took = time.monotonic() - t0
        log.info("live state saved to %s at step %d in %.2fs", path, manager.current_step(), took)
        return took

    def skip(self) -> None:
        """Not ours to write this time (another group is the quorum's first): wait a full interval."""
        self._last = time.monotonic()
