#!/usr/bin/env bash
# The README's second command: install with test tools, then run the CPU test suite.
# GPU tests are marked `gpu` and skip without CUDA (scripts/gpu/check.sh runs them).
# Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh" --dev
cd "$REPO"
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
