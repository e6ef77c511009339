#!/usr/bin/env bash
# Install torchtitan-tide and what it needs into the current Python environment (use a venv).
#   scripts/install.sh              runtime only
#   scripts/install.sh --dev        plus the test tools (pytest, ruff, matplotlib)
#   scripts/install.sh --dry-run    print the pip commands it would run and change nothing
#                                   (also TIDE_INSTALL_DRY_RUN=1)
# torch, in this order:
#   1. a torch in [2.11, 2.16) that is already installed is kept (GPU machines bring their CUDA
#      build; a venv made for torch 2.15 keeps it); the later `pip install -e .` is constrained
#      to it, so it cannot be replaced. Which versions are tested where: docs/guide/install.md.
#   2. TIDE_TORCH_SPEC, if set, is installed as given (e.g. "torch==2.11.0").
#   3. a machine with a GPU (`nvidia-smi -L` lists one) gets `torch>=2.11,<2.14` from the
#      configured index (PyPI: the CUDA build; below 2.14 until a GPU run checks 2.14/2.15).
#   4. a machine without one gets the CPU build torch==2.13.0+cpu: first from the configured
#      sources (pip's find-links / local wheel directories / mirrors), and only if they do not
#      have it from PyTorch's CPU wheel index (TIDE_TORCH_CPU_INDEX). Plain PyPI would resolve
#      the multi-GB CUDA build, so the CPU build is always asked for by its exact `+cpu` version.
# TIDE_GPU=1 / TIDE_GPU=0 overrides the GPU detection.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_CPU_VERSION="2.13.0+cpu"
TORCH_CPU_INDEX="${TIDE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
EXTRA=""
DRY_RUN="${TIDE_INSTALL_DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dev) EXTRA="[dev]" ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "[install] unknown argument '$arg' (accepted: --dev, --dry-run)" >&2; exit 2 ;;
  esac
done

run() {  # print a command; run it unless this is a dry run
  echo "[install] + $*"
  [[ "$DRY_RUN" == "1" ]] || "$@"
}

torch_version() {  # the installed torch as pip names it (PyPI's wheels say 2.15.0, torch
  # itself 2.15.0+cu132: a pin on torch.__version__ would match no installed distribution)
  "$PYTHON" - <<'PY' 2>/dev/null
import torch
try:
    from importlib.metadata import version
    print(version("torch"))
except Exception:  # a torch without distribution metadata (a source tree on the path)
    print(torch.__version__)
PY
}

installed_torch() {  # prints the installed torch version if it is in [2.11, 2.16); else fails
  local v
  v="$(torch_version)" || return 1
  echo "$v"
  "$PYTHON" -c 'import sys; m, n = (int(x) for x in sys.argv[1].split("+")[0].split(".")[:2]); sys.exit(0 if (2, 11) <= (m, n) < (2, 16) else 1)' "$v"
}

has_gpu() {
  case "${TIDE_GPU:-}" in
    1) return 0 ;;
    0) return 1 ;;
  esac
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

[[ "$DRY_RUN" == "1" ]] && echo "[install] dry run: printing the pip commands, running none"
if torch_version="$(installed_torch)"; then
  echo "[install] keeping the installed torch ${torch_version} (fits [2.11, 2.16))"
  pinned="torch==${torch_version}"
elif [[ -n "${TIDE_TORCH_SPEC:-}" ]]; then
  echo "[install] installing ${TIDE_TORCH_SPEC} (TIDE_TORCH_SPEC)"
  run "$PYTHON" -m pip install -q "$TIDE_TORCH_SPEC"
  pinned=""
elif has_gpu; then
  echo "[install] GPU found: installing torch>=2.11,<2.14 (CUDA build) from the configured index"
  run "$PYTHON" -m pip install -q "torch>=2.11,<2.14"
  pinned=""
else
  echo "[install] no GPU found: installing the CPU build torch==${TORCH_CPU_VERSION}"
  if [[ "$DRY_RUN" == "1" ]]; then
    run "$PYTHON" -m pip install -q "torch==${TORCH_CPU_VERSION}"
    echo "[install] (if the configured sources do not have it:)"
    run "$PYTHON" -m pip install -q --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_CPU_VERSION}"
  elif ! run "$PYTHON" -m pip install -q "torch==${TORCH_CPU_VERSION}"; then
    echo "[install] the configured sources have no torch ${TORCH_CPU_VERSION}; using ${TORCH_CPU_INDEX}"
    run "$PYTHON" -m pip install -q --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_CPU_VERSION}"
  fi
  pinned="torch==${TORCH_CPU_VERSION}"
fi
if [[ -z "$pinned" && "$DRY_RUN" != "1" ]]; then
  pinned="torch==$(torch_version)"
fi

# The project's dependencies, with torch constrained to the one chosen above: pip must not
# swap it for another build (e.g. a CUDA wheel) while resolving torchtitan's requirements.
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
[[ -n "$pinned" ]] && echo "$pinned" >"$constraint"
echo "[install] torchtitan-tide${EXTRA} (editable) and its pinned dependencies, with ${pinned:-torch as installed}"
run "$PYTHON" -m pip install -q -c "$constraint" -e "${REPO}${EXTRA}"
[[ "$DRY_RUN" == "1" ]] && { echo "[install] dry run: nothing was installed"; exit 0; }
"$PYTHON" -c "import torch, torchtitan, torchtitan_tide; print(f'[install] torch {torch.__version__}, torchtitan {torchtitan.__version__}, CUDA available: {torch.cuda.is_available()}')"
