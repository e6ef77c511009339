"""``python -m torchtitan_tide.preflight`` (what ``run_train.sh --preflight`` runs under
torchrun, with the trainer's arguments): :func:`main.main`."""

from torchtitan_tide.preflight.main import main

main()
