#!/usr/bin/env bash
# The TorchTitan 0.3.0 example (scripts/examples/torchtitan_0_3/comm_apply_llama3.py) and its test, in a
# venv of its own: TorchTitan 0.3.0 with the CPU build of torch 2.13 (0.3.0 needs torch >= 2.12
# and datasets < 4.8; this project's trainer stays on 0.2.2). CI runs it (.ci/run).
#   bash scripts/test_torchtitan030.sh              # tests/test_torchtitan030_example.py
# TIDE_TT030_VENV: the venv (default .venv-torchtitan030 in the repository; made if missing).
# torch comes as install.sh gets the CPU build (configured sources, else PyTorch's CPU index).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TIDE_TT030_VENV:-$REPO/.venv-torchtitan030}"
PY="$VENV/bin/python"
TORCH_CPU="2.13.0+cpu"
TORCH_CPU_INDEX="${TIDE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
start=$SECONDS

[[ -x "$PY" ]] || python3 -m venv "$VENV"
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torchtitan') != '0.3.0')" \
    2>/dev/null; then
  "$PY" -m pip install -q "torch==$TORCH_CPU" \
    || "$PY" -m pip install -q --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_CPU"
  # torch pinned to the build above; TorchTitan imports triton even on CPU (as 0.2.2 does)
  constraint="$(mktemp)"
  trap 'rm -f "$constraint"' EXIT
  echo "torch==$TORCH_CPU" >"$constraint"
  "$PY" -m pip install -q -c "$constraint" "torchtitan==0.3.0" "datasets<4.8" "triton>=3.2" \
    "pytest>=8"
fi
echo "[torchtitan030] venv ready in $((SECONDS - start)) s"
cd "$REPO"
(($#)) || set -- tests/test_torchtitan030_example.py
# this repository on the path (not installed: its pinned torchtitan==0.2.2 would replace 0.3.0)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m pytest -q "$@"
