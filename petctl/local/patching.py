"""One way to patch moto for the local cloud: :func:`wrap` a method, once."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap(owner: Any, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``owner.name`` becomes the decorated function, called with the original method
    first (``fn(original, self, ...)``). Patching twice is a no-op, so ``apply()`` is idempotent.
    """

    def install(fn: Callable[..., Any]) -> Callable[..., Any]:
        original = getattr(owner, name, None)
        if getattr(original, "_petctl_patched", False):
            return original  # type: ignore[return-value]

        @functools.wraps(fn)
        def patched(*args: Any, **kwargs: Any) -> Any:
            return fn(original, *args, **kwargs)

        patched._petctl_patched = True  # type: ignore[attr-defined]
        setattr(owner, name, patched)
        return patched

    return install
