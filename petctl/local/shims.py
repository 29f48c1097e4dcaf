"""Host-command shims of the local cloud: what a local instance's boot script runs instead of
``dnf``, ``mount``, ``systemctl``, ``aws``, ``curl``, ``ip``, ``python3.11`` and ``pip``.

Every instance of the local cloud boots by running the user data of its launch template (the
same bash AWS runs; see :mod:`petctl.local.boot`). Its ``PATH`` starts with a per-instance
``bin/`` of small wrappers, ``exec <python> -I shims.py <command> "$@"``. Each shim does exactly
what the boot scripts need, against the local cloud (moto for AWS calls, the instance's IMDS
emulator, the ``efs/`` directory, the daemon's systemd emulation), and **refuses anything else
loudly** (exit 2 with ``<command> (petctl local shim): …`` on stderr), so a boot script that
starts to depend on something the local cloud does not model fails its tests instead of
silently passing. docs/local.md lists each shim and what it refuses.

Standard library only at import time (boto3, jmespath and packaging are imported by the shims
that need them): the boot runs a dozen of these, and each costs a Python start.

Context (set by the reconciler in the boot script's environment):

``PETCTL_LOCAL_ROOT``           the instance's root directory (``/etc``, ``/opt``, … map into it)
``PETCTL_LOCAL_STATE``          the local cloud's state dir (``efs/``, ``venvs/``)
``PETCTL_LOCAL_IMDS``           the instance's IMDS base URL (``http://127.0.0.1:<port>/<id>``)
``PETCTL_LOCAL_INSTANCE_ID``    the instance id; ``PETCTL_LOCAL_AZ`` its availability zone
``PETCTL_LOCAL_JOB``            its ``petctl:job`` tag (the per-job environment cache key)
``PETCTL_LOCAL_SYSTEMD``        the daemon's systemd endpoint for this instance, and
``PETCTL_LOCAL_SYSTEMD_TOKEN``  the token it requires
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, NoReturn

IMDS_URL = "http://169.254.169.254"
#: dnf packages the boot scripts install, and what stands in for each locally.
DNF_PACKAGES = {
    "amazon-efs-utils": "the mount shim (mount -t efs onto the local EFS directory)",
    "python3.11": "the python3.11 shim (venvs of this machine's Python)",
    "python3.11-pip": "the pip shim of those venvs",
    "openssl": "this machine's openssl (a host tool of every instance)",
}
#: Where a pip --index-url may point (the boot scripts' CPU torch index, and PyPI's).
PIP_INDEXES = ("https://download.pytorch.org/whl/cpu", "https://pypi.org/simple")
EFS_MOUNT_OPTIONS = {"tls", "noresvport", "_netdev", "iam", "rw"}
WANTS = "multi-user.target.wants"


class Refused(Exception):
    """The shim does not do this (exit 2)."""


class Failed(Exception):
    """The command failed as the real one would (exit code ``rc``)."""

    def __init__(self, message: str, rc: int = 1) -> None:
        super().__init__(message)
        self.rc = rc


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise Refused(f"{name} is not set: this shim only runs inside a local cloud instance")
    return value


def root() -> Path:
    return Path(_env("PETCTL_LOCAL_ROOT"))


def state_dir() -> Path:
    return Path(_env("PETCTL_LOCAL_STATE"))


def log(cmd: str, message: str) -> None:
    print(f"{cmd} (petctl local shim): {message}", file=sys.stderr, flush=True)


def _inside_root(path: str, what: str) -> Path:
    """``path`` as given by the (rewritten) boot script: it must lie in the instance's root."""
    p = Path(path)
    r = root()
    if not p.is_absolute() or not (p == r or r in p.parents):
        raise Refused(
            f"{what} {path!r} is outside the instance's root {r} (the boot script's paths are mapped there)"
        )
    return p


# ----------------------------------------------------------------------------- dnf


