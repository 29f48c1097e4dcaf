"""Live membership: workers that survive a join, a drain or a loss (torchft, data-parallel only).

May import: the contracts (spec, settings, workarounds).
``upstream`` closes torchft 0.2.0's gaps (comm hook, binding, retries), ``lighthouse`` runs the
quorum server beside etcd, ``run`` is the training loop's face (a model and optimizer wrapper and
one call per step). Every module imports torchft lazily or behind this room, so the rest of the
agent never needs it.
"""

from petctl_agent.spec import TORCHFT_VERSION

__all__ = ["TORCHFT_VERSION"]
