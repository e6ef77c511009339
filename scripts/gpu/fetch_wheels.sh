#!/usr/bin/env bash
# Download, here, the pure-Python wheels the GPU machine lacks (Python 3.12, x86-64) into
# .whl/ (git-ignored). The device call carries .whl and scripts/gpu/check.sh installs them
# with --no-index --no-deps. Versions match pyproject.toml's pins.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$REPO/.whl"
mkdir -p "$DEST"
WHEELS=(
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 datasets==5.2.0
  dill==0.4.0 multiprocess==0.70.18 docstring-parser==0.18.0 typeguard==4.6.1
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" "${WHEELS[@]}"
ls -la "$DEST"
