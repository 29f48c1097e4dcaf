#!/usr/bin/env bash
# Set up a fresh virtualenv with everything the tests need, lint, and run the test suite.
# Tests start their own services (a real etcd and a moto server on 127.0.0.1) from fixtures.
#   usage: scripts/test.sh [pytest args...]
# pytest runs on 2 xdist workers (PETCTL_TEST_WORKERS; 0 = one process): many tests wait on
# etcd TTLs, boots and training jobs, so two overlap well even on 2 cores. tests/conftest.py
# orders the work and keeps the training-job tests (faults, e2e) off each other's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing petctl[all] into ${PETCTL_VENV:-.venv}"
. scripts/venv.sh all
echo "== lint"
ruff check .
ruff format --check .
echo "== tests"
exec python -m pytest -n "${PETCTL_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
