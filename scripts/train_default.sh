#!/usr/bin/env bash
# The README's first command: install, then train the embedded debug model
# (2 CPU processes on gloo where no GPU exists, all GPUs otherwise).
# Extra arguments go to run_train.sh, e.g. --tide.comm tide --training.steps 50.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
exec "$REPO/run_train.sh" --config debug_model.toml "$@"
