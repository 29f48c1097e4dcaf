"""The base infrastructure: ``setup`` (base stack and profile), ``teardown`` (plan, then
delete), ``configure`` (existing resources). A new base-stack check goes into setup.py."""

from petctl.infra.configure import configure
from petctl.infra.setup import apply_outputs, bucket_kms_key, setup
from petctl.infra.teardown import TeardownPlan, plan_teardown, teardown

__all__ = [
    "TeardownPlan",
    "apply_outputs",
    "bucket_kms_key",
    "configure",
    "plan_teardown",
    "setup",
    "teardown",
]
