"""``mount -t efs``: an EFS mount is a symlink to the local cloud's directory of that file
system, or with ``accesspoint=`` to the access point's root directory in it (so a job mounting
its access point sees nothing of the others). The file system policy is enforced as EFS does at
mount time (:mod:`.efs_policy`), with the instance role's policies when mounting with ``iam``.
The daemon mounts with the same code what a unit's ``RequiresMountsFor=`` names."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import Failed, Refused, client, inside_root, log, root, state_dir
from .efs_policy import authorize

EFS_MOUNT_OPTIONS = {"tls", "noresvport", "_netdev", "iam", "rw"}
#: Options with a value (``accesspoint=fsap-…``).
EFS_VALUE_OPTIONS = {"accesspoint"}
Clients = Callable[[str], Any]


def mounts_file(r: Path) -> Path:
    return r / "run" / "petctl-local" / "mounts.json"


def mounted(r: Path) -> dict[str, str]:
    """Mount point (path inside the root) -> what is mounted there (``fs-…:/``)."""
    try:
        return json.loads(mounts_file(r).read_text())
    except (OSError, ValueError):
        return {}


def _document(document: Any) -> dict:
    """A policy document as boto3 returns it: a dict, or text. moto keeps the inline policies of a
    role that CloudFormation made as Python's repr of the template's dict, not JSON."""
    if isinstance(document, dict):
        return document
    try:
        return json.loads(document)
    except ValueError:
        return ast.literal_eval(document)


def _role_policies(aws: Clients, instance_id: str) -> tuple[list[dict], list[str]]:
    """The identity policy documents of ``instance_id``'s role and the ARNs it answers to, as
    efs-utils' ``iam`` option presents them (the instance profile's credentials)."""
    ec2, iam = aws("ec2"), aws("iam")
    associations = ec2.describe_iam_instance_profile_associations(
        Filters=[{"Name": "instance-id", "Values": [instance_id]}]
    )["IamInstanceProfileAssociations"]
    profile = associations[0]["IamInstanceProfile"]["Arn"] if associations else ""
    if not profile:
        raise Failed("mount.efs: iam: no credentials (the instance has no instance profile)", 1)
    name = profile.rsplit("/", 1)[-1]
    roles = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
    documents: list[dict] = []
    arns: list[str] = []
    for role in roles:
        # The role itself only: a file system policy naming the account (…:root) delegates to the
        # identity policies, it grants nothing by itself.
        arns.append(role["Arn"])
        for policy in iam.list_role_policies(RoleName=role["RoleName"])["PolicyNames"]:
            document = iam.get_role_policy(RoleName=role["RoleName"], PolicyName=policy)["PolicyDocument"]
            documents.append(_document(document))
        for attached in iam.list_attached_role_policies(RoleName=role["RoleName"])["AttachedPolicies"]:
            version = iam.get_policy(PolicyArn=attached["PolicyArn"])["Policy"]["DefaultVersionId"]
            document = iam.get_policy_version(PolicyArn=attached["PolicyArn"], VersionId=version)
            documents.append(_document(document["PolicyVersion"]["Document"]))
    return documents, arns


def efs_mount(
    r: Path,
    state: Path,
    source: str,
    target: Path,
    options: set[str],
    efs: Any = None,
    az: str | None = None,
    aws: Clients | None = None,
    instance_id: str | None = None,
) -> None:
    """Mount EFS ``source`` (``fs-id:/``) at ``target``: the target directory becomes a symlink to
    ``<state>/efs/<fs-id>``, or with ``accesspoint=`` to the access point's root directory there
    (made with its CreationInfo mode on the first mount, as EFS does). Checks what mount.efs and
    EFS would: the options' rules (``iam`` and ``accesspoint`` need ``tls``), the file system
    exists and has a mount target in this instance's zone, the access point is the file system's,
    the file system policy (with the instance role's policies under ``iam``) allows
    ``ClientMount``; the mount point is an existing directory, not mounted yet."""
    m = re.fullmatch(r"(fs-[0-9a-f]{8,40}):(/.*)", source)
    if not m:
        raise Refused(f"mount -t efs needs SOURCE fs-<id>:/ (got {source!r})")
    fs_id, sub = m.groups()
    if sub != "/":
        raise Refused(f"only the file system's root (fs-id:/) is mounted, not {sub!r}")
    values = dict(o.split("=", 1) for o in options if "=" in o)
    flags = {o for o in options if "=" not in o}
    bad = (flags - EFS_MOUNT_OPTIONS) | {f"{k}=" for k in set(values) - EFS_VALUE_OPTIONS}
    if bad:
        known = sorted(EFS_MOUNT_OPTIONS | {f"{k}=" for k in EFS_VALUE_OPTIONS})
        raise Refused(f"mount option(s) {', '.join(sorted(bad))} not emulated (known: {', '.join(known)})")
    access_point = values.get("accesspoint")
    # efs-utils refuses these before it mounts anything (mount.efs: fatal_error, exit 1).
    for needs_tls in ("iam", "accesspoint"):
        if (needs_tls in flags or needs_tls in values) and "tls" not in flags:
            raise Failed(f"mount.efs: The '{needs_tls}' option requires the 'tls' option.", 1)
    key = "/" + str(target.relative_to(r)) if target != r else "/"
    if key in mounted(r) or target.is_symlink():
        raise Failed(f"mount: {target}: {source} already mounted or mount point busy.", 32)
    if not target.is_dir():
        raise Failed(f"mount: {target}: mount point does not exist.", 32)
    aws = aws or (lambda service: efs if (service == "efs" and efs is not None) else client(service))
    efs = aws("efs")
    try:
        (fs,) = efs.describe_file_systems(FileSystemId=fs_id)["FileSystems"]
        targets = efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]
    except Exception as e:  # noqa: BLE001 - reported as mount.efs would
        raise Failed(f"mount.efs: cannot find file system {fs_id}: {e}", 32) from e
    az = az or os.environ.get("PETCTL_LOCAL_AZ")
    if az and not any(t.get("AvailabilityZoneName") == az for t in targets):
        raise Failed(f"mount.efs: file system {fs_id} has no mount target in {az} (this instance's zone)", 32)
    root_dir, creation, ap_arn = "/", None, None
    if access_point:
        try:
            (ap,) = efs.describe_access_points(AccessPointId=access_point)["AccessPoints"]
        except Exception as e:  # noqa: BLE001 - as mount.efs reports an unknown access point
            raise Failed(f"mount.efs: access point {access_point} not found: {e}", 1) from e
        if ap["FileSystemId"] != fs_id:
            raise Failed(f"mount.efs: access point {access_point} is not on file system {fs_id}", 1)
        root_dir, ap_arn = ap["RootDirectory"]["Path"], ap["AccessPointArn"]
        creation = ap["RootDirectory"].get("CreationInfo")
    try:
        policy = json.loads(efs.describe_file_system_policy(FileSystemId=fs_id)["Policy"])
    except efs.exceptions.PolicyNotFound:
        policy = None
    identity, principals = None, []
    if "iam" in flags and policy is not None:
        identity, principals = _role_policies(
            aws, instance_id or os.environ.get("PETCTL_LOCAL_INSTANCE_ID") or r.parent.name
        )
    context = {
        "aws:SecureTransport": "true" if "tls" in flags else "false",
        "elasticfilesystem:AccessedViaMountTarget": "true",
    }
    if ap_arn:
        context["elasticfilesystem:AccessPointArn"] = ap_arn
    denied = authorize(
        "elasticfilesystem:ClientMount", fs["FileSystemArn"], policy, identity, principals, context
    )
    if denied:
        raise Failed(f"mount.nfs4: access denied by server while mounting {source} ({denied})", 32)
    if any(target.iterdir()):
        raise Failed(f"mount: {target}: mount point is not empty (the local cloud mounts by symlink)", 32)
    efs_dir = state / "efs" / fs_id / root_dir.strip("/")
    if not efs_dir.is_dir():
        if access_point and not creation and root_dir.strip("/"):
            raise Failed(
                f"mount.nfs4: mounting {source} failed, reason given by server: No such file or directory", 32
            )
        efs_dir.mkdir(parents=True)
        if creation:
            efs_dir.chmod(int(str(creation["Permissions"]), 8))
    target.rmdir()
    target.symlink_to(efs_dir, target_is_directory=True)
    table = mounted(r)
    table[key] = source + (f" accesspoint={access_point}" if access_point else "")
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
    target = inside_root(pos[1], "mount point")
    efs_mount(r, state_dir(), pos[0], target, {o for o in options.split(",") if o})
    log("mount", f"{pos[0]} ({options or 'no options'}) on {pos[1]} -> {target.resolve()}")
