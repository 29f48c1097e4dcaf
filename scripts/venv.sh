# Sourced by quickstart.sh and test.sh: create/activate the virtualenv and install petctl with
# the extras given as $1. The CPU build of torch goes first: an unpinned torch would pull a
# multi-GB CUDA build. PETCTL_VENV chooses the virtualenv (default .venv in the checkout).
VENV="${PETCTL_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# A local wheel directory if this machine has one (it holds the CPU torch), else PyTorch's CPU index.
if [ -d /opt/wheels ]; then
  FIND=(--find-links /opt/wheels)
else
  FIND=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
python -m pip install -q "${FIND[@]}" "torch==2.13.0"
python -m pip install -q "${FIND[@]}" -e ".[$1]"
