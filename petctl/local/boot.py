"""How a local cloud instance boots: it runs the user data of its launch template, as AWS does.

The reconciler reads the instance's user data from moto (the launch template version the
instance was launched from, else the instance's own ``userData``), base64-decoded, with
CloudFormation's ``Fn::Sub`` already resolved by moto's CloudFormation, and runs it with bash:

* **paths**: every absolute path under ``/etc``, ``/mnt``, ``/opt``, ``/var``, ``/run`` and
  ``/srv`` in the script text is rewritten to the same path under the instance's root
  directory, ``<state>/instances/<id>/root`` (so ``/mnt/efs`` is ``<root>/mnt/efs``,
  ``/var/log/petctl-boot.log`` is ``<root>/var/log/petctl-boot.log``). The root is written
  literally (it is checked to need no shell quoting), so the rewrite holds inside any quotes
  and heredoc. ``/dev``, ``/proc``, ``/usr``, ``/bin``, ``/tmp`` are left alone.
* **loopback**: ``127.0.0.1`` in the script text becomes the instance's private IP (all local
  instances share this machine's loopback; each one's private IP is its own 127.x address), so
  two rendezvous servers' ``127.0.0.1:2380`` never collide.
* **commands**: ``PATH`` is only the instance's ``bin/``: the shims of
  :mod:`petctl.local.shims` (``dnf``, ``mount``, ``systemctl``, ``aws``, ``curl``, ``ip``,
  ``python3.11``, ``shutdown``) and links to a fixed list of harmless host tools (:data:`HOST_TOOLS`). A
  command outside both is "command not found": the boot fails loudly rather than run a host
  program the local cloud does not model (the daemon may run as root).
* **systemd**: ``systemctl enable --now`` asks the daemon (:func:`start_unit`) to start the
  unit's ``ExecStart`` as a process of the instance, with the unit's ``Environment=``.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from petctl.local import etcd_release, shims

#: Top-level directories of the instance's file system that live in its root directory.
MAPPED_DIRS = ("etc", "mnt", "opt", "var", "run", "srv")
#: Created in every root (what the AMI has).
SKELETON = ("etc/systemd/system", "mnt", "opt", "var/lib", "var/log", "run", "srv", "tmp", "root")
#: Host programs a boot script may run besides the shims (text and file tools, nothing that
#: changes the host outside the instance's paths on its own). ``openssl`` runs for real: the
#: rendezvous boot makes etcd's server key and certificate with it (in the instance's mapped
#: ``/etc/petctl/tls``), exactly as on Amazon Linux 2023; ``sha256sum``, ``tar`` and ``gzip``
#: check and unpack its etcd tarball into the mapped ``/opt/etcd/bin``.
HOST_TOOLS = (
    "bash", "sh", "env", "cat", "tee", "date", "sleep", "mkdir", "rmdir", "basename", "dirname",
    "wc", "grep", "cut", "paste", "sed", "tr", "head", "tail", "sort", "uniq", "seq", "printf",
    "echo", "true", "false", "test", "ls", "cp", "mv", "ln", "rm", "touch", "chmod", "stat",
    "readlink", "realpath", "mktemp", "id", "uname", "hostname", "nproc", "xargs",
    "openssl", "tar", "gzip", "sha256sum",
)  # fmt: skip
SHIMS = ("dnf", "mount", "systemctl", "journalctl", "aws", "curl", "ip", "python3.11", "shutdown")
_PATH_RE = re.compile(r"(?<![^\s\"'=(:><,`;|&\[])/(" + "|".join(MAPPED_DIRS) + r")(?=/|$|[\s\"');|&`])")
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_./+-]+$")
_LOOPBACK_RE = re.compile(r"(?<![\d.])127\.0\.0\.1(?![\d])")


class BootError(Exception):
    """The instance cannot boot (no usable user data, an unsafe state dir)."""


def user_data(clients: dict[str, Any], instance_id: str, tags: dict[str, str], cache: dict[str, str]) -> str:
    """The instance's user data, decoded: from the launch template version it was launched from
    (tags ``aws:ec2launchtemplate:id``/``version``), else from the instance attribute."""
    lt_id, lt_ver = tags.get("aws:ec2launchtemplate:id"), tags.get("aws:ec2launchtemplate:version")
    key = f"{lt_id}:{lt_ver}"
    if lt_id and key in cache:
        return cache[key]
    if lt_id:
        versions = clients["ec2"].describe_launch_template_versions(
            LaunchTemplateId=lt_id, Versions=[lt_ver or "$Latest"]
        )["LaunchTemplateVersions"]
        raw = versions[0]["LaunchTemplateData"].get("UserData", "") if versions else ""
    else:
        raw = (
            clients["ec2"]
            .describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
            .get("UserData", {})
            .get("Value", "")
        )
    text = base64.b64decode(raw or "").decode("utf-8", errors="replace")
    if lt_id and (lt_ver or "").isdigit():  # a numbered version never changes
        cache[key] = text
    return text


def rewrite(script: str, root: Path, loopback: str | None = None) -> str:
    """``script`` with its instance paths moved into ``root``, and ``127.0.0.1`` made the
    instance's own ``loopback`` address (see the module doc)."""
    if not _SAFE_PATH.match(str(root)):
        raise BootError(f"the instance root {root} needs shell quoting: use a plainer PETCTL_LOCAL_DIR")
    script = _PATH_RE.sub(lambda m: f"{root}/{m.group(1)}", script)
    if loopback:
        script = _LOOPBACK_RE.sub(loopback, script)
    return script


