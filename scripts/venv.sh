# Sourced by quickstart.sh and test.sh: create/activate the virtualenv and install petctl with
# the extras given as $1. The CPU build of torch goes first: an unpinned torch would pull a
# multi-GB CUDA build. PETCTL_VENV chooses the virtualenv (default .venv in the checkout).
# Progress: one line when a stage starts and one with its time when it ends; on a terminal pip
# shows its own progress (downloads), elsewhere (CI, a pipe) pip runs quiet.
VENV="${PETCTL_VENV:-$PWD/.venv}"
if [ -t 1 ]; then PIP_Q=(); else PIP_Q=(-q); fi
_VENV_T0=$SECONDS

# venv_stage N WHAT CMD...: run CMD as stage N of 3, say how long it took, or that it failed.
venv_stage() {
  local n=$1 what=$2 t0=$SECONDS rc=0
  shift 2
  echo "== [$n/3] $what"
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! [$n/3] $what: failed (exit $rc) after $((SECONDS - t0))s" >&2
    return "$rc"
  fi
  echo "   [$n/3] done in $((SECONDS - t0))s"
}

if [ -x "$VENV/bin/python" ]; then
  venv_stage 1 "virtualenv $VENV (exists)" true
else
  venv_stage 1 "virtualenv $VENV" python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# A local wheel directory if this machine has one (it holds the CPU torch), else PyTorch's CPU index.
if [ -d /opt/wheels ]; then
  FIND=(--find-links /opt/wheels)
else
  FIND=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
venv_stage 2 "torch 2.13.0, CPU build (about 200 MB to fetch on a first install)" \
  python -m pip install "${PIP_Q[@]}" "${FIND[@]}" "torch==2.13.0"
venv_stage 3 "petctl[$1] and its dependencies" \
  python -m pip install "${PIP_Q[@]}" "${FIND[@]}" -e ".[$1]"
echo "== installed petctl[$1] into $VENV in $((SECONDS - _VENV_T0))s"
