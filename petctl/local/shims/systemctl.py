"""``systemctl``: units are parsed as the local systemd knows them (:func:`parse_unit`, which the
daemon's :mod:`petctl.local.boot` also starts them by), enabled by link, and started by the daemon."""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .base import Failed, Refused, env, log, root

WANTS = "multi-user.target.wants"
#: Unit file keys the local systemd knows. ``True``: emulated; a string: accepted, and why it
#: has no effect locally. Any other key is refused.
UNIT_KEYS: dict[str, dict[str, bool | str]] = {
    "Unit": {
        "Description": True,
        "RequiresMountsFor": True,
        "Wants": "ordering only (units start when enabled --now)",
        "After": "ordering only",
        "StartLimitIntervalSec": True,
        "StartLimitBurst": True,
        "OnFailure": True,
    },
    "Service": {
        "Type": True,
        "Environment": True,
        "ExecStart": True,
        "KillMode": True,
        "KillSignal": True,
        "TimeoutStartSec": True,
        "Restart": True,
        "RestartSec": True,
        "RestartPreventExitStatus": True,
        "TimeoutStopSec": "the local cloud SIGKILLs at the drain timeout + PETCTL_LOCAL_DRAIN_SLACK",
        "LimitNOFILE": "not applied (this machine's limit)",
    },
    "Install": {"WantedBy": True},
}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values…]}}; refuses unknown sections, keys and values."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            if section not in UNIT_KEYS:
                raise Refused(f"unit section [{section}] not emulated")
            out.setdefault(section, {})
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or section is None:
            raise Refused(f"unit line not understood: {line!r}")
        if key not in UNIT_KEYS[section]:
            raise Refused(f"unit key {section}.{key} not emulated (known: {', '.join(UNIT_KEYS[section])})")
        out[section].setdefault(key, []).append(value.strip())
    svc = out.get("Service", {})
    if len(svc.get("ExecStart", [])) != 1:
        raise Refused("a unit needs exactly one ExecStart=")
    if svc.get("Restart", ["no"])[-1] not in RESTARTS:
        raise Refused(f"Restart={svc['Restart'][-1]} not emulated ({', '.join(RESTARTS)})")
    if svc.get("Type", ["simple"])[-1] not in ("simple", "notify", "oneshot"):
        raise Refused(f"Type={svc['Type'][-1]} not emulated (simple, notify, oneshot)")
    for name in (n for v in out.get("Unit", {}).get("OnFailure", []) for n in v.split()):
        if not re.fullmatch(r"[A-Za-z0-9@_.-]+\.service", name):
            raise Refused(f"OnFailure={name}: only NAME.service units are emulated")
    if svc.get("KillMode", ["control-group"])[-1] not in ("control-group", "mixed", "process"):
        raise Refused(f"KillMode={svc['KillMode'][-1]} not emulated")
    if svc.get("KillSignal", ["SIGTERM"])[-1] not in ("SIGTERM", "SIGINT"):
        raise Refused(f"KillSignal={svc['KillSignal'][-1]} not emulated (SIGTERM, SIGINT)")
    wanted = out.get("Install", {}).get("WantedBy", [])
    if any(w != "multi-user.target" for w in wanted):
        raise Refused(f"WantedBy={' '.join(wanted)} not emulated (multi-user.target)")
    return out


#: What Restart= restarts after (systemd.service(5), table 1). ``no``, ``on-failure`` (not after a
#: "clean" exit: 0, or SIGHUP/SIGINT/SIGTERM/SIGPIPE) and ``always`` are emulated.
RESTARTS = ("no", "on-failure", "always")
CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)


def restart_verdict(
    spec: dict[str, dict[str, list[str]]], rc: int, starts: list[float], now: float
) -> str | None:
    """Whether systemd restarts a unit whose main process ended with ``rc`` (a Popen return code:
    negative for a signal): None to restart (after ``RestartSec``), else why not. ``starts``: the
    unit's earlier start times (monotonic), for ``StartLimitIntervalSec``/``StartLimitBurst``
    (defaults 10 s and 5: more starts than that within the interval and the unit stays failed).

    As systemd.service(5) documents: ``Restart=on-failure`` restarts on a non-zero exit status or
    an unclean signal, ``always`` on any exit; ``RestartPreventExitStatus=`` lists exit statuses (numbers or signal
    names) that are not restarted whatever ``Restart=`` says."""
    svc, unit = spec.get("Service", {}), spec.get("Unit", {})
    mode = svc.get("Restart", ["no"])[-1]
    if mode not in RESTARTS:
        raise Refused(f"Restart={mode} not emulated ({', '.join(RESTARTS)})")
    prevent: set[str] = set()
    for value in svc.get("RestartPreventExitStatus", []):
        prevent = set() if not value else prevent | set(value.split())
    signame = signal.Signals(-rc).name if rc < 0 else None
    if mode == "no":
        return "Restart=no"
    if mode == "on-failure" and (rc == 0 or (signame and signal.Signals[signame] in CLEAN_SIGNALS)):
        return f"exited cleanly ({signame or 'status 0'})"
    if str(rc) in prevent or (signame and (signame in prevent or signame[3:] in prevent)):
        return f"status {signame or rc} is in RestartPreventExitStatus="
    interval = _seconds(unit.get("StartLimitIntervalSec", ["10"])[-1])
    burst = int(unit.get("StartLimitBurst", ["5"])[-1])
    if interval > 0 and sum(1 for t in starts if now - t < interval) >= burst:
        return f"start limit hit ({burst} starts within {interval:g}s)"
    return None


def on_failure(
    spec: dict[str, dict[str, list[str]]], unit: str, rc: int, why: str
) -> tuple[list[str], dict[str, str]]:
    """What systemd starts when ``unit``'s main process ended with ``rc`` (a Popen return code)
    and is not restarted (``why``, from :func:`restart_verdict`): its ``OnFailure=`` units if
    the unit ends "failed" -- a non-zero status, an unclean signal, or its start limit hit
    (systemd.unit(5)) -- with the ``MONITOR_*`` variables systemd.exec(5) gives them. A clean
    end (status 0, SIGHUP/SIGINT/SIGTERM/SIGPIPE) starts nothing."""
    names: list[str] = []
    for value in spec.get("Unit", {}).get("OnFailure", []):
        names = [] if not value else names + value.split()
    limit = why.startswith("start limit hit")
    sig = signal.Signals(-rc) if rc < 0 else None
    if not names or not (limit or (rc != 0 and sig not in CLEAN_SIGNALS)):
        return [], {}
    env = {
        "MONITOR_UNIT": unit,
        "MONITOR_SERVICE_RESULT": "start-limit-hit" if limit else "signal" if sig else "exit-code",
        "MONITOR_EXIT_CODE": "killed" if sig else "exited",
        "MONITOR_EXIT_STATUS": sig.name[3:] if sig else str(rc),
    }
    return names, env


def restart_delay(spec: dict[str, dict[str, list[str]]]) -> float:
    """``RestartSec`` in seconds (default 100 ms)."""
    return _seconds(spec.get("Service", {}).get("RestartSec", ["100ms"])[-1])


def _seconds(value: str) -> float:
    """A systemd time span: ``10``, ``10s``, ``100ms``, ``5min``, ``infinity`` (0: no limit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|min|m|h)?\s*", value)
    if value.strip() == "infinity":
        return 0.0
    if not m:
        raise Refused(f"time span {value!r} not understood")
    unit = {"ms": 0.001, "min": 60, "m": 60, "h": 3600}.get(m.group(2) or "s", 1)
    return float(m.group(1)) * unit


def systemctl(args: list[str]) -> None:
    """``systemctl daemon-reload`` and ``systemctl enable [--now] UNIT.service``."""
    if args == ["daemon-reload"]:
        return  # units are read when they start
    if len(args) in (2, 3) and args[0] == "enable" and (len(args) == 2 or "--now" in args[1:]):
        names = [a for a in args[1:] if a != "--now"]
        if len(names) != 1 or not re.fullmatch(r"[A-Za-z0-9@_.-]+\.service", names[0]):
            raise Refused(f"give one UNIT.service, not {names}")
        unit = names[0]
        path = root() / "etc" / "systemd" / "system" / unit
        if not path.is_file():
            raise Failed(f"Failed to enable unit: Unit file {unit} does not exist.", 1)
        spec = parse_unit(path.read_text())
        if spec.get("Install", {}).get("WantedBy"):
            wants = path.parent / WANTS
            wants.mkdir(exist_ok=True)
            link = wants / unit
            if not link.is_symlink():
                link.symlink_to(Path("..") / unit)
                print(f"Created symlink {link} \u2192 {path}.", file=sys.stderr)
        if "--now" in args:
            _start_via_daemon(unit)
        return
    raise Refused(
        f"only 'systemctl daemon-reload' and 'systemctl enable [--now] UNIT' are emulated, not: systemctl {shlex.join(args)}"
    )


def _start_via_daemon(unit: str) -> None:
    url = env("PETCTL_LOCAL_SYSTEMD") + "/start/" + unit
    req = urllib.request.Request(
        url, method="POST", data=b"", headers={"X-Petctl-Systemd-Token": env("PETCTL_LOCAL_SYSTEMD_TOKEN")}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error")
        except ValueError:
            why = f"HTTP {e.code}"
        raise Failed(
            f"Job for {unit} failed: {why}\nSee the instance log (petctl local logs <instance>) for details.",
            1,
        ) from e
    log("systemctl", f"started {unit}: main pid {answer.get('pid')}")
