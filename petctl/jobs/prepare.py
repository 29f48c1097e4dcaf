"""From a request to a plan, in order: validate, look up what AWS must tell, read the code, plan."""

from __future__ import annotations

import secrets
from pathlib import Path

from petctl import storage
from petctl.context import Context
from petctl.jobs import ebs_key, requirements
from petctl.jobs.lookups import (
    check_code_url,
    instance_facts,
    public_subnets,
    resolve_ami,
    resolve_vpc,
    use_bucket_etcd,
)
from petctl.jobs.planning import Plan, plan, prepare_code
from petctl.jobs.request import JobRequest, check_instance_types, validate_request


def prepare(ctx: Context, req: JobRequest) -> Plan:
    """The plan ``run-job`` shows (``--dry-run``) or applies; nothing is created here."""
    validate_request(req)
    # the job's packages: a refusal (another torch, a file outside the project) before any AWS call
    project = Path(req.target) if not req.target.startswith("s3://") and Path(req.target).is_dir() else None
    reqs = requirements.check(
        requirements.find(req.target, req.requirements, req.no_requirements),
        req.torch_version,
        project,
    )
    ctx.profile.require_ready()
    check_code_url(ctx, req)
    facts = instance_facts(ctx, req)
    check_instance_types(req, facts)
    use_bucket_etcd(ctx, req, facts)
    resolve_ami(ctx, req)
    resolve_vpc(ctx)
    public = public_subnets(ctx, req, facts)
    ebs_key.check(ctx)
    code = prepare_code(req, dist=storage.dist_wheel())
    # a fresh id per run-job: the job's name, and its checkpoint dir, are kept across runs
    run_id = secrets.token_hex(8)
    return plan(
        req,
        ctx.profile,
        code,
        facts,
        user=ctx.user,
        region=ctx.region,
        run_id=run_id,
        reqs=reqs,
        public_subnets=public,
    )
