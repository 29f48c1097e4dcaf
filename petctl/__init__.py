"""petctl: elastic PyTorch training on AWS."""

import os
from pathlib import Path

__version__ = "0.1.0"


def home() -> Path:
    """The petctl state directory: ``$PETCTL_HOME`` (``~`` expanded, made absolute), else
    ``~/.petctl``. Standard library only: the CLI's config and the local cloud's state directory
    (``petctl.local.statedir``) both read it here."""
    d = os.environ.get("PETCTL_HOME")
    return Path(d).expanduser().absolute() if d else Path.home() / ".petctl"
