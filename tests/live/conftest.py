"""Live membership tests: real lighthouse and replica-group processes on 127.0.0.1 (gloo).

torchft ships x86_64 wheels only: where it cannot import (aarch64, or an install without the
``live`` extra) every test here skips and says why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the harness lives in bench/ (bench/bench_live.py drives the same processes)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

try:
    import torchft  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the platform
    pytest.skip(
        f"torchft does not import here ({e}): live mode needs torchft==0.2.0 (x86_64 wheels only; "
        "pip install -e '.[live]')",
        allow_module_level=True,
    )