def dnf(args: list[str]) -> None:
    """``dnf install -y PKG…``: nothing is installed; each package must have a local stand-in."""
    rest = [a for a in args if a not in ("-y", "--assumeyes", "-q", "--quiet")]
    if "-y" not in args and "--assumeyes" not in args:
        raise Refused(
            f"only 'dnf install -y PKG...' is emulated (a boot has no one to answer a prompt): {args}"
        )
    if not rest or rest[0] != "install" or len(rest) < 2:
        raise Refused(f"only 'dnf install -y PKG...' is emulated, not: dnf {shlex.join(args)}")
    unknown = [p for p in rest[1:] if p not in DNF_PACKAGES]
    if unknown:
        raise Refused(
            f"no local stand-in for package(s) {', '.join(unknown)}: add one to petctl/local/shims.py "
            f"(DNF_PACKAGES) and docs/local.md"
        )
    for p in rest[1:]:
        log("dnf", f"{p}: not installed; provided by {DNF_PACKAGES[p]}")


# ----------------------------------------------------------------------------- mount


def mounts_file(r: Path) -> Path:
    return r / "run" / "petctl-local" / "mounts.json"


def mounted(r: Path) -> dict[str, str]:
    """Mount point (path inside the root) -> what is mounted there (``fs-…:/``)."""
    try:
        return json.loads(mounts_file(r).read_text())
    except (OSError, ValueError):
        return {}


def efs_mount(
    r: Path, state: Path, source: str, target: Path, options: set[str], efs: Any = None, az: str | None = None
) -> None:
    """Mount EFS ``source`` (``fs-id:/``) at ``target``: the target directory becomes a symlink to
    ``<state>/efs/<fs-id>``. Checks what mount.efs would: the file system exists and has a mount
    target in this instance's zone; the mount point is an existing directory, not mounted yet."""
    m = re.fullmatch(r"(fs-[0-9a-f]{8,40}):(/.*)", source)
    if not m:
        raise Refused(f"mount -t efs needs SOURCE fs-<id>:/ (got {source!r})")
    fs_id, sub = m.groups()
    if sub != "/":
        raise Refused(f"only the file system's root (fs-id:/) is mounted, not {sub!r}")
    bad = options - EFS_MOUNT_OPTIONS
    if bad:
        raise Refused(
            f"mount option(s) {', '.join(sorted(bad))} not emulated (known: {', '.join(sorted(EFS_MOUNT_OPTIONS))})"
        )
    key = "/" + str(target.relative_to(r)) if target != r else "/"
    if key in mounted(r) or target.is_symlink():
        raise Failed(f"mount: {target}: {source} already mounted or mount point busy.", 32)
    if not target.is_dir():
        raise Failed(f"mount: {target}: mount point does not exist.", 32)
    efs = efs or _client("efs")
    try:
        efs.describe_file_systems(FileSystemId=fs_id)
        targets = efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]
    except Exception as e:  # noqa: BLE001 - reported as mount.efs would
        raise Failed(f"mount.efs: cannot find file system {fs_id}: {e}", 32) from e
    az = az or os.environ.get("PETCTL_LOCAL_AZ")
    if az and not any(t.get("AvailabilityZoneName") == az for t in targets):
        raise Failed(f"mount.efs: file system {fs_id} has no mount target in {az} (this instance's zone)", 32)
    if any(target.iterdir()):
        raise Failed(f"mount: {target}: mount point is not empty (the local cloud mounts by symlink)", 32)
    efs_dir = state / "efs" / fs_id
    efs_dir.mkdir(parents=True, exist_ok=True)
    target.rmdir()
    target.symlink_to(efs_dir, target_is_directory=True)
    table = mounted(r)
    table[key] = source
    mounts_file(r).parent.mkdir(parents=True, exist_ok=True)
    mounts_file(r).write_text(json.dumps(table, indent=2))


def fstab_entry(r: Path, mountpoint: Path) -> tuple[str, str, set[str]] | None:
    """(source, type, options) of the instance's /etc/fstab line for ``mountpoint``."""
    try:
        lines = (r / "etc" / "fstab").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) >= 4 and not f[0].startswith("#") and f[1] == str(mountpoint):
            return f[0], f[2], set(f[3].split(","))
    return None


