"""TIDE on NCCL windows through TorchTitan's own parallelize functions (CPU stand-in of the
one-sided calls, ``TIDE_RMA_STANDIN=1``): the layout matrix of ``test_layouts_cpu.py``
(``_layouts.run_layout``: every sharded gradient after every backward and every unsharded
parameter after every all-gather against stock FSDP2, outputs poisoned, TIDE calls counted
per FSDP group) with TIDE told N nodes x L, every group on the window transport."""

from __future__ import annotations

import os

import pytest
from _harness import spawn
from _layouts import Layout, run_layout


def _on_windows(rank: int, world: int, layout: Layout) -> None:
    os.environ["TIDE_RMA_STANDIN"] = "1"
    run_layout(rank, world, layout)


WINDOWS = {"expect_transport": "WindowTransport"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [
        # 2 nodes x 2: both tiers on the window, phase 2 on the ring; 4 ranks add: 1e-5
        (4, Layout(local_world_sizes=(2,), param_dtype="float32", tolerance=1e-5, **WINDOWS)),
        # HSDP: shard groups of 2 ranks as 2 nodes x 1, FSDP2's all-reduce across replicas
        (4, Layout(dp_replicate=2, dp_shard=2, local_world_sizes=(1,), **WINDOWS)),
        # EP: dense groups 2 x 2, expert groups (efsdp, 2 ranks) 1 x 2 on their own window
        (4, Layout(model="qwen3_moe", dp_shard=4, ep=2, param_dtype="float32", tolerance=1e-5,
                   local_world_sizes=(2,), **WINDOWS)),
        # PP: 2 model parts per rank, each with its groups on one window per process group
        (4, Layout(pp=2, dp_shard=2, pp_schedule="Interleaved1F1B", local_world_sizes=(1,),
                   **WINDOWS)),
    ],
    ids=["fsdp-2x2", "hsdp-2x1", "ep-2x2", "pp-2x1"],
)  # fmt: skip
def test_windows_layouts(world, layout):
    spawn(_on_windows, world, layout)
