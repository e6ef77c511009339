"""torchtitan-tide: TorchTitan 0.2.2 training recipes with switchable FSDP2 communication.

Importing the package does not import TorchTitan: ``torchtitan_tide.train`` must be able
to switch TorchTitan to the CPU device before TorchTitan's modules are loaded.
Public entry points: ``torchtitan_tide.train`` (training), ``torchtitan_tide.launch``
(what ``run_train.sh`` runs: ``python -m torchtitan_tide.launch``), ``torchtitan_tide.comm``
(apply a comm mode to any ``fully_shard`` model), ``torchtitan_tide.config`` (the ``[tide]``
TOML section). Which folder owns what: docs/design/2026-12-02-package-map.md.
"""

__version__ = "0.1.0"
