"""EFS: checking a file system the user gives, and deleting one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from petctl.errors import AwsError, PetctlError, describe_client_error
from petctl.gateway.session import ClientError


class FileSystems:
    def __init__(
        self,
        efs: Any,
        subnet_vpc: Callable[[str], str | None],
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.efs = efs
        self.subnet_vpc = subnet_vpc
        self.sleep = sleep
        self.clock = clock

    def describe(self, efs_id: str) -> dict[str, Any]:
        try:
            return self.efs.describe_file_systems(FileSystemId=efs_id)["FileSystems"][0]
        except ClientError as e:
            raise PetctlError(
                f"EFS file system {efs_id} was not found or is not accessible ({describe_client_error(e)})"
            ) from e

    def policy(self, efs_id: str) -> dict[str, Any] | None:
        """The file system's policy, or None when it has none (EFS's default policy applies:
        DescribeFileSystemPolicy answers ``PolicyNotFound``)."""
        try:
            text = self.efs.describe_file_system_policy(FileSystemId=efs_id)["Policy"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "PolicyNotFound":
                return None
            raise AwsError(
                f"could not read the file system policy of {efs_id} ({describe_client_error(e)}); "
                "the caller needs elasticfilesystem:DescribeFileSystemPolicy"
            ) from e
        return json.loads(text)

    def put_policy(self, efs_id: str, policy: dict[str, Any]) -> None:
        """Replace the file system's policy. The lockout safety check stays on: AWS refuses a
        policy that would stop this caller from changing it again."""
        try:
            self.efs.put_file_system_policy(
                FileSystemId=efs_id, Policy=json.dumps(policy), BypassPolicyLockoutSafetyCheck=False
            )
        except ClientError as e:
            raise AwsError(
                f"could not set the file system policy of {efs_id} ({describe_client_error(e)}); "
                "the caller needs elasticfilesystem:PutFileSystemPolicy"
            ) from e

    def mount_target_vpcs(self, efs_id: str) -> set[str]:
        """The VPCs the file system has mount targets in (one at most, on AWS)."""
        vpcs = set()
        for mt in self.efs.describe_mount_targets(FileSystemId=efs_id).get("MountTargets", []):
            vpcs.add(mt.get("VpcId") or self.subnet_vpc(mt["SubnetId"]))
        return vpcs

    def delete(self, efs_id: str, wait: float = 300) -> None:
        """Delete the file system once its mount targets are gone (AWS deletes those
        asynchronously: ``FileSystemInUse`` until then)."""
        deadline = self.clock() + wait
        while True:
            try:
                for mt in self.efs.describe_mount_targets(FileSystemId=efs_id).get("MountTargets", []):
                    self.efs.delete_mount_target(MountTargetId=mt["MountTargetId"])
                self.efs.delete_file_system(FileSystemId=efs_id)
                return
            except ClientError as e:
                code = describe_client_error(e)
                if code.startswith("FileSystemNotFound"):
                    return
                if not code.startswith("FileSystemInUse") or self.clock() > deadline:
                    raise AwsError(f"could not delete EFS file system {efs_id} ({code})") from e
                self.sleep(5)
