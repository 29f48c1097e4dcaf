"""The ``torchrun.handlers`` entry point (setup.py: ``petctl_agent.rendezvous:torchrun_handler``).

Free of torch imports on purpose: when this package is imported before torch's rendezvous
package, torch loads its entry points in the middle of our import, and finds this function
already there instead of a half-made package (torch would log "partially initialized module").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def torchrun_handler() -> Callable[[Any], Any]:
    """torch calls it and registers the creator it returns."""
    from petctl_agent.rendezvous.registry import create_handler

    return create_handler
