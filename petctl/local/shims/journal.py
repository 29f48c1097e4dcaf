"""``journalctl -u UNIT [-n N] [-o cat] [--no-pager]``: a unit's last output lines.

The local systemd writes each unit's output to the instance log (``<state>/logs/<id>.log``),
after a ``==> petctl local systemd: starting UNIT: ...`` line at each start; the journal of
``UNIT`` is every such stretch, up to the next ``==>`` line. The boot script's own output, which
goes to the same log, may interleave (journald keeps it apart on AWS)."""

from __future__ import annotations

import re
import shlex

from .base import Refused, env, state_dir

_START = "==> petctl local systemd: starting "


def journalctl(args: list[str]) -> None:
    unit, lines, i = None, 10, 0
    while i < len(args):
        a = args[i]
        if a in ("-u", "--unit", "-n", "--lines", "-o", "--output") and i + 1 < len(args):
            value = args[i + 1]
            if a in ("-u", "--unit"):
                unit = value
            elif a in ("-n", "--lines"):
                if not value.isdigit():
                    raise Refused(f"-n {value!r}: give a number of lines")
                lines = int(value)
            elif value != "cat":
                raise Refused(f"-o {value}: only -o cat is emulated")
            i += 2
        elif a == "--no-pager":
            i += 1
        else:
            raise Refused(
                f"only 'journalctl -u UNIT [-n N] [-o cat] [--no-pager]' is emulated, not: {shlex.join(args)}"
            )
    if not unit or not re.fullmatch(r"[A-Za-z0-9@_.-]+\.service", unit):
        raise Refused("give -u UNIT.service")
    path = state_dir() / "logs" / f"{env('PETCTL_LOCAL_INSTANCE_ID')}.log"
    out: list[str] = []
    mine = False
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        text = ""
    for line in text.splitlines():
        if line.startswith("==> "):
            mine = line.startswith(f"{_START}{unit}:")
            continue
        if mine:
            out.append(line)
    if not out:
        print("-- No entries --")
    for line in out[-lines:] if lines else []:
        print(line)
