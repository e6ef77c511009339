#!/usr/bin/env bash
# The README's second command: install with test tools, then run the CPU test suite.
# GPU tests are marked `gpu` and skip without CUDA (scripts/gpu/check.sh runs them).
# Arguments go to pytest as given, instead of the whole suite:
#   bash scripts/test.sh tests/test_launch.py -k help
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh" --dev
cd "$REPO"
(($#)) || set -- tests  # no arguments: the whole suite
exec "${PYTHON:-python3}" -m pytest -q "$@"
