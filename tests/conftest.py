"""Safety net for every test: fake credentials, no instance metadata, a private PETCTL_HOME.

No test may reach real AWS. If a test forgets to point boto3 at moto, the default
endpoint below (a closed loopback port) makes its AWS calls fail at once.
"""

from __future__ import annotations

import ast
import functools
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
#
# The units are made by the scheduler below, from each test's id: xdist's own loadgroup reads the
# xdist_group marks by renaming the items' node ids, which pytest 9 ignores (its node ids are no
# longer that attribute), so with the marks alone every test was a unit of its own: two training
# jobs shared the 2 cores and each worker started a local-cloud daemon of its own.
_GROUPS = {"faults": "torch-jobs", "e2e": "torch-jobs"}
_ORDER = {"faults": 0, "e2e": 0, "local": 1, "agent": 2, "functional": 3, "unit": 4}
_HERE = os.path.dirname(os.path.abspath(__file__))
_DAEMON_FIXTURE = "cloud"  # tests/local/conftest.py: the session-wide local-cloud daemon


def _daemon_users(path: str) -> frozenset[str]:
    """The test functions of a tests/local module that use the ``cloud`` fixture, directly or
    through a fixture of tests/local that does (read from the source: the controller of an xdist
    run collects nothing, and must group the same tests the workers mark)."""
    return _daemon_users_cached(os.path.abspath(path))


@functools.cache
def _local_fixtures_using_the_daemon() -> frozenset[str]:
    uses: dict[str, set[str]] = {}
    for name in sorted(os.listdir(os.path.join(_HERE, "local"))):
        if name.endswith(".py"):
            for fn in _functions(os.path.join(_HERE, "local", name)):
                if any(_is_fixture(d) for d in fn.decorator_list):
                    uses.setdefault(fn.name, set()).update(a.arg for a in fn.args.args)
    found = {_DAEMON_FIXTURE}
    while True:
        more = {f for f, args in uses.items() if args & found} - found
        if not more:
            return frozenset(found)
        found |= more


@functools.cache
def _daemon_users_cached(path: str) -> frozenset[str]:
    daemon = _local_fixtures_using_the_daemon()
    return frozenset(
        fn.name
        for fn in _functions(path)
        if fn.name.startswith("test") and {a.arg for a in fn.args.args} & daemon
    )


def _functions(path: str) -> list[ast.FunctionDef]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return []
    return [n for n in tree.body if isinstance(n, ast.FunctionDef)]


def _is_fixture(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "fixture"


def _where(nodeid: str) -> tuple[str, str]:
    """(top directory under tests/, path under tests/) of a node id (rootdir-relative)."""
    path = nodeid.split("::", 1)[0]
    rel = os.path.relpath(os.path.join(os.path.dirname(_HERE), path), _HERE)
    return rel.split(os.sep, 1)[0], rel


def _group(nodeid: str) -> str | None:
    """The work unit of a test (None: a unit of its own)."""
    top, rel = _where(nodeid)
    if top == "local":
        test = nodeid.split("::", 1)[1].split("[", 1)[0] if "::" in nodeid else ""
        if test in _daemon_users(os.path.join(_HERE, rel)):
            return "local-cloud"
        return rel
    return _GROUPS.get(top) or (rel if top == "agent" else None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        group = _group(item.nodeid)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _ORDER.get(_where(item.nodeid)[0], 5))  # stable: files stay in order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: the units above, from the node ids (see the note above)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Units(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)  # a node id xdist suffixed with its group itself
            return scope if scope != nodeid else (_group(nodeid) or nodeid)

    return Units(config, log)
