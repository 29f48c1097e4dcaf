"""EFS in moto as AWS has it: mount targets' VPC and zone rules, and access points and file
system policies in CloudFormation (:mod:`petctl.local.moto_patches`, items 4 and 12).

A file system has mount targets in one VPC at a time: AWS answers ``MountTargetConflict`` for a
second VPC, and refuses a mount target of a One Zone file system outside its zone; moto allowed
both, and both are refused here.

moto 5.2 creates ``AWS::EFS::AccessPoint`` from a template but gives it no ``Ref`` (a ``!Ref`` or
``${AccessPoint}`` in a ``!Sub`` became the Python object) and no ``Fn::GetAtt`` (``Arn``,
``AccessPointId``), checks none of its properties, and ignores an ``AWS::EFS::FileSystem``'s
``FileSystemPolicy``. Here:

* ``Ref`` is the access point id (``fsap-…``), ``Fn::GetAtt`` ``Arn`` and ``AccessPointId`` are
  AWS's;
* what AWS refuses is refused (CreateAccessPoint; AWS::EFS::AccessPoint): a ``RootDirectory``
  ``Path`` that is not absolute or is longer than 100 characters, a ``CreationInfo`` missing one of
  ``OwnerUid``/``OwnerGid``/``Permissions`` or with permissions not 3-4 octal digits, POSIX ids
  outside 0-4294967295, a file system that does not exist;
* a template's ``FileSystemPolicy`` becomes the file system's policy (``DescribeFileSystemPolicy``),
  which the local ``mount`` shim enforces (petctl/local/shims/mount.py);
* ``DescribeFileSystemPolicy``/``PutFileSystemPolicy`` of a file system that does not exist answer
  ``FileSystemNotFound`` (moto raised a KeyError: HTTP 500), and ``PutFileSystemPolicy`` refuses a
  policy that is not a JSON policy document (``InvalidPolicyException``) or longer than 20,000
  characters (``BadRequest``), as API_PutFileSystemPolicy.html and API_DescribeFileSystemPolicy.html
  document.

Sources: docs.aws.amazon.com/efs/latest/ug/API_CreateAccessPoint.html, API_RootDirectory.html,
API_CreationInfo.html, API_PosixUser.html; AWS::EFS::FileSystem FileSystemPolicy in the
CloudFormation resource reference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from petctl.local.patching import wrap

MAX_POSIX_ID = 4_294_967_295
#: PutFileSystemPolicy ``Policy``: "EFS file system policies have a 20,000 character limit".
MAX_POLICY_CHARS = 20_000


def _posix_id(value: Any, what: str, bad: Callable[[str], Exception]) -> None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise bad(f"{what} must be an integer, not {value!r}") from None
    if not 0 <= n <= MAX_POSIX_ID:
        raise bad(f"{what} {n} is outside 0-{MAX_POSIX_ID}")


def check_access_point(
    props: dict[str, Any], file_systems: dict[str, Any], bad: Callable[[str], Exception]
) -> None:
    """Raise ``bad(message)`` for an access point AWS would refuse."""
    fs_id = props.get("FileSystemId")
    if fs_id not in file_systems:
        raise bad(f"File system '{fs_id}' does not exist.")
    user = props.get("PosixUser") or {}
    if user:
        for key in ("Uid", "Gid"):
            _posix_id(user.get(key), f"PosixUser.{key}", bad)
    root = props.get("RootDirectory") or {}
    path = root.get("Path", "/")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 100:
        raise bad(f"RootDirectory.Path must be an absolute path of at most 100 characters, not {path!r}")
    info = root.get("CreationInfo")
    if info is not None:
        missing = [k for k in ("OwnerUid", "OwnerGid", "Permissions") if info.get(k) in (None, "")]
        if missing:
            raise bad(
                f"CreationInfo needs all of OwnerUid, OwnerGid, Permissions (missing {', '.join(missing)})"
            )
        for key in ("OwnerUid", "OwnerGid"):
            _posix_id(info[key], f"CreationInfo.{key}", bad)
        if not re.fullmatch(r"[0-7]{3,4}", str(info["Permissions"])):
            raise bad(f"CreationInfo.Permissions must be 3 or 4 octal digits, not {info['Permissions']!r}")


def apply() -> None:
    """Install the patches (idempotent)."""
    from moto.cloudformation.exceptions import ValidationError
    from moto.efs.models import AccessPoint, FileSystem, efs_backends

    AccessPoint.physical_resource_id = property(lambda self: self.access_point_id)  # type: ignore[attr-defined]
    AccessPoint.has_cfn_attr = classmethod(lambda cls, attr: attr in ("Arn", "AccessPointId"))  # type: ignore[method-assign,assignment]

    def get_cfn_attribute(self: Any, attr: str) -> str:
        if attr == "Arn":
            return self.access_point_arn
        if attr == "AccessPointId":
            return self.access_point_id
        from moto.cloudformation.exceptions import UnformattedGetAttTemplateException

        raise UnformattedGetAttTemplateException()

    AccessPoint.get_cfn_attribute = get_cfn_attribute  # type: ignore[attr-defined]

    @wrap(AccessPoint, "create_from_cloudformation_json")
    def access_point_from_cfn(
        original: Callable[..., Any],
        resource_name: str,
        cloudformation_json: Any,
        account_id: str,
        region_name: str,
        **kw: Any,
    ) -> Any:
        backend = efs_backends[account_id][region_name]
        props = cloudformation_json.get("Properties") or {}
        check_access_point(
            props, backend.file_systems_by_id, lambda m: ValidationError(message=f"{resource_name}: {m}")
        )
        return original(resource_name, cloudformation_json, account_id, region_name, **kw)

    @wrap(FileSystem, "create_from_cloudformation_json")
    def file_system_from_cfn(
        original: Callable[..., Any],
        resource_name: str,
        cloudformation_json: Any,
        account_id: str,
        region_name: str,
        **kw: Any,
    ) -> Any:
        fs = original(resource_name, cloudformation_json, account_id, region_name, **kw)
        policy = (cloudformation_json.get("Properties") or {}).get("FileSystemPolicy")
        if policy:
            efs_backends[account_id][region_name].put_file_system_policy(
                fs.file_system_id, json.dumps(policy), bypass_policy_lockout_safety_check=False
            )
        return fs

    _policy_api()
    _patch_efs_mount_targets()

    # (wrap's original is the bound classmethod; the plain function it installs is called on the
    # class, as moto's CloudFormation does, so no cls is passed twice.)


def policy_problem(policy: Any) -> str | None:
    """Why EFS would refuse ``policy`` (PutFileSystemPolicy's text) as a policy document, or None."""
    try:
        doc = json.loads(policy)
    except (TypeError, ValueError):
        return "The policy is not valid JSON."
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("Statement"), (list, dict))
        or not doc["Statement"]
    ):
        return "The policy document needs a Statement."
    for statement in doc["Statement"] if isinstance(doc["Statement"], list) else [doc["Statement"]]:
        if not isinstance(statement, dict) or statement.get("Effect") not in ("Allow", "Deny"):
            return "Each statement needs an Effect of Allow or Deny."
        if "Principal" not in statement and "NotPrincipal" not in statement:
            return "A resource-based policy statement needs a Principal."
        if "Action" not in statement and "NotAction" not in statement:
            return "Each statement needs an Action."
    return None


