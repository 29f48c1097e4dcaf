"""Auto Scaling: the job's worker and rendezvous groups."""

from __future__ import annotations

from typing import Any

from petctl import naming
from petctl.errors import AwsError, describe_client_error


class Groups:
    def __init__(self, asg: Any) -> None:
        self.asg = asg

    def describe(self, name: str) -> dict[str, Any] | None:
        groups = self.asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"]
        return groups[0] if groups else None

    def worker_group(self, job: str) -> dict[str, Any] | None:
        return self.describe(naming.worker_group(job))

    def rdzv_group(self, job: str) -> dict[str, Any] | None:
        return self.describe(naming.rdzv_group(job))

    def instance_ids(self, job: str) -> set[str]:
        """Instances either group of the job lists (warm pool instances are not listed)."""
        ids: set[str] = set()
        for group in (self.rdzv_group(job), self.worker_group(job)):
            ids |= {i["InstanceId"] for i in (group or {}).get("Instances", [])}
        return ids

    def warm_instances(self, name: str) -> list[dict[str, Any]]:
        """The stopped, pre-booted instances of the group's warm pool (none without a pool)."""
        instances: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"AutoScalingGroupName": name}
        while True:  # boto3 has no paginator for this call
            page = self.asg.describe_warm_pool(**kwargs)
            instances += page.get("Instances") or []
            if not page.get("NextToken"):
                return instances
            kwargs["NextToken"] = page["NextToken"]

    def delete_warm_pool(self, name: str) -> bool:
        """Delete the group's warm pool and its stopped instances; False when it has none.

        Scaling a group to zero keeps its pool (AWS sizes it max(MinSize, ...)), and those
        stopped instances would still bill their volumes and still be the job's instances.
        """
        if not self.asg.describe_warm_pool(AutoScalingGroupName=name).get("WarmPoolConfiguration"):
            return False
        self.asg.delete_warm_pool(AutoScalingGroupName=name, ForceDelete=True)
        return True

    def set_capacity(self, name: str, size: int) -> None:
        try:
            self.asg.set_desired_capacity(
                AutoScalingGroupName=name, DesiredCapacity=size, HonorCooldown=False
            )
        except Exception as e:
            raise AwsError(f"could not set the size of {name}: {describe_client_error(e)}") from e

    def stop(self, name: str) -> None:
        """Scale to zero and keep it there (min 0): its instances drain and leave."""
        self.asg.update_auto_scaling_group(AutoScalingGroupName=name, MinSize=0, DesiredCapacity=0)

    def suspend_processes(self, name: str, processes: list[str]) -> None:
        self.asg.suspend_processes(AutoScalingGroupName=name, ScalingProcesses=processes)