def check_script(script: str) -> None:
    first = script.split("\n", 1)[0]
    if not script.strip():
        raise BootError("the launch template has no user data: nothing boots this instance")
    if first not in ("#!/bin/bash", "#!/bin/sh", "#!/usr/bin/env bash"):
        raise BootError(
            f"user data starting {first[:40]!r} is not a bash script (only those are run locally)"
        )
    if "\n" not in script.rstrip("\n"):
        raise BootError("the user data is only a #! line")


def prepare(
    inst_dir: Path, script: str, loopback: str | None = None, etcd_sha256: str | None = None
) -> tuple[Path, Path, Path]:
    """Make the instance's root and bin dirs and write its (rewritten) boot script; with
    ``etcd_sha256``, the pinned etcd release hashes in it become that of the local cloud's
    stand-in tarball (:mod:`petctl.local.etcd_release`). Returns (root, bin dir, script path)."""
    root = inst_dir / "root"
    for d in SKELETON:
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc" / "fstab").touch()
    bin_dir = inst_dir / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in SHIMS:
        path = bin_dir / name
        path.write_text(
            f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(str(shims.SCRIPT))} {name} "$@"\n'
        )
        path.chmod(0o755)
    for tool in HOST_TOOLS:
        found = shutil.which(tool, path=os.defpath + ":/usr/local/bin:/usr/bin:/bin")
        link = bin_dir / tool
        if found and not link.exists():
            link.symlink_to(found)
    path = inst_dir / "user-data.sh"
    if etcd_sha256 is not None:
        script = etcd_release.substitute(script, etcd_sha256)
    path.write_text(rewrite(script, root, loopback))
    return root, bin_dir, path


