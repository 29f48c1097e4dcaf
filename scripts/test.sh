#!/usr/bin/env bash
# Set up a fresh virtualenv with everything the tests need, lint, and run the test suite.
# Tests start their own services (a real etcd and a moto server on 127.0.0.1) from fixtures.
#   usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PETCTL_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "${FIND[@]}" "torch==2.13.0"
python -m pip install -q "${FIND[@]}" -e '.[all]'
echo "== lint"
ruff check .
ruff format --check .
echo "== tests"
exec python -m pytest "$@"
