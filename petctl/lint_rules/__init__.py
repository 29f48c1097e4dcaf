"""petctl's own cfn-lint rules: the security promises of our templates, checked on every render.

Load them with cfn-lint's ``append_rules`` pointing at :data:`RULES_DIR` (cfn-lint imports each rule
file by path, so the rule modules import what they share absolutely; importing this package does not
import cfn-lint)::

    from cfnlint.api import lint
    from cfnlint.config import ManualArgs
    lint(text, config=ManualArgs(regions=["us-east-1"], append_rules=[str(RULES_DIR)]))

Each rule is deliberately literal: a value hidden behind Fn::If, a parameter without a safe default
or any other intrinsic counts as a violation, because a promise we cannot read is not kept.

Rule ids: E9101-E9113 (the E9xxx range is unused by cfn-lint's built-in rules), by area:
``instances`` (IMDSv2, open ingress, launch configurations, etcd's TLS), ``storage`` (EFS and S3 at
rest, TLS to S3, EFS only through a job's access point) and ``iam`` (managed policies, SSM
parameter reads, S3 writes, who reads the job's TLS keys).
``_common`` holds what they share; cfn-lint skips files starting with ``_``.
"""

from pathlib import Path

RULES_DIR = Path(__file__).resolve().parent

#: ids of the rules defined in this directory.
RULE_IDS = (
    "E9101",
    "E9102",
    "E9103",
    "E9104",
    "E9105",
    "E9106",
    "E9107",
    "E9108",
    "E9109",
    "E9110",
    "E9111",
    "E9112",
    "E9113",
)