def mount(args: list[str]) -> None:
    """``mount -t efs [-o OPTS] fs-id:/ DIR``."""
    fstype, options, pos = None, "", []
    it = iter(args)
    for a in it:
        if a == "-t":
            fstype = next(it, None)
        elif a == "-o":
            options = next(it, "")
        elif a.startswith("-"):
            raise Refused(f"option {a} not emulated: only 'mount -t efs [-o OPTS] fs-id:/ DIR'")
        else:
            pos.append(a)
    if fstype != "efs" or len(pos) != 2:
        raise Refused(f"only 'mount -t efs [-o OPTS] fs-id:/ DIR' is emulated, not: mount {shlex.join(args)}")
    r = root()
    target = _inside_root(pos[1], "mount point")
    efs_mount(r, state_dir(), pos[0], target, {o for o in options.split(",") if o})
    log("mount", f"{pos[0]} on {pos[1]} -> {state_dir() / 'efs' / pos[0].split(':')[0]}")


# ----------------------------------------------------------------------------- AWS clients


def _client(service: str) -> Any:
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if not re.match(r"^http://127\.\d+\.\d+\.\d+:\d+/?$", endpoint):
        raise Refused(
            f"AWS_ENDPOINT_URL={endpoint!r} is not the local cloud's moto server: refusing to call AWS"
        )
    import boto3

    return boto3.session.Session().client(
        service, endpoint_url=endpoint, region_name=os.environ.get("AWS_REGION", "us-east-1")
    )


# ----------------------------------------------------------------------------- aws


