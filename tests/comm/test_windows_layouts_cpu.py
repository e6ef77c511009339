"""TIDE on NCCL windows through TorchTitan's own parallelize functions (CPU stand-in of the
one-sided calls, ``TIDE_RMA_STANDIN=1``): the layout matrix of ``test_layouts_cpu.py``
(``_layouts.run_layout``: every sharded gradient after every backward and every unsharded
parameter after every all-gather against stock FSDP2, outputs poisoned, TIDE calls counted
per FSDP group, the window arena's bytes equal after every step) with TIDE told N nodes x L,
every group on the window transport; TIDE-AG in place wherever a group spans nodes (the
default arena), counted."""

from __future__ import annotations

import os

import pytest
from _harness import spawn
from _layouts import Layout, run_layout


def _on_windows(rank: int, world: int, layout: Layout) -> None:
    os.environ["TIDE_RMA_STANDIN"] = "1"
    rec = run_layout(rank, world, layout)
    counters = [t.counters for t in rec.transports.values()]
    spans_nodes = any(t.in_place is not None for t in rec.transports.values())
    if spans_nodes:  # in place at N x L: every shard straight into parameter storage
        assert sum(c.in_place_all_gathers for c in counters) > 0, "no all-gather in place"
        assert sum(c.credits for c in counters) > 0, "no arena range released"


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [
        # TP 2 x dp_shard 2: the FSDP groups (2 ranks) as 2 nodes x 1, DTensor parameters
        (4, Layout(dp_shard=2, tp=2, local_world_sizes=(1,), **WINDOWS)),
        # per-block torch.compile, full and selective activation checkpointing at 2 x 2
        (4, Layout(compile=True, local_world_sizes=(2,), param_dtype="float32",
                   tolerance=1e-5, **WINDOWS)),
        (4, Layout(ac="full", local_world_sizes=(2,), param_dtype="float32", tolerance=1e-5,
                   **WINDOWS)),
        (4, Layout(ac="selective", selective_ac_option="op", local_world_sizes=(2,),
                   param_dtype="float32", tolerance=1e-5, **WINDOWS)),
        # PP 2 stages x dp_shard 4 as 2 x 2, frozen first stage (fine-tuning), 8 ranks
        (8, Layout(pp=2, dp_shard=4, local_world_sizes=(2,), param_dtype="float32",
                   tolerance=1e-5, frozen=("tok_embeddings", "layers.0."), **WINDOWS)),
        # the Qwen3 MoE model at 4 x 2 (8 ranks), experts sharded with the dense groups
        (8, Layout(model="qwen3_moe", num_experts=4, local_world_sizes=(2,),
                   param_dtype="float32", tolerance=1e-5, **WINDOWS)),
    ],
    ids=["tp-2x1", "compile-2x2", "ac-full-2x2", "ac-selective-2x2", "pp-frozen-2x2",
         "qwen3-moe-4x2"],
)  # fmt: skip
def test_windows_layouts_in_place_at_n_by_l(world, layout):
    spawn(_on_windows, world, layout)
