"""``python -m torchtitan_tide.simulator``: the simulator's CLI (``cli.main``)."""

import sys

from torchtitan_tide.simulator.cli import main

sys.exit(main())
