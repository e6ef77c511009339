"""TIDE-AG in place under partial fine-tuning (frozen layers), against stock FSDP2, on the
CPU stand-in of NCCL's one-sided calls (``TIDE_RMA_STANDIN=1``, gloo ranks as nodes of one
rank: the in-place path, ``transports/windows/transport.py``).

Freezing the embedding and the first block makes FSDP2's backward prefetch all-gather that
block from the second block's pre-backward; its backward never runs, and FSDP2's
``finalize_backward`` drops the all-gather without a reshard. TIDE reshards such a group
after FSDP2's method (``fsdp_patch``): its arena range goes back, so the arena holds the same
bytes after every step (asserted by ``_layouts.run_layout``) and never runs full, and the
next bind of the group never finds its storage still bound. Before that fix the native swap
stopped step 1 ("Trying to resize storage that is not resizable") and the ctypes swap lost a
range per step. Each layout: gradients after every backward, unsharded parameters after every
all-gather, losses, bitwise (two ranks); in-place all-gathers, credits and (where the case
makes FSDP2 drop one) resharded dropped all-gathers counted.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from _harness import spawn
from _layouts import Layout, run_layout

BASE = Layout(local_world_sizes=(1,), expect_transport="WindowTransport", steps=3,
              frozen=("tok_embeddings", "layers.0."))  # fmt: skip
FIRST = {  # frozen embedding + first block: the dropped all-gather
    "default": BASE,
    "no-reshard-after-forward": replace(BASE, reshard_after_forward="never"),
    "prefetch-off": replace(BASE, prefetch="off"),
    "prefetch-explicit": replace(BASE, prefetch="explicit"),
    "ctypes-swap": replace(BASE, tide={"ag_storage_swap": "ctypes"}),
}
MIDDLE = {  # frozen middle blocks of four: their backward runs (activations need it)
    "middle": replace(BASE, n_layers=4, frozen=("layers.1.", "layers.2.")),
    "middle-reshard-always": replace(BASE, n_layers=4, frozen=("layers.1.", "layers.2."),
                                     reshard_after_forward="always"),
}


def _worker(rank: int, world: int, cases: dict, expect_dropped: bool) -> None:
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.transports.windows import storage_swap

    os.environ["TIDE_RMA_STANDIN"] = "1"
    for label, layout in cases.items():
        if layout.tide.get("ag_storage_swap") == "ctypes":  # as on torch 2.11
            storage_swap._native_available = lambda: False
        fsdp_patch.dropped_all_gathers.clear()
        try:
            rec = run_layout(rank, world, layout)
        finally:
            storage_swap._native_available = lambda: hasattr(
                __import__("torch").UntypedStorage, "_swap_data_ptr_")
        counters = [t.counters for t in rec.transports.values()]
        assert sum(c.in_place_all_gathers for c in counters) > 0, label
        assert sum(c.credits for c in counters) > 0, label
        assert sum(c.arena_full for c in counters) == 0, f"{label}: the arena ran full"
        dropped = sum(fsdp_patch.dropped_all_gathers.values())
        # FSDP2 drops the prefetched block's all-gather where the block was resharded after
        # forward and a backward prefetch unshards it; with reshard_after_forward "never" it
        # is still unsharded (the prefetch does nothing), and without prefetch nothing drops
        drops = (expect_dropped and layout.prefetch != "off"
                 and layout.reshard_after_forward != "never")  # fmt: skip
        assert (dropped > 0) == drops, f"{label}: {dropped} dropped all-gathers, expected {drops}"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FIRST))
def test_frozen_first_block_in_place_like_fsdp2(case):
    spawn(_worker, 2, {case: FIRST[case]}, True)


@pytest.mark.slow
def test_frozen_middle_blocks_in_place_like_fsdp2():
    spawn(_worker, 2, MIDDLE, False)


@pytest.mark.slow
def test_frozen_first_stage_under_pp_in_place_like_fsdp2():
    """PP 2 stages x dp_shard 2 (4 ranks; TIDE on the dp_shard groups as 2 nodes x 1): the
    first stage's embedding and block frozen."""
    layout = replace(BASE, pp=2, dp_shard=2, frozen=("tok_embeddings", "layers.0."))
    spawn(_worker, 4, {"pp": layout}, False)
