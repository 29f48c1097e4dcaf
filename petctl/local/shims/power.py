"""``shutdown``: the instance powers itself off, now or in N minutes, as systemd's ``shutdown`` does;
the daemon carries it out (:meth:`petctl.local.leaving.Leaving.os_shutdown`): every process of the
instance is stopped, EC2 stops the instance, and its group replaces it (a stopped instance is
unhealthy to the group's EC2 health check).

Modelled: ``shutdown [-h|-P|--poweroff] [now|+N] [WALL…]`` (no time: ``+1``, systemd's default;
a second call replaces the schedule) and ``shutdown -c``. Refused: a reboot (``-r``), a halt that
does not power off (``-H``), ``-k``, a clock time (``hh:mm``).
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.error
import urllib.parse
import urllib.request

from .base import Failed, Refused, env, log


def parse(args: list[str]) -> float | None:
    """Minutes until the power-off (0: now), or None for ``-c`` (cancel)."""
    rest = list(args)
    cancel = False
    while rest and rest[0].startswith("-"):
        opt = rest.pop(0)
        if opt in ("-h", "-P", "--poweroff"):
            continue
        if opt == "-c":
            cancel = True
            continue
        raise Refused(f"shutdown {opt} is not emulated (power-off only: -h, -P, --poweroff, -c)")
    if cancel:
        return None
    when = rest[0] if rest else "+1"
    if when == "now":
        return 0.0
    m = re.fullmatch(r"\+?(\d+)", when)
    if not m:
        raise Refused(f"shutdown time {when!r} is not emulated (now, +N minutes)")
    return float(m.group(1))


def shutdown(args: list[str]) -> None:
    minutes = parse(args)
    query = "cancel=1" if minutes is None else f"minutes={minutes:g}"
    url = env("PETCTL_LOCAL_SYSTEMD") + "/shutdown?" + query
    req = urllib.request.Request(
        url, method="POST", data=b"", headers={"X-Petctl-Systemd-Token": env("PETCTL_LOCAL_SYSTEMD_TOKEN")}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error")
        except ValueError:
            why = f"HTTP {e.code}"
        raise Failed(f"Failed to schedule shutdown: {why}", 1) from e
    log("shutdown", f"{shlex.join(['shutdown', *args])}: {answer.get('scheduled', 'cancelled')}")
