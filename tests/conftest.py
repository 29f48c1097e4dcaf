"""Safety net for every test: fake credentials, no instance metadata, a private PETCTL_HOME.

No test may reach real AWS. If a test forgets to point boto3 at moto, the default
endpoint below (a closed loopback port) makes its AWS calls fail at once.
"""

from __future__ import annotations

import os
import tempfile

import pytest

_HOME = tempfile.mkdtemp(prefix="petctl-test-home-")

for _k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "PETCTL_PROFILE"):
    os.environ.pop(_k, None)
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.path.join(_HOME, "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(_HOME, "aws-credentials"),
        "PETCTL_HOME": _HOME,
        "PETCTL_LOCAL_DIR": os.path.join(_HOME, "local"),
    }
)
os.environ.setdefault("AWS_ENDPOINT_URL", "http://127.0.0.1:9")


# ---- scheduling under pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup --no-loadscope-reorder) ----
# Work units, started in this order (the order of the collection: xdist keeps it without reorder):
#  1. "torch-jobs": tests/faults and tests/e2e, each a whole training job through faults (4-7
#     torch processes, minutes, bounded by "the job must not finish before the fault"). One
#     unit, so two of them never share the 2 cores; first, so the longest chain starts at once.
#  2. "local-cloud": the tests/local tests on its session-wide daemon (the ``cloud`` fixture), one
#     unit: the daemon starts once, on one worker.
#  3. each other tests/local and tests/agent file: its module fixtures (a moto server, an etcd, a
#     TLS etcd) start once.
#  4. tests/functional and tests/unit, test by test: short units that fill both workers' tails.
# Without xdist the order is the same and the marks do nothing.
_GROUPS = {"faults": "torch-jobs", "e2e": "torch-jobs"}
_ORDER = {"faults": 0, "e2e": 0, "local": 1, "agent": 2, "functional": 3, "unit": 4}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items) -> None:
    here = os.path.dirname(os.path.abspath(__file__))

    def where(item) -> tuple[str, str]:
        rel = os.path.relpath(str(item.path), here)
        return rel.split(os.sep, 1)[0], rel

    for item in items:
        top, rel = where(item)
        if top == "local" and "cloud" in getattr(item, "fixturenames", ()):
            group = "local-cloud"
        else:
            group = _GROUPS.get(top) or (rel if top in ("local", "agent") else None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _ORDER.get(where(item)[0], 5))  # stable: files stay in order
