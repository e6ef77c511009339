"""The paper's layout on ONE GPU: N nodes x L ranks as N*L processes on GPU 0 that NCCL
sees as ONE node (``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30 in torch's place:
scripts/gpu/check.sh's ``nxl`` stage swaps it in), TIDE told the layout
(``local_world_size = L``): both tiers run TIDE's own code on NCCL windows, node-local
puts and cross-node puts by copy engine (docs/design/2026-12-04-windows.md). At every layout
the all-gather goes in place (the default, ``[tide] ag_in_place_groups = 4``,
docs/design/2026-12-07-zero-copy-nxl.md): every shard put straight into the parameters'
storage on the window's arena, node-local forwards arena to arena, asserted from the
transport's counters (0 placement copies) and install's log of the storage swap it took
(torch 2.11 has no ``UntypedStorage._swap_data_ptr_``: the tests name ``[tide]
ag_storage_swap = "ctypes"``); 3x1 and 2x2 with an arena of one group mix in place and
placement. Where no swap works install logs why and every all-gather places with copies.
Partial fine-tuning (frozen embedding and first block) runs at 3x1 and 2x2 with the arena's
bytes equal after every step.

Each run: TorchTitan's own parallelize functions build a Llama-shaped model and the Qwen3
MoE model with bf16 parameters and fp32 reduce (``_layouts.run_layout``); a stock FSDP2
copy and a TIDE copy train in lockstep. After every backward each local gradient shard,
after every all-gather (forward and backward) each unsharded parameter, and the losses are
compared with stock's: TIDE-RS adds L rows, then the other nodes' partials, in its own
order, NCCL its ring's, so 1e-5 relative (both fp32 sums of the same bf16 gradients), with
the parameters re-synchronized after each step (the all-gathers then bitwise). TIDE's
outputs are NaN-poisoned before every all-gather and every window half after its last read;
every FSDP group must have run TIDE-AG on ``WindowTransport`` and TIDE-RS as N nodes x L
(counted per call), and the log must say so. HSDP (dp_replicate 2 x dp_shard 4 as 2 x 2)
and EP (Qwen3, dp_shard 4 x ep 2) run in the same bed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        bash scripts/gpu/nccl_swap.sh .nccl -- python3 -m pytest -q -m "gpu and nxl" tests
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from _emulation import spawn_emulated
from _layouts import Layout, run_layout

from torchtitan_tide.comm import TideOptions
from torchtitan_tide.comm.transports.windows.nccl_rma import multi_rank_gpu_missing_reason
from torchtitan_tide.comm.transports.windows.storage_swap import swap_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.emulation,
    pytest.mark.one_node,
    pytest.mark.nxl,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SWAP = {"ag_storage_swap": "ctypes"}  # torch 2.11 lacks the native storage swap
BASE = Layout(
    model="llama3", param_dtype="bfloat16", tolerance=1e-5, resync_params=True, steps=3,
    expect_transport="WindowTransport", tide=SWAP,
)  # fmt: skip
QWEN3 = replace(BASE, model="qwen3_moe", num_experts=4)
FROZEN = replace(BASE, frozen=("tok_embeddings", "layers.0."))


def _shape(lws: int, tide: dict | None = None, **changes) -> list[Layout]:
    return [replace(layout, local_world_sizes=(lws,), tide={**SWAP, **(tide or {})}, **changes)
            for layout in (BASE, QWEN3)]  # fmt: skip


# world size -> (nodes x L label, layouts) of one spawn
RUNS = {
    3: [("3x1 arena of 1 group", _shape(1, tide={"ag_in_place_groups": 1})),
        ("3x1 frozen", [replace(FROZEN, local_world_sizes=(1,))])],
    4: [("2x2", _shape(2)),
        ("2x2 EP", [replace(QWEN3, dp_shard=4, ep=2, local_world_sizes=(2,))]),
        ("4x1", _shape(1)),
        ("2x2 arena of 1 group", _shape(2, tide={"ag_in_place_groups": 1})),
        ("2x2 frozen", [replace(FROZEN, local_world_sizes=(2,))])],
    6: [("3x2", _shape(2))],
    8: [("2x4", _shape(4)), ("4x2", _shape(2)),
        ("HSDP 2x2", [replace(BASE, dp_replicate=2, dp_shard=4, local_world_sizes=(2,))])],
}  # fmt: skip


def _parity(rank: int, world: int, runs: list[tuple[str, list[Layout]]]) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    for label, layouts in runs:
        for layout in layouts:
            rec = run_layout(rank, world, layout, device=torch.device("cuda", 0))
            log = "\n".join(rec.logs)
            lws = layout.local_world_sizes[0]
            group = world // layout.dp_replicate
            nodes = group // lws
            shape = f"{nodes} node{'s' if nodes != 1 else ''} x {lws}"
            first = [m for m in rec.logs if "TIDE-RS" in m and "first reduce" in m]
            assert first and any(shape in m for m in first), f"{label}: {log}"
            # the windows of groups across nodes (an EP expert group on one node places)
            counters = [t.counters for t in rec.transports.values()
                        if getattr(t, "in_place", None) is not None] or [
                t.counters for t in rec.transports.values()]  # fmt: skip
            in_place = sum(c.in_place_all_gathers for c in counters)
            arena_groups = layout.tide.get("ag_in_place_groups", TideOptions().ag_in_place_groups)
            swap, how = swap_backend(torch.device("cuda", 0), allow_ctypes=True)
            in_place_layout = nodes > 1 and group > 1
            if in_place_layout and arena_groups and swap is None:
                # this torch cannot point a storage at window memory: install says so and
                # every all-gather places
                assert in_place == 0, (label, in_place)
                assert rank != 0 or f"TIDE-AG placement copies: {how}" in log, log
            elif in_place_layout and arena_groups:
                # across nodes (any L): every shard put straight into parameter storage on the
                # window's arena (no placement copy unless the arena ran full, which an
                # arena of one group does whenever the next group is prefetched)
                assert rank != 0 or f"storage swap: {how}" in log, log
                print(f"[rank {rank}] {label}: in place, storage swap: {how}", flush=True)
                full = sum(c.arena_full for c in counters)
                placed = sum(c.placed_copies for c in counters)
                assert in_place > 0 and (placed > 0) == (full > 0), (label, in_place, placed, full)
                assert full > 0 or arena_groups != 1, f"{label}: an arena of 1 group never full"
                assert sum(c.credits for c in counters) > 0, f"{label}: no range released"
            else:
                assert in_place == 0, f"{label}: in place on one node"
            if rank == 0:
                assert "transport=windows" in log, f"{label} {layout.model}: {log}"
                assert "transport=copy_engine" not in log and "transport=p2p" not in log, log
            print(f"[rank {rank}] {label} {layout.model}: gradients, all-gathers and losses "
                  "match stock FSDP2", flush=True)  # fmt: skip


@pytest.mark.parametrize("world", sorted(RUNS), ids=[f"{w}ranks" for w in sorted(RUNS)])
def test_nxl_parity_with_fsdp2(world):
    reason = multi_rank_gpu_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    spawn_emulated(_parity, world, RUNS[world], mode="one_node", timeout_s=420)