def _policy_api() -> None:
    from moto.core.exceptions import JsonRESTError
    from moto.efs.exceptions import BadRequest, FileSystemNotFound
    from moto.efs.models import EFSBackend

    class InvalidPolicyException(JsonRESTError):
        code = 400

        def __init__(self, message: str) -> None:
            super().__init__("InvalidPolicyException", message)

    @wrap(EFSBackend, "describe_file_system_policy")
    def describe_policy(original: Callable[..., Any], self: Any, file_system_id: str) -> Any:
        if file_system_id not in self.file_systems_by_id:
            raise FileSystemNotFound(file_system_id)
        return original(self, file_system_id)

    @wrap(EFSBackend, "put_file_system_policy")
    def put_policy(
        original: Callable[..., Any], self: Any, file_system_id: str, policy: str, **kw: Any
    ) -> Any:
        if file_system_id not in self.file_systems_by_id:
            raise FileSystemNotFound(file_system_id)
        if not isinstance(policy, str) or not 1 <= len(policy) <= MAX_POLICY_CHARS:
            raise BadRequest(f"Policy must be 1 to {MAX_POLICY_CHARS} characters.")
        problem = policy_problem(policy)
        if problem:
            raise InvalidPolicyException(problem)
        return original(self, file_system_id, policy, **kw)


def _patch_efs_mount_targets() -> None:
    from moto.efs.exceptions import BadRequest, MountTargetConflict
    from moto.efs.models import EFSBackend

    @wrap(EFSBackend, "create_mount_target")
    def create_mount_target(
        original: Callable[..., Any],
        self: Any,
        file_system_id: str,
        subnet_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        fs = self.file_systems_by_id.get(file_system_id)
        try:
            subnet = self.ec2_backend.get_subnet(subnet_id)
        except Exception:  # noqa: BLE001 - moto's own error for a bad subnet
            subnet = None
        if fs is not None and subnet is not None:
            vpcs = {
                mt.subnet_vpc_id
                for mt in self.mount_targets_by_id.values()
                if mt.file_system_id == file_system_id
            }
            if vpcs and subnet.vpc_id not in vpcs:
                raise MountTargetConflict(
                    f"File system '{file_system_id}' already has mount targets in VPC {sorted(vpcs)[0]}; "
                    f"all of a file system's mount targets must be in one VPC"
                )
            zone = getattr(fs, "availability_zone_name", None)
            if zone and subnet.availability_zone != zone:
                raise BadRequest(
                    f"One Zone file system '{file_system_id}' lives in {zone}; subnet {subnet_id} is in "
                    f"{subnet.availability_zone}"
                )
        return original(self, file_system_id, subnet_id, *args, **kwargs)
