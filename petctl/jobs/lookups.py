"""What a plan needs from AWS, looked up before it is made (the plan itself makes no call)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from petctl import config
from petctl.context import Context
from petctl.errors import AwsError, ConfigError, PetctlError, describe_client_error
from petctl.infra import etcd_copy
from petctl.instance_types import InstanceTypeInfo
from petctl.jobs.request import JobRequest, efa_interfaces, instance_types, rdzv_architecture
from petctl.storage import parse_s3_url
from petctl.ui import cmd


def resolve_ami(ctx: Context, req: JobRequest) -> None:
    """Check that ``--ami`` exists in the region and record its root device name."""
    if req.ami is not None:
        req.root_device_name = ctx.gateway().compute.image(req.ami).get("RootDeviceName") or None


def resolve_vpc(ctx: Context) -> None:
    """Record the VPC of the profile's first subnet when the profile has none (profiles made by
    ``configure`` without ``--vpc-id``): the job's security groups are made in it. ``setup``
    profiles always have it. Saved, so the lookup happens once."""
    profile = ctx.profile
    if profile.vpc_id or not profile.subnet_ids:
        return
    subnet = profile.subnet_ids[0]
    try:
        vpc = ctx.gateway().compute.subnet_vpc(subnet)
    except Exception as e:  # noqa: BLE001 - InvalidSubnetID.NotFound, no access
        raise ConfigError(
            f"cannot find the VPC of subnet {subnet} ({describe_client_error(e)}); check the profile's "
            f"subnets with `{cmd('configure --show')}`"
        ) from e
    if vpc is None:
        raise ConfigError(f"subnet {subnet} of profile {profile.name!r} was not found in {ctx.region}")
    profile.vpc_id = vpc
    config.save_profile(profile)


def public_subnets(ctx: Context, req: JobRequest, facts: dict[str, InstanceTypeInfo]) -> set[str] | None:
    """Which of the profile's subnets map a public IPv4 on launch, for a worker type with several
    EFA network cards (which gets none there: the plan refuses it); None, and no call, otherwise."""
    if efa_interfaces(req, facts) <= 1:
        return None
    subnets = list(ctx.profile.subnet_ids)
    try:
        return ctx.gateway().compute.public_subnets(subnets)
    except Exception as e:  # noqa: BLE001 - InvalidSubnetID.NotFound, no access
        raise AwsError(
            f"cannot read subnets {', '.join(subnets)} ({describe_client_error(e)}), which a type with "
            f"several EFA network cards needs to check; the caller needs ec2:DescribeSubnets"
        ) from e


def use_bucket_etcd(ctx: Context, req: JobRequest, facts: dict[str, InstanceTypeInfo]) -> None:
    """The rendezvous boot takes etcd from the bucket's copy (``setup`` puts it there) when the
    job gives no copy of its own and runs with its own roles (which may read it)."""
    profile = ctx.profile
    given_roles = profile.worker_instance_profile_arn or profile.rdzv_instance_profile_arn
    if req.rdzv_etcd_url is not None or not profile.bucket or given_roles:
        return
    found = etcd_copy.bucket_copy(ctx, profile.bucket, rdzv_architecture(req, facts))
    if found:
        req.rdzv_etcd_url, req.rdzv_etcd_sha256 = found


def check_code_url(ctx: Context, req: JobRequest) -> None:
    """Refuse an ``s3://`` target that does not exist; warn when it lies where the worker role
    cannot read it. Runs before anything is created."""
    if not req.target.startswith("s3://"):
        return
    bucket, key = parse_s3_url(req.target)
    try:
        found = ctx.gateway().objects.exists(bucket, key)
    except PetctlError as e:
        ctx.ui.warn(
            f"could not check {req.target} ({e.format_message()}); the instances may not be able to read it"
        )
        found = True
    if not found:
        raise ConfigError(
            f"{req.target} does not exist; upload it first (`{cmd('upload FILE ' + req.target)}`)"
        )
    if bucket != ctx.profile.bucket or not key.startswith("petctl/uploads/"):
        ctx.ui.warn(
            f"{req.target} is outside s3://{ctx.profile.bucket}/petctl/uploads/, which is all a job's role "
            f"may read besides its own prefix; copy it there (`{cmd('upload FILE')}`) or grant the role access"
        )


#: How long a cached DescribeInstanceTypes answer is used: instance types do not change once
#: launched, so a week only bounds how long a damaged or stale entry can live.
INSTANCE_TYPE_CACHE_SECONDS = 7 * 86400


def instance_facts(ctx: Context, req: JobRequest) -> dict[str, InstanceTypeInfo]:
    """What EC2 says about every worker type and the rendezvous type, from the cache under the
    petctl home when it is fresh, else from DescribeInstanceTypes (then cached). Refuses, in one
    line, the types the region does not know."""
    wanted = list(dict.fromkeys([*instance_types(req), req.rdzv_instance_type]))
    compute = ctx.gateway().compute
    path = instance_type_cache(ctx.region or "", compute.endpoint)
    cached = _read_cache(path)
    facts = {t: cached[t] for t in wanted if t in cached}
    missing = [t for t in wanted if t not in facts]
    if missing:
        try:
            found, unknown = compute.instance_types(missing)
        except Exception as e:  # noqa: BLE001 - no permission, throttled: say which call and why
            raise AwsError(
                f"cannot describe instance types {', '.join(missing)} in {ctx.region} "
                f"({describe_client_error(e)}); the caller needs ec2:DescribeInstanceTypes"
            ) from e
        if unknown:
            flags = [
                f"--instance-type {t}" if t in instance_types(req) else f"--rdzv-instance-type {t}"
                for t in unknown
            ]
            fam = unknown[0].split(".", 1)[0]
            raise ConfigError(
                f"{', '.join(flags)}: no such instance type in {ctx.region}; list the names with "
                f"`aws ec2 describe-instance-types --region {ctx.region} --filters "
                f"Name=instance-type,Values={fam}.* --query 'InstanceTypes[].InstanceType'`"
            )
        facts.update(found)
        _write_cache(path, found)
    return facts


def instance_type_cache(region: str, endpoint: str) -> Path:
    """One file per region and endpoint: the local cloud's answers never stand in for AWS's."""
    tag = hashlib.sha1(endpoint.encode()).hexdigest()[:8]
    return config.home() / "cache" / f"instance-types-{region}-{tag}.json"


def _read_cache(path: Path) -> dict[str, InstanceTypeInfo]:
    """The fresh entries of the cache; nothing when it is missing, unreadable or damaged (the
    cache never fails a run: it only saves a call)."""
    try:
        entries = json.loads(path.read_text())["types"]
        now = time.time()
        return {
            name: InstanceTypeInfo.from_dict(e["facts"])
            for name, e in entries.items()
            if 0 <= now - float(e["fetched_at"]) < INSTANCE_TYPE_CACHE_SECONDS and e["facts"]["name"] == name
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_cache(path: Path, found: dict[str, InstanceTypeInfo]) -> None:
    """Add ``found`` to the cache (written whole to a temporary file, then renamed over it);
    a failure to write is ignored."""
    try:
        try:
            entries = json.loads(path.read_text())["types"]
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError, KeyError, TypeError):
            entries = {}
        now = time.time()
        entries.update({n: {"fetched_at": now, "facts": f.to_dict()} for n, f in found.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "types": entries}, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass
