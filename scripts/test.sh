#!/usr/bin/env bash
# Set up a fresh virtualenv with everything the tests need, lint, and run the test suite.
# Tests start their own services (a real etcd and a moto server on 127.0.0.1) from fixtures.
#   usage: scripts/test.sh [pytest args...]
# pytest runs on 4 xdist workers (PETCTL_TEST_WORKERS; 0 = one process): many tests mostly wait
# on etcd TTLs, leases and boots (tests/agent/test_rdzv_v3_fastloss.py: 8 s of CPU in 170 s), so
# four overlap them with the CPU-bound ones even on 2 cores (pytest 21-26 min here, 28-30 with two).
# tests/conftest.py orders the work and keeps the training-job tests in two chains (faults, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing petctl[all] into ${PETCTL_VENV:-.venv}"
. scripts/venv.sh all
echo "== lint"
ruff check .
ruff format --check .
echo "== tests"
exec python -m pytest -n "${PETCTL_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder "$@"
