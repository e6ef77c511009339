#!/usr/bin/env bash
# Launch training: ./run_train.sh --config NAME[.toml] [--dry-run] [--section.key value ...]
# NAME resolves in train_configs/ or as a path. World size from NGPU / NNODES / NODE_RANK /
# MASTER_ADDR / MASTER_PORT or SLURM's variables; see torchtitan_tide/launch/main.py.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m torchtitan_tide.launch "$@"
