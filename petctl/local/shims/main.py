"""The shims' entry: one command line -> the shim of that name, and its way out (exit 2 and a
note in ``refused`` for what the local cloud does not model, the real command's code for what
fails)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from .aws import aws
from .base import Failed, Refused, log
from .dnf import dnf
from .journal import journalctl
from .mount import mount
from .net import curl, ip
from .pip import pip
from .power import shutdown
from .systemctl import systemctl
from .venv import python

COMMANDS = {
    "dnf": dnf,
    "mount": mount,
    "aws": aws,
    "curl": curl,
    "ip": ip,
    "python3.11": python,
    "pip": pip,
    "systemctl": systemctl,
    "journalctl": journalctl,
    "shutdown": shutdown,
}


def refusals_file(r: Path) -> Path:
    return r / "run" / "petctl-local" / "refused"


def _record_refusal(name: str, args: list[str], why: str) -> None:
    """Note the refusal where ``petctl local status`` shows it (``refused``): a boot script retries
    a failing command for minutes, and a refusal never gets better."""
    r = os.environ.get("PETCTL_LOCAL_ROOT")
    if not r:
        return
    try:
        path = refusals_file(Path(r))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{name} {shlex.join(args)}: {why}\n")
    except OSError:
        pass


def main(argv: list[str]) -> NoReturn:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m petctl.local.shims {{{','.join(COMMANDS)}}} ARGS…", file=sys.stderr)
        sys.exit(2)
    name, args = argv[0], argv[1:]
    try:
        COMMANDS[name](args)
    except Refused as e:
        log(name, f"REFUSED: {e}")
        _record_refusal(name, args, str(e))
        sys.exit(2)
    except Failed as e:
        if str(e):
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(e.rc)
    sys.stdout.flush()
    sys.exit(0)
