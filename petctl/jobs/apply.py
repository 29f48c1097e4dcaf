"""Carry out a :class:`~petctl.jobs.planning.Plan`: upload, create the job stack, wait."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from petctl import naming
from petctl.errors import PetctlError, StackWaitTimeout, describe_client_error
from petctl.gateway import Gateway
from petctl.jobs.planning import Plan
from petctl.storage import Upload
from petctl.ui import cmd


@dataclass
class Started:
    """What ``run-job`` made (its ``--output json`` document)."""

    job: str
    stack: str
    min: int
    max: int
    size: int
    instance_type: str
    rendezvous_endpoint: str | None
    worker_group: str
    s3_prefix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply(p: Plan, gw: Gateway, timeout: float = 1800) -> Started:
    """Upload, create the job stack, wait. On any failure (or Ctrl-C) remove what was made."""
    gw.check_credentials()
    if gw.stacks.describe(p.stack_name) is not None:
        raise PetctlError(
            f"job {p.job_name!r} already exists (the same command without --name makes the same job); "
            f"watch it with `{cmd('status ' + p.job_name)}`, give --name for another, or "
            f"`{cmd('kill-job ' + p.job_name)}`"
        )
    prefix = naming.job_prefix(p.job_name)
    gw.job_files.clear_reports(p.job_name)
    try:
        for u in [*p.uploads, *_tls_uploads(p)]:
            gw.ui.progress(f"uploading s3://{p.bucket}/{u.key} ({u.size()} bytes)")
            gw.objects.put_object(p.bucket, u, kms_key=p.kms_key)
        result = gw.stacks.deploy(
            p.stack_name,
            p.template,
            p.parameters,
            p.tags,
            timeout=timeout,
            template_url=gw.objects.https_url(p.bucket, p.template_key),
        )
    except StackWaitTimeout as e:
        # The stack goes on being created: keep it *and* its uploads (its instances will read
        # them), and say how to follow or remove it. Deleting only the uploads would leave
        # instances booting with nothing to run.
        raise StackWaitTimeout(
            f"{e}; the job stack and its uploads are kept: watch it with `{cmd('status ' + p.job_name)}`, "
            f"or remove it with `{cmd('kill-job ' + p.job_name)}`"
        ) from e
    except BaseException:
        # Nothing half-made: the stack is already deleted by deploy(); remove the uploads too.
        try:
            gw.objects.delete_prefix(p.bucket, prefix)
        except Exception as cleanup_error:  # noqa: BLE001 - keep the original error
            gw.ui.warn(f"could not remove s3://{p.bucket}/{prefix}: {cleanup_error}")
        raise
    out = result.outputs
    group = out.get("WorkerGroupName", naming.worker_group(p.job_name))
    suspend_az_rebalance(gw, group)
    values = p.parameter_values
    return Started(
        job=p.job_name,
        stack=p.stack_name,
        min=p.spec.min_nodes,
        max=p.spec.max_nodes,
        size=int(values["DesiredCapacity"]),
        instance_type=values["InstanceType"],
        rendezvous_endpoint=out.get("RdzvEndpoint"),
        worker_group=group,
        s3_prefix=f"s3://{p.bucket}/{prefix}",
    )


def _tls_uploads(p: Plan) -> list[Upload]:
    """The job's etcd CA and client certificate, made now and readable only by its instances
    (their roles read their own job's prefix); ``kill-job`` deletes them."""
    from petctl import tls

    prefix = naming.job_prefix(p.job_name) + "tls/"
    return [Upload(key=prefix + name, data=data) for name, data in tls.make_job_tls(p.job_name).items()]


def suspend_az_rebalance(gw: Gateway, group: str) -> None:
    """Keep Auto Scaling from terminating training nodes only to even out zones.

    AZRebalance replaces instances to balance AZs, which costs a membership change each time;
    CloudFormation has no property for suspended processes, so it is done once here.
    """
    try:
        gw.groups.suspend_processes(group, ["AZRebalance"])
    except Exception as e:  # noqa: BLE001 - the job runs either way
        gw.ui.warn(
            f"could not suspend AZRebalance on {group} ({describe_client_error(e)}); it may move nodes"
        )