def boot_env(base: dict[str, str], root: Path, bin_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(
        PATH=str(bin_dir),
        HOME=str(root / "root"),
        TMPDIR=str(root / "tmp"),
        LC_ALL="C",
        **extra,
    )
    return env


# ----------------------------------------------------------------------------- systemd


def unit_path(root: Path, unit: str) -> Path:
    return root / "etc" / "systemd" / "system" / unit


def enabled_units(root: Path) -> list[str]:
    wants = root / "etc" / "systemd" / "system" / shims.WANTS
    return sorted(p.name for p in wants.glob("*.service")) if wants.is_dir() else []


def _seconds(value: str, default: float) -> float:
    v = value.strip().lower()
    if v in ("infinity", "0"):
        return 86400.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", v)
    if not m:
        raise shims.Refused(f"time span {value!r} not understood")
    n = float(m.group(1))
    return n * 60 if m.group(2) in ("min", "m") else n if v else default


class Unit:
    """One started unit of an instance (what systemd would track as its main process)."""

    def __init__(self, name: str, proc: subprocess.Popen, kill_mode: str, kill_signal: int) -> None:
        self.name, self.proc, self.kill_mode, self.kill_signal = name, proc, kill_mode, kill_signal

    def stop_signal(self) -> None:
        """KillSignal to the main process (KillMode=mixed/process) or to all of its processes."""
        try:
            if self.kill_mode == "control-group":
                os.killpg(self.proc.pid, self.kill_signal)
            elif self.proc.poll() is None:
                os.kill(self.proc.pid, self.kill_signal)
        except (ProcessLookupError, PermissionError):
            pass


def start_unit(
    root: Path, state_dir: Path, unit: str, env: dict[str, str], out: IO[bytes], aws: Any, az: str
) -> tuple[Unit, float | None]:
    """Start ``unit`` of the instance whose root is ``root``: its ``ExecStart`` in a new session,
    with ``env`` plus its ``Environment=``. Returns the unit and, for ``Type=notify``, the
    deadline by which it must report ``READY=1`` (see :func:`wait_ready`).

    Raises :class:`petctl.local.shims.Refused` for what is not emulated and ``RuntimeError`` for a
    unit that cannot start (as ``systemctl start`` fails)."""
    path = unit_path(root, unit)
    if not path.is_file():
        raise RuntimeError(f"Unit {unit} not found.")
    spec = shims.parse_unit(path.read_text())
    svc, unit_sec = spec.get("Service", {}), spec.get("Unit", {})
    for mp in (p for v in unit_sec.get("RequiresMountsFor", []) for p in v.split()):
        _require_mount(root, state_dir, mp, aws, az)
    argv = shlex.split(svc["ExecStart"][0])
    if not argv or argv[0][:1] in "-@+!:" or "$" in svc["ExecStart"][0]:
        raise shims.Refused(f"ExecStart={svc['ExecStart'][0]!r}: prefixes and $VARIABLES are not emulated")
    if not os.path.isabs(argv[0]) or not os.access(argv[0], os.X_OK):
        raise RuntimeError(f"ExecStart {argv[0]} is not an executable absolute path")
    env = dict(env)
    for line in svc.get("Environment", []):
        for item in shlex.split(line):
            k, eq, v = item.partition("=")
            if not eq:
                raise shims.Refused(f"Environment={line!r}: not NAME=VALUE")
            env[k] = v
    notify = svc.get("Type", ["simple"])[-1] == "notify"
    sock = None
    if notify:
        name = f"petctl-local-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind("\0" + name)
        env["NOTIFY_SOCKET"] = "@" + name
    out.write(f"==> petctl local systemd: starting {unit}: {shlex.join(argv)}\n".encode())
    out.flush()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(root),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, like systemd's cgroup per unit
            close_fds=True,
        )
    except OSError as e:
        if sock:
            sock.close()
        raise RuntimeError(f"cannot execute {argv[0]}: {e}") from e
    kill_signal = getattr(signal, svc.get("KillSignal", ["SIGTERM"])[-1])
    u = Unit(unit, proc, svc.get("KillMode", ["control-group"])[-1], kill_signal)
    u.notify_sock = sock  # type: ignore[attr-defined]
    timeout = _seconds(svc.get("TimeoutStartSec", ["90"])[-1], 90.0)
    return u, (time.monotonic() + timeout) if notify else None


def wait_ready(u: Unit, deadline: float | None) -> None:
    """For ``Type=notify``: wait for ``READY=1`` on the unit's notify socket; RuntimeError if the
    process exits or the start timeout passes first (the unit is then killed, as systemd does)."""
    sock = getattr(u, "notify_sock", None)
    if sock is None or deadline is None:
        return
    try:
        sock.settimeout(0.1)
        while True:
            try:
                msg = sock.recv(4096).decode(errors="replace")
                if "READY=1" in msg.split("\n"):
                    return
            except TimeoutError:
                pass
            if u.proc.poll() is not None:
                raise RuntimeError(f"{u.name}: main process exited (code {u.proc.returncode}) before READY=1")
            if time.monotonic() > deadline:
                try:
                    os.killpg(u.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                raise RuntimeError(f"{u.name}: start operation timed out (no READY=1). Terminating.")
    finally:
        sock.close()


def _require_mount(root: Path, state_dir: Path, mountpoint: str, aws: Any, az: str) -> None:
    """RequiresMountsFor: mounted already, or mounted now from the instance's /etc/fstab (as
    systemd does); otherwise the unit fails. ``aws``: service name -> the daemon's moto client."""
    r = Path(mountpoint)
    rel = "/" + str(r.relative_to(root)) if root in r.parents else mountpoint
    if rel in shims.mounted(root):
        return
    entry = shims.fstab_entry(root, r)
    if entry is None:
        raise RuntimeError(f"RequiresMountsFor={mountpoint}: not mounted and not in /etc/fstab")
    source, fstype, options = entry
    if fstype != "efs":
        raise shims.Refused(f"fstab type {fstype} not emulated (efs)")
    r.mkdir(parents=True, exist_ok=True)
    shims.efs_mount(
        root,
        state_dir,
        source,
        r,
        options - {"_netdev", "defaults"},
        az=az,
        aws=aws,
        instance_id=root.parent.name,
    )