def _aws_text(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return "\t".join(_aws_text(v) for v in value)
    raise Refused("--output text of a structure is not emulated: --query it down to scalars")


def _aws_print(result: dict[str, Any], query: str | None, output: str) -> None:
    result = {k: v for k, v in result.items() if k != "ResponseMetadata"}
    if query:
        import jmespath

        result = jmespath.search(query, result)
    if output == "text":
        print(_aws_text(result))
    elif result not in (None, {}):
        print(json.dumps(result, indent=4, default=str))


def _s3_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise Refused(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[5:].partition("/")
    return bucket, key


def _opts(args: list[str], spec: dict[str, str]) -> dict[str, Any]:
    """Parse ``--name VALUE`` / ``--flag`` options; ``spec`` maps each allowed name to
    ``value`` | ``values`` | ``flag``. Anything else is refused."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        kind = spec.get(a)
        if kind is None:
            raise Refused(f"argument {a!r} not emulated here (allowed: {' '.join(sorted(spec))})")
        if kind == "flag":
            out[a] = True
            i += 1
        elif kind == "value":
            if i + 1 >= len(args):
                raise Refused(f"{a} needs a value")
            out[a] = args[i + 1]
            i += 2
        else:  # values: until the next option
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            out[a] = args[i + 1 : j]
            i = j
    return out


def aws(args: list[str]) -> None:
    """The AWS CLI calls the boot scripts make, against the local cloud's moto server."""
    globs: dict[str, str] = {"--output": "json"}
    rest = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--region", "--output", "--query"):
            if i + 1 >= len(args):
                raise Refused(f"{a} needs a value")
            globs[a] = args[i + 1]
            i += 2
        elif a in ("--only-show-errors", "--no-cli-pager"):
            globs[a] = "1"
            i += 1
        else:
            rest.append(a)
            i += 1
    region = os.environ.get("AWS_REGION", "us-east-1")
    if globs.get("--region", region) != region:
        raise Refused(f"--region {globs['--region']}: the local cloud has one region, {region}")
    if globs["--output"] not in ("json", "text"):
        raise Refused(f"--output {globs['--output']} not emulated (json, text)")
    if len(rest) < 2:
        raise Refused(f"aws {shlex.join(args)}: give a service and a command")
    service, command, rest = rest[0], rest[1], rest[2:]
    quiet = "--only-show-errors" in globs
    handler = _AWS.get((service, command))
    if handler is None:
        raise Refused(
            f"'aws {service} {command}' is not emulated (known: "
            + ", ".join(f"{s} {c}" for s, c in sorted(_AWS))
            + ")"
        )
    import botocore.exceptions

    try:
        result = handler(rest, quiet)
    except botocore.exceptions.ClientError as e:
        op = e.operation_name
        err = e.response.get("Error", {})
        raise Failed(
            f"An error occurred ({err.get('Code')}) when calling the {op} operation: {err.get('Message')}",
            254,
        ) from e
    if result is not None:
        _aws_print(result, globs.get("--query"), globs["--output"])


def _aws_s3_cp(rest: list[str], quiet: bool) -> None:
    if len(rest) != 2 or any(a.startswith("--") for a in rest):
        raise Refused(f"only 'aws s3 cp SRC DST' (one of them s3://) is emulated, not: {shlex.join(rest)}")
    src, dst = rest
    s3 = _client("s3")
    if src.startswith("s3://") and not dst.startswith("s3://"):
        bucket, key = _s3_url(src)
        path = Path(dst)
        if dst.endswith("/") or path.is_dir():
            path = path / key.rsplit("/", 1)[-1]
        _inside_root(str(path), "destination")
        try:
            s3.download_file(bucket, key, str(path))
        except Exception as e:  # noqa: BLE001 - as the CLI says it
            raise Failed(f"fatal error: {e}") from e
        if not quiet:
            print(f"download: {src} to {path}")
    elif dst.startswith("s3://") and not src.startswith("s3://"):
        bucket, key = _s3_url(dst)
        if src == "-":  # standard input
            if not key or key.endswith("/"):
                raise Refused("aws s3 cp - needs a destination key, not a prefix")
            try:
                s3.put_object(Bucket=bucket, Key=key, Body=sys.stdin.buffer.read())
            except Exception as e:  # noqa: BLE001
                raise Failed(f"upload failed: - to s3://{bucket}/{key} {e}") from e
            return
        if not key or key.endswith("/"):
            key += Path(src).name
        _inside_root(src, "source")
        try:
            s3.upload_file(src, bucket, key)
        except Exception as e:  # noqa: BLE001
            raise Failed(f"upload failed: {src} to s3://{bucket}/{key} {e}") from e
        if not quiet:
            print(f"upload: {src} to s3://{bucket}/{key}")
    else:
        raise Refused(f"only local<->s3 copies are emulated, not {src} -> {dst}")


def _aws_s3_ls(rest: list[str], quiet: bool) -> None:
    if len(rest) != 1:
        raise Refused(f"only 'aws s3 ls s3://BUCKET/PREFIX' is emulated, not: {shlex.join(rest)}")
    bucket, prefix = _s3_url(rest[0])
    s3 = _client("s3")
    lines = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            lines.append(" " * 27 + "PRE " + p["Prefix"][len(prefix) :])
        for o in page.get("Contents", []):
            when = o["LastModified"].strftime("%Y-%m-%d %H:%M:%S")
            lines.append(f"{when} {o['Size']:>10} {o['Key'][len(prefix) :]}")
    if not lines:
        raise Failed("", 1)  # as the CLI: nothing listed is exit 1, silently
    print("\n".join(lines))


def _aws_set_instance_health(rest: list[str], quiet: bool) -> None:
    o = _opts(
        rest,
        {
            "--instance-id": "value",
            "--health-status": "value",
            "--should-respect-grace-period": "flag",
            "--no-should-respect-grace-period": "flag",
        },
    )
    if "--instance-id" not in o or o.get("--health-status") not in ("Healthy", "Unhealthy"):
        raise Refused("set-instance-health needs --instance-id and --health-status Healthy|Unhealthy")
    kwargs: dict[str, Any] = {"InstanceId": o["--instance-id"], "HealthStatus": o["--health-status"]}
    if "--should-respect-grace-period" in o or "--no-should-respect-grace-period" in o:
        kwargs["ShouldRespectGracePeriod"] = "--should-respect-grace-period" in o
    _client("autoscaling").set_instance_health(**kwargs)


def _aws_update_asg(rest: list[str], quiet: bool) -> None:
    o = _opts(
        rest,
        {
            "--auto-scaling-group-name": "value",
            "--min-size": "value",
            "--max-size": "value",
            "--desired-capacity": "value",
        },
    )
    if "--auto-scaling-group-name" not in o:
        raise Refused("update-auto-scaling-group needs --auto-scaling-group-name")
    names = {"--min-size": "MinSize", "--max-size": "MaxSize", "--desired-capacity": "DesiredCapacity"}
    kwargs: dict[str, Any] = {"AutoScalingGroupName": o["--auto-scaling-group-name"]}
    for flag, key in names.items():
        if flag in o:
            kwargs[key] = int(o[flag])
    _client("autoscaling").update_auto_scaling_group(**kwargs)


def _aws_complete_lifecycle_action(rest: list[str], quiet: bool) -> None:
    o = _opts(
        rest,
        {
            "--auto-scaling-group-name": "value",
            "--lifecycle-hook-name": "value",
            "--instance-id": "value",
            "--lifecycle-action-token": "value",
            "--lifecycle-action-result": "value",
        },
    )
    needed = ("--auto-scaling-group-name", "--lifecycle-hook-name", "--lifecycle-action-result")
    if any(k not in o for k in needed) or not ("--instance-id" in o or "--lifecycle-action-token" in o):
        raise Refused(
            "complete-lifecycle-action needs --auto-scaling-group-name, --lifecycle-hook-name, "
            "--lifecycle-action-result and --instance-id or --lifecycle-action-token"
        )
    if o["--lifecycle-action-result"] not in ("CONTINUE", "ABANDON"):
        raise Refused(f"--lifecycle-action-result {o['--lifecycle-action-result']}: CONTINUE or ABANDON")
    names = {
        "--auto-scaling-group-name": "AutoScalingGroupName",
        "--lifecycle-hook-name": "LifecycleHookName",
        "--instance-id": "InstanceId",
        "--lifecycle-action-token": "LifecycleActionToken",
        "--lifecycle-action-result": "LifecycleActionResult",
    }
    _client("autoscaling").complete_lifecycle_action(**{names[k]: v for k, v in o.items()})


def _aws_describe_enis(rest: list[str], quiet: bool) -> dict[str, Any]:
    o = _opts(rest, {"--network-interface-ids": "values"})
    if not o.get("--network-interface-ids"):
        raise Refused("describe-network-interfaces needs --network-interface-ids")
    return _client("ec2").describe_network_interfaces(NetworkInterfaceIds=o["--network-interface-ids"])


def _aws_attach_eni(rest: list[str], quiet: bool) -> dict[str, Any]:
    o = _opts(rest, {"--network-interface-id": "value", "--instance-id": "value", "--device-index": "value"})
    if len(o) != 3:
        raise Refused(
            "attach-network-interface needs --network-interface-id, --instance-id and --device-index"
        )
    return _client("ec2").attach_network_interface(
        NetworkInterfaceId=o["--network-interface-id"],
        InstanceId=o["--instance-id"],
        DeviceIndex=int(o["--device-index"]),
    )


_AWS = {
    ("s3", "cp"): _aws_s3_cp,
    ("s3", "ls"): _aws_s3_ls,
    ("autoscaling", "set-instance-health"): _aws_set_instance_health,
    ("autoscaling", "update-auto-scaling-group"): _aws_update_asg,
    ("autoscaling", "complete-lifecycle-action"): _aws_complete_lifecycle_action,
    ("ec2", "describe-network-interfaces"): _aws_describe_enis,
    ("ec2", "attach-network-interface"): _aws_attach_eni,
}


# ----------------------------------------------------------------------------- curl


def curl(args: list[str]) -> None:
    """``curl [-sSf] [-X M] [-H H]… URL`` to the instance metadata service only."""
    silent = show_errors = fail = False
    method, headers, urls = "GET", {}, []
    it = iter(args)
    for a in it:
        if a == "-X":
            method = next(it, "")
        elif a == "-H":
            name, _, value = next(it, "").partition(":")
            headers[name.strip()] = value.strip()
        elif re.fullmatch(r"-[sSf]+", a):
            silent |= "s" in a
            show_errors |= "S" in a
            fail |= "f" in a
        elif a.startswith("-"):
            raise Refused(f"option {a} not emulated (only -s -S -f -X -H)")
        else:
            urls.append(a)
    if len(urls) != 1:
        raise Refused(f"give exactly one URL, not {urls}")
    url = urls[0]
    if not (url == IMDS_URL or url.startswith(IMDS_URL + "/")):
        raise Refused(
            f"the local cloud reaches no host but the instance metadata service ({IMDS_URL}), not {url}"
        )
    if method not in ("GET", "PUT"):
        raise Refused(f"-X {method} not emulated (IMDS answers GET and PUT)")
    real = _env("PETCTL_LOCAL_IMDS") + url[len(IMDS_URL) :]
    req = urllib.request.Request(real, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        if fail:
            raise Failed(
                f"curl: (22) The requested URL returned error: {e.code}" if show_errors else "", 22
            ) from e
        body = e.read()
    except (urllib.error.URLError, OSError) as e:
        raise Failed(f"curl: (7) Failed to connect: {e}" if show_errors or not silent else "", 7) from e
    sys.stdout.buffer.write(body)


# ----------------------------------------------------------------------------- ip


def ip(args: list[str]) -> None:
    """``ip -4 -o addr show``: loopback, then every interface moto has attached to this instance
    (the primary one, and the rendezvous ENI once attached), in device order."""
    if sorted(args) != sorted(["-4", "-o", "addr", "show"]) or args[-2:] != ["addr", "show"]:
        raise Refused(f"only 'ip -4 -o addr show' is emulated, not: ip {shlex.join(args)}")
    ec2 = _client("ec2")
    iid = _env("PETCTL_LOCAL_INSTANCE_ID")
    enis = ec2.describe_network_interfaces(Filters=[{"Name": "attachment.instance-id", "Values": [iid]}])[
        "NetworkInterfaces"
    ]
    enis.sort(key=lambda e: int((e.get("Attachment") or {}).get("DeviceIndex") or 0))
    cidrs = {}
    subnets = sorted({e["SubnetId"] for e in enis})
    if subnets:
        cidrs = {s["SubnetId"]: s["CidrBlock"] for s in ec2.describe_subnets(SubnetIds=subnets)["Subnets"]}
    print("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever")
    for n, e in enumerate(enis):
        dev = f"ens{5 + n}"
        plen = cidrs.get(e["SubnetId"], "/24").rsplit("/", 1)[-1]
        print(
            f"{n + 2}: {dev}    inet {e['PrivateIpAddress']}/{plen} scope global dynamic {dev}\\"
            "       valid_lft 3600sec preferred_lft 3600sec"
        )


# ----------------------------------------------------------------------------- python3.11 / pip


def _locked(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _site_dirs() -> list[str]:
    import sysconfig

    dirs = []
    for key in ("purelib", "platlib"):
        d = sysconfig.get_paths()[key]
        if d not in dirs:
            dirs.append(d)
    return dirs


def python(args: list[str]) -> None:
    """``python3.11 -m venv DIR``: DIR becomes a link to this job's cached environment
    (``<state>/venvs/<job>/<name>``), made once per job from this machine's Python."""
    if len(args) != 3 or args[:2] != ["-m", "venv"]:
        raise Refused(f"only 'python3.11 -m venv DIR' is emulated, not: python3.11 {shlex.join(args)}")
    target = _inside_root(args[2], "venv directory")
    job = os.environ.get("PETCTL_LOCAL_JOB") or "no-job"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job + target.name):
        raise Refused(f"cannot key a cache on job {job!r} / {target.name!r}")
    cache = state_dir() / "venvs" / job / target.name
    fd = _locked(cache.with_name(f".{target.name}.lock"))
    try:
        if not (cache / ".petctl-local-venv").exists():
            made = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(cache)], check=True)
            site = next((cache / "lib").glob("python3*/site-packages"))
            # This machine's packages (torch, boto3, …) sit behind the environment's own site-packages:
            # what pip installs into it comes first.
            (site / "_petctl_local.pth").write_text("".join(d + "\n" for d in _site_dirs()))
            pip = cache / "bin" / "pip"
            pip.write_text(
                f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(__file__)} pip {shlex.quote(str(cache))} "$@"\n'
            )
            pip.chmod(0o755)
            (cache / ".petctl-local-venv").write_text(json.dumps({"python": sys.version.split()[0]}))
            log(
                "python3.11",
                f"made {cache} ({time.monotonic() - made:.1f}s; Python {sys.version.split()[0]})",
            )
    finally:
        os.close(fd)
    if target.is_symlink():
        if target.resolve() != cache.resolve():
            raise Failed(f"Error: {target} exists and is another environment", 1)
    else:
        if target.exists():
            if not target.is_dir() or any(target.iterdir()):
                raise Failed(
                    f"Error: {target} exists and is not empty (the local cloud links it to {cache})", 1
                )
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(cache, target_is_directory=True)
    log("python3.11", f"{args[2]} -> {cache}")


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _pinned(req: Any) -> bool:
    return any(s.operator in ("==", "===") for s in req.specifier)


