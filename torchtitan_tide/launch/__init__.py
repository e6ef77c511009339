"""The launcher ``run_train.sh`` runs (``python -m torchtitan_tide.launch``), one job a file.

Imports run one way, top to bottom: ``main`` (the order of a launch, ``--help``) ->
``summary`` (what it prints) / ``command`` (torchrun and its environment) -> ``checks``
(every reason a run is refused) -> ``command_line`` (the config and the overrides) /
``world`` (nodes, processes, device) / ``job_config`` (the trainer's arguments, parsed as
TorchTitan will) -> ``errors``. Only the standard library is imported at module level:
``--help`` works before the install.
"""
