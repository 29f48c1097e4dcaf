"""CloudFormation templates: render them (Jinja2 -> YAML text) and build their parameter lists.

Division of labour:

* Jinja carries *structure* only: how many subnets, whether petctl owns the file system and the
  bucket, CPU or GPU image, spot or on-demand (:mod:`petctl.templates.rendering`).
* Every runtime value (sizes, names, ids, URLs) is a CloudFormation *parameter*, built by
  :func:`infra_parameters` / :func:`job_parameters` (:mod:`petctl.templates.parameters`), so the
  same rendered text can be diffed, linted and shown by ``--dry-run``.

Nothing here talks to AWS (no boto3 import): rendering is pure and fast. Callers import from this
package; the two modules are how it is organised, not part of its interface.
"""

from petctl.templates.parameters import (
    LOG_RETENTION_DAYS,
    SUBNET_PREFIX,
    infra_parameters,
    job_parameters,
    load_template,
    parameters_dict,
    subnet_cidrs,
    template_parameters,
)
from petctl.templates.rendering import (
    CPU_AMI_PARAMETER,
    GPU_AMI_PARAMETER,
    INFRA_OUTPUTS,
    INFRA_TEMPLATE,
    JOB_OUTPUTS,
    JOB_TEMPLATE,
    MAX_AZ_COUNT,
    MIN_AZ_COUNT,
    TEMPLATE_BODY_MAX_BYTES,
    TEMPLATE_PACKAGE,
    TEMPLATE_URL_MAX_BYTES,
    render_infra,
    render_job,
    strip_comments,
)

__all__ = [
    "CPU_AMI_PARAMETER",
    "GPU_AMI_PARAMETER",
    "INFRA_OUTPUTS",
    "INFRA_TEMPLATE",
    "JOB_OUTPUTS",
    "JOB_TEMPLATE",
    "LOG_RETENTION_DAYS",
    "MAX_AZ_COUNT",
    "MIN_AZ_COUNT",
    "SUBNET_PREFIX",
    "TEMPLATE_BODY_MAX_BYTES",
    "TEMPLATE_PACKAGE",
    "TEMPLATE_URL_MAX_BYTES",
    "infra_parameters",
    "job_parameters",
    "load_template",
    "parameters_dict",
    "render_infra",
    "render_job",
    "strip_comments",
    "subnet_cidrs",
    "template_parameters",
]
