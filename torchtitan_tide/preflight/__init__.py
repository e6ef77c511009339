"""``run_train.sh --config NAME --preflight``: TIDE's assumptions checked on the user's own
cluster, on the training run's world and config, before the first real run
(docs/design/2026-12-04-preflight.md).

Imports run one way, top to bottom: ``main`` (the order of a run, the table) -> ``rates``
(collectives per tier, cluster file, simulator) -> ``parity`` (tide vs fsdp2 gradients) /
``paths`` (what TIDE's install chose) / ``one_sided`` (the one-sided protocol under stress)
/ ``facts`` (what each rank has) -> ``model`` (the small model on the job's mesh) /
``layout`` (the job's FSDP mesh and TIDE's tiers) -> ``bounds`` (time bounds, the control
group) -> ``report`` (rows, table, JSON). Training code is untouched: the launcher starts
this package in place of ``torchtitan_tide.train``.
"""