def _check_requirement(req: Any, what: str) -> str:
    """``req`` must already be satisfied on this machine (there is no package index here)."""
    have = _installed_version(req.name)
    if have is None:
        raise Failed(
            f"ERROR: No matching distribution found for {req} (the local cloud has no package index: "
            f"install it into {sys.prefix} first)",
            1,
        )
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        raise Failed(
            f"ERROR: {req} is not what this machine has ({req.name} {have}) and the local cloud has no "
            f"package index"
            + (": run the job with --torch-version matching it" if req.name.lower() == "torch" else ""),
            1,
        )
    return have


def _wheel_requirements(wheel: Path, extras: set[str]) -> list[Any]:
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise Failed(f"ERROR: {wheel} is not a valid wheel (no .dist-info/METADATA)", 1)
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras or {""}):
                reqs.append(r)
    return reqs


def pip(args: list[str]) -> None:
    """``<venv>/bin/pip install [--quiet] [--upgrade] [--index-url URL] REQ…``.

    A wheel file is really installed into the (per-job, cached) environment, once per wheel
    content; every other requirement, and every dependency of the wheel's requested extras, must
    already be satisfied by this machine's packages (no index is reached). An unpinned torch is
    refused, like any requirement this machine cannot satisfy."""
    from packaging.requirements import InvalidRequirement, Requirement

    if not args:
        raise Refused("pip needs the environment it belongs to")
    env, args = Path(args[0]), args[1:]
    if not args or args[0] != "install":
        raise Refused(f"only 'pip install …' is emulated, not: pip {shlex.join(args)}")
    reqs, index = [], None
    it = iter(args[1:])
    for a in it:
        if a in ("--quiet", "-q", "--upgrade", "-U", "--no-cache-dir"):
            continue
        if a == "--index-url":
            index = next(it, "")
            if index not in PIP_INDEXES:
                raise Refused(f"--index-url {index} not known (known: {', '.join(PIP_INDEXES)})")
        elif a.startswith("-"):
            raise Refused(f"pip option {a} not emulated")
        else:
            reqs.append(a)
    if not reqs:
        raise Refused("pip install needs a requirement")
    wheels, plain = [], []
    for raw in reqs:
        m = re.fullmatch(r"(.+\.whl)(?:\[([A-Za-z0-9_,.-]+)\])?", raw)
        if m:
            wheels.append((Path(m.group(1)), set(filter(None, (m.group(2) or "").split(",")))))
            continue
        try:
            plain.append(Requirement(raw))
        except InvalidRequirement as e:
            raise Refused(f"not a requirement or a wheel file: {raw!r} ({e})") from e
    # petctl's rule: torch is never installed unpinned, neither named alone nor as a dependency of
    # a wheel (its pin must be on the same command line, so resolving can never move it).
    torch_pinned = any(r.name.lower() == "torch" and _pinned(r) for r in plain)
    for r in plain:
        if r.name.lower() == "torch" and not _pinned(r):
            raise Refused(f"an unpinned torch ({r}) is never installed: pin torch==<version>")
    for wheel, extras in wheels:
        _install_wheel(env, wheel, extras, torch_pinned)
    for req in plain:
        have = _check_requirement(req, "pip install")
        log(
            "pip",
            f"{req}: this machine's {req.name} {have}" + (f" (index {index} not used)" if index else ""),
        )


