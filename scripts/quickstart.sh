#!/usr/bin/env bash
# Install petctl into a virtualenv and run the example elastic job on the local cloud:
# base setup, run-job --min 2 --max 4, scale up, scale down (drain), a hard node loss, the loss
# of the rendezvous server, training to completion, and the job's status and timeline. No AWS account needed.
#   usage: scripts/quickstart.sh [petctl local demo options]
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing petctl[local] (torch CPU build, etcd 3.5, moto) into ${PETCTL_VENV:-.venv}"
. scripts/venv.sh local
echo "== petctl local demo"
exec petctl local demo "$@"
