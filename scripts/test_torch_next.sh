#!/usr/bin/env bash
# The comm/ CPU tests on the newest torch this project supports, in a venv of its own, beside
# the suite's torch (scripts/test.sh: the CPU build 2.13). CI runs both (.ci/run).
#   bash scripts/test_torch_next.sh                                  # tests/comm
#   bash scripts/test_torch_next.sh tests/comm/test_parity_cpu.py -k world2   # pytest arguments
# TIDE_TORCH_NEXT: the torch release (default 2.15.0); TIDE_TORCH_NEXT_VENV: the venv (default
# .venv-torch-next in the repository; made if missing, reused if it has that torch).
# No CPU-only wheel of 2.15 exists: the regular wheel (with its CUDA libraries: about 3.5 GB to
# download, 5.3 GB in the venv) runs on CPU. A pip config that caps torch with a constraint file
# (`pip config list` shows it; e.g. at the releases on a machine's disk) is lifted for this venv's
# installs only (PIP_CONSTRAINT=/dev/null). Which versions are tested where: docs/guide/install.md.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_NEXT="${TIDE_TORCH_NEXT:-2.15.0}"
VENV="${TIDE_TORCH_NEXT_VENV:-$REPO/.venv-torch-next}"
PY="$VENV/bin/python"
start=$SECONDS

[[ -x "$PY" ]] || python3 -m venv "$VENV"
if "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != sys.argv[1])" \
    "$TORCH_NEXT" 2>/dev/null; then
  echo "[torch-next] $VENV has torch $TORCH_NEXT"
else
  echo "[torch-next] installing torch==$TORCH_NEXT into $VENV (the regular wheel; runs on CPU)"
  PIP_CONSTRAINT=/dev/null "$PY" -m pip install -q "torch==$TORCH_NEXT"
fi
# The project and its pinned dependencies; install.sh keeps the torch above (it fits [2.11, 2.16)).
PIP_CONSTRAINT=/dev/null PYTHON="$PY" bash "$REPO/scripts/install.sh" --dev
echo "[torch-next] installed in $((SECONDS - start)) s"

cd "$REPO"
(($#)) || set -- tests/comm
echo "[torch-next] torch $("$PY" -c 'import torch; print(torch.__version__)'): pytest $*"
exec "$PY" -m pytest -q "$@"
