"""EC2: instances, images, subnets, zones, and what a deleted base stack left behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from petctl.errors import ConfigError, describe_client_error
from petctl.gateway.session import ClientError
from petctl.instance_types import InstanceTypeInfo

#: Instances that still exist (and may still cost).
NOT_TERMINATED = ["pending", "running", "stopping", "stopped", "shutting-down"]


class Compute:
    def __init__(self, ec2: Any, region: str | None) -> None:
        self.ec2 = ec2
        self.region = region

    def instances(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """EC2's description of each instance id, by id."""
        if not ids:
            return {}
        found: dict[str, dict[str, Any]] = {}
        for page in self.ec2.get_paginator("describe_instances").paginate(InstanceIds=ids):
            for res in page["Reservations"]:
                for i in res["Instances"]:
                    found[i["InstanceId"]] = i
        return found

    def job_instances(self, job: str, role: str | None = None) -> list[str]:
        """Instances of the job (of one ``petctl:role``, if given) that are not terminated yet."""
        filters = [
            {"Name": "tag:petctl:job", "Values": [job]},
            *([{"Name": "tag:petctl:role", "Values": [role]}] if role else []),
            {"Name": "instance-state-name", "Values": NOT_TERMINATED},
        ]
        ids = []
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
            ids += [i["InstanceId"] for r in page["Reservations"] for i in r["Instances"]]
        return ids

    def image(self, ami: str) -> dict[str, Any]:
        """The AMI, or a ConfigError saying it cannot be used here."""
        try:
            images = self.ec2.describe_images(ImageIds=[ami])["Images"]
        except Exception as e:  # noqa: BLE001 - InvalidAMIID.* and friends
            raise ConfigError(
                f"--ami {ami} is not usable in {self.region}: {describe_client_error(e)}"
            ) from e
        if not images:
            raise ConfigError(f"--ami {ami} was not found in {self.region}")
        return images[0]

    def ebs_default_key_id(self) -> str | None:
        """The account's default EBS key in the region (``GetEbsDefaultKmsKeyId``: an ARN, or
        ``alias/aws/ebs``), or None when it cannot be read."""
        try:
            return self.ec2.get_ebs_default_kms_key_id().get("KmsKeyId") or "alias/aws/ebs"
        except Exception:  # noqa: BLE001 - UnauthorizedOperation: the launch will tell
            return None

    @property
    def endpoint(self) -> str:
        """The EC2 endpoint answering (AWS's for the region, or the local cloud's)."""
        return str(self.ec2.meta.endpoint_url)

    def instance_types(self, names: list[str]) -> tuple[dict[str, InstanceTypeInfo], list[str]]:
        """What EC2 says about each of ``names`` in this region, and the names it does not know.

        EC2 refuses the whole call with ``InvalidInstanceType`` when one name is unknown, naming
        them in the message ("... do not exist: [a, b]"); they are set aside and the rest asked
        again. Other errors (no permission, throttling after retries) raise ClientError.
        """
        found: dict[str, InstanceTypeInfo] = {}
        unknown: list[str] = []
        ask = list(dict.fromkeys(names))
        while ask:
            try:
                for page in self.ec2.get_paginator("describe_instance_types").paginate(InstanceTypes=ask):
                    for d in page["InstanceTypes"]:
                        found[d["InstanceType"]] = InstanceTypeInfo.from_ec2(d)
                break
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") != "InvalidInstanceType":
                    raise
                named = [n for n in ask if n in _bracketed(e.response["Error"].get("Message", ""))]
                unknown += named or ask  # unparsable message: none of them can be trusted
                ask = [n for n in ask if n not in unknown]
        return found, unknown

    def subnet_vpc(self, subnet: str) -> str | None:
        """The VPC of a subnet (None when it does not exist); ClientError when it cannot be read."""
        subnets = self.ec2.describe_subnets(SubnetIds=[subnet])["Subnets"]
        return subnets[0]["VpcId"] if subnets else None

    def public_subnets(self, subnets: list[str]) -> set[str]:
        """Those of ``subnets`` that give an instance a public IPv4 on launch (``MapPublicIpOnLaunch``);
        ClientError when they cannot be read."""
        found = self.ec2.describe_subnets(SubnetIds=subnets)["Subnets"]
        return {s["SubnetId"] for s in found if s.get("MapPublicIpOnLaunch")}

    def zones(self) -> list[str]:
        """The region's available zones (Local and Wavelength zones excluded)."""
        zones = self.ec2.describe_availability_zones(
            Filters=[
                {"Name": "state", "Values": ["available"]},
                {"Name": "zone-type", "Values": ["availability-zone"]},
            ]
        )["AvailabilityZones"]
        return sorted(z["ZoneName"] for z in zones)

    def sweep_stack_leftovers(self, stack: str) -> list[str]:
        """Delete the network resources tagged as ``stack``'s that are still there; return those
        that could not be deleted, each with AWS's reason."""
        ec2 = self.ec2
        tag = [{"Name": "tag:aws:cloudformation:stack-name", "Values": [stack]}]
        left: list[str] = []

        def attempt(what: str, call: Callable[[], Any]) -> None:
            try:
                call()
            except ClientError as e:
                if "NotFound" not in describe_client_error(e):
                    left.append(f"{what} ({describe_client_error(e)})")

        for vpc in ec2.describe_vpcs(Filters=tag)["Vpcs"]:
            vpc_id = vpc["VpcId"]
            by_vpc = [{"Name": "vpc-id", "Values": [vpc_id]}]
            for igw in ec2.describe_internet_gateways(
                Filters=[{"Name": "attachment.vpc-id", "Values": [vpc_id]}]
            )["InternetGateways"]:
                gid = igw["InternetGatewayId"]
                attempt(
                    gid, lambda i=gid, v=vpc_id: ec2.detach_internet_gateway(InternetGatewayId=i, VpcId=v)
                )
                attempt(gid, lambda i=gid: ec2.delete_internet_gateway(InternetGatewayId=i))
            for rt in ec2.describe_route_tables(Filters=by_vpc)["RouteTables"]:
                if any(a.get("Main") for a in rt.get("Associations", [])):
                    continue  # goes with the VPC
                for a in rt.get("Associations", []):
                    attempt(
                        rt["RouteTableId"],
                        lambda a=a: ec2.disassociate_route_table(AssociationId=a["RouteTableAssociationId"]),
                    )
                attempt(
                    rt["RouteTableId"], lambda r=rt["RouteTableId"]: ec2.delete_route_table(RouteTableId=r)
                )
            for subnet in ec2.describe_subnets(Filters=by_vpc)["Subnets"]:
                attempt(subnet["SubnetId"], lambda n=subnet["SubnetId"]: ec2.delete_subnet(SubnetId=n))
            for sg in ec2.describe_security_groups(Filters=by_vpc)["SecurityGroups"]:
                if sg["GroupName"] != "default":
                    attempt(sg["GroupId"], lambda g=sg["GroupId"]: ec2.delete_security_group(GroupId=g))
            attempt(vpc_id, lambda v=vpc_id: ec2.delete_vpc(VpcId=v))
        return left


def _bracketed(message: str) -> set[str]:
    """The names inside ``[...]`` of an InvalidInstanceType message."""
    inside = message[message.find("[") + 1 : message.rfind("]")] if "[" in message else ""
    return {n.strip() for n in inside.split(",") if n.strip()}
