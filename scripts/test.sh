#!/usr/bin/env bash
# Set up a fresh virtualenv with everything the tests need, lint, and run the test suite.
# Tests start their own services (a real etcd and a moto server on 127.0.0.1) from fixtures.
#   usage: scripts/test.sh [pytest args...]
# pytest runs on 3 xdist workers (PETCTL_TEST_WORKERS; 0 = one process): two for the tests that
# use the CPU (training jobs, torch processes, moto), which overlap well even on 2 cores, and a
# third, the waiting lane, for the modules marked pytest.mark.waits (threads sleeping on etcd
# TTLs and lease windows). tests/conftest.py orders the work, keeps the training-job tests
# (faults, e2e) off each other's cores and keeps the waiting lane to its modules.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing petctl[all] into ${PETCTL_VENV:-.venv}"
. scripts/venv.sh all
echo "== lint"
ruff check .
ruff format --check .
echo "== tests"
exec python -m pytest -n "${PETCTL_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder "$@"
