"""Step simulator: one training step per comm mode at any GPU count and node shape, from
a one-GPU layer trace and the committed 2x H200 measurements (a SIMULATION, not a
measurement).

    python -m torchtitan_tide.simulator --config llama70b_tide --gpus 64
        [--trace T.json] [--cluster train_configs/clusters/h200_8x400g.toml]
        [--modes fsdp2,symm_mem,tide,tide_ag] [--rs-wire bf16] [--cross-node auto|p2p]
        [--transport auto|nccl_windows|copy_engine|nccl_p2p] [--tokens-per-gpu N]
    python -m torchtitan_tide.simulator --report [--out-dir bench/results]

Modules, each importing only those before it: ``cluster`` (node shape, NIC, NCCL
generation), ``engine`` (ops on streams, interference rates, shared links), ``network``
(alpha-beta, NIC, NV18, NCCL channels), ``results`` (the committed results),
``interference`` (both directions per engine and compute class), ``plans`` (TIDE's op
plans as the code runs them: ``comm/plans/window_rounds.py``, ``comm/plans/plan.py``), ``compute``
(attention, activation checkpointing), ``inputs`` (every measured figure and its source),
``step`` (the step model of each mode; TIDE's ops charged by type), ``report``
(validation, headline with ceilings, 64-GPU comparison with breakdown, sensitivity,
picture), ``cli``. docs/design/2026-12-02-simulator.md, docs/design/2026-12-04-simulator.md and
docs/design/2026-12-07-simulator.md explain the model, its inputs and its residuals.
"""
