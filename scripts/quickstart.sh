#!/usr/bin/env bash
# Install petctl into a virtualenv and run the example elastic job on the local cloud:
# base setup, run_job --min 2 --max 4, scale up, scale down (drain), a hard node loss,
# training to completion, and the job's status and timeline. No AWS account needed.
#   usage: scripts/quickstart.sh [petctl local demo options]
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
echo "== installing petctl (torch CPU build, etcd 3.5, moto) into $VENV"
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "${FIND[@]}" "torch==2.13.0"
python -m pip install -q "${FIND[@]}" -e '.[local]'
echo "== petctl local demo"
exec petctl local demo "$@"
