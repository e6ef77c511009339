"""``python -m torchtitan_tide.launch`` (what ``run_train.sh`` runs): :func:`main.main`."""

import sys

from torchtitan_tide.launch.main import discard_stdout, main

try:
    sys.exit(main())
except BrokenPipeError:  # e.g. `--dry-run | head`: the reader is gone, nothing to report
    discard_stdout()
    sys.exit(1)
