#!/usr/bin/env bash
# Install torchtitan-tide and what it needs into the current Python environment.
#   scripts/install.sh          runtime only
#   scripts/install.sh --dev    plus the test tools (pytest, ruff, matplotlib)
# torch: kept if a version in [2.11, 2.14) is already installed (GPU machines bring their
# CUDA build). Otherwise GPU machines get `torch>=2.11,<2.14` and CPU-only machines the CPU
# build `torch==2.13.0` (never a multi-GB CUDA build). Override with TIDE_TORCH_SPEC.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
EXTRA=""
[[ "${1:-}" == "--dev" ]] && EXTRA="[dev]"

have_torch() {
  "$PYTHON" - <<'PY' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 14) else 1)
PY
}

if ! have_torch; then
  if [[ -n "${TIDE_TORCH_SPEC:-}" ]]; then
    spec="$TIDE_TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.11,<2.14"
  else
    spec="torch==2.13.0"
  fi
  echo "[install] installing $spec"
  "$PYTHON" -m pip install -q "$spec"
fi
echo "[install] torchtitan-tide${EXTRA} (editable) and its pinned dependencies"
"$PYTHON" -m pip install -q -e "${REPO}${EXTRA}"
"$PYTHON" -c "import torch, torchtitan, torchtitan_tide; print(f'[install] torch {torch.__version__}, torchtitan {torchtitan.__version__}, CUDA available: {torch.cuda.is_available()}')"