def _install_wheel(env: Path, wheel: Path, extras: set[str], torch_pinned: bool) -> None:
    _inside_root(str(wheel), "wheel")
    if not wheel.is_file():
        raise Failed(f"ERROR: Could not install packages: [Errno 2] No such file or directory: '{wheel}'", 1)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    what = f"{wheel.name}[{','.join(sorted(extras))}]"
    for req in _wheel_requirements(wheel, extras):
        if req.name.lower() == "torch" and not torch_pinned:
            raise Refused(f"{what} depends on torch ({req}): pin torch==<version> on the same command line")
        _check_requirement(req, what)
    marker = env / ".petctl-local-wheel"
    fd = _locked(env / ".pip.lock")
    try:
        if marker.exists() and marker.read_text() == digest:
            log("pip", f"{wheel.name} ({digest[:12]}) already in this job's environment")
            return
        t0 = time.monotonic()
        cmd = [
            str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
            "--ignore-installed", "--disable-pip-version-check", "--no-warn-script-location", str(wheel),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise Failed(f"ERROR: installing {wheel.name} failed:\n{res.stdout}{res.stderr}", res.returncode)
        marker.write_text(digest)
        log("pip", f"installed {wheel.name} ({digest[:12]}) into {env} in {time.monotonic() - t0:.1f}s")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- systemctl

#: Unit file keys the local systemd knows. ``True``: emulated; a string: accepted, and why it
#: has no effect locally. Any other key is refused.
UNIT_KEYS: dict[str, dict[str, bool | str]] = {
    "Unit": {
        "Description": True,
        "RequiresMountsFor": True,
        "Wants": "ordering only (units start when enabled --now)",
        "After": "ordering only",
        "StartLimitIntervalSec": "restarts are not emulated",
        "StartLimitBurst": "restarts are not emulated",
    },
    "Service": {
        "Type": True,
        "Environment": True,
        "ExecStart": True,
        "KillMode": True,
        "KillSignal": True,
        "TimeoutStartSec": True,
        "Restart": "not emulated: a main process that exits stays down (instance state 'exited')",
        "RestartSec": "restarts are not emulated",
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
    if svc.get("Type", ["simple"])[-1] not in ("simple", "notify"):
        raise Refused(f"Type={svc['Type'][-1]} not emulated (simple, notify)")
    if svc.get("KillMode", ["control-group"])[-1] not in ("control-group", "mixed", "process"):
        raise Refused(f"KillMode={svc['KillMode'][-1]} not emulated")
    if svc.get("KillSignal", ["SIGTERM"])[-1] not in ("SIGTERM", "SIGINT"):
        raise Refused(f"KillSignal={svc['KillSignal'][-1]} not emulated (SIGTERM, SIGINT)")
    wanted = out.get("Install", {}).get("WantedBy", [])
    if any(w != "multi-user.target" for w in wanted):
        raise Refused(f"WantedBy={' '.join(wanted)} not emulated (multi-user.target)")
    return out


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
    url = _env("PETCTL_LOCAL_SYSTEMD") + "/start/" + unit
    req = urllib.request.Request(
        url, method="POST", data=b"", headers={"X-Petctl-Systemd-Token": _env("PETCTL_LOCAL_SYSTEMD_TOKEN")}
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


# ----------------------------------------------------------------------------- main

COMMANDS = {
    "dnf": dnf,
    "mount": mount,
    "aws": aws,
    "curl": curl,
    "ip": ip,
    "python3.11": python,
    "pip": pip,
    "systemctl": systemctl,
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
        print(f"usage: shims.py {{{','.join(COMMANDS)}}} ARGS…", file=sys.stderr)
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


if __name__ == "__main__":
    main(sys.argv[1:])
