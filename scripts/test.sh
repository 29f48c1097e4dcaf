#!/usr/bin/env bash
# Set up a fresh virtualenv with everything the tests need, lint, and run the test suite.
# Tests start their own services (a real etcd and a moto server on 127.0.0.1) from fixtures.
#   usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing petctl[all] into ${PETCTL_VENV:-.venv}"
. scripts/venv.sh all
echo "== lint"
ruff check .
ruff format --check .
echo "== tests"
exec python -m pytest "$@"
