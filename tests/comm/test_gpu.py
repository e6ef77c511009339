"""GPU tests of TIDE-AG (NCCL, >= 2 GPUs on one host). Skipped elsewhere.

Run on the 2x H200 machine:
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        python -m pytest tests/comm/test_gpu.py -m gpu -v -s
"""

import os

import pytest
import torch
import torch.distributed as dist
from _harness import Scenario, run_parity, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs >= 2 CUDA GPUs",
    ),
]

SCENARIOS = [
    Scenario(reshard_after_forward=True, bf16=True, prefetch=False, grad_accum=1),
    Scenario(reshard_after_forward=False, bf16=True, prefetch=True, grad_accum=2),
    Scenario(reshard_after_forward=True, bf16=False, prefetch=True, grad_accum=2),
]


def _deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _gpu_parity(rank: int, world_size: int, options: dict, expect: str) -> None:
    _deterministic()
    from torchtitan_tide.comm.transports import copy_engine

    # TIDE-RS divides after its fp32 sum, NCCL may pre-multiply: allow 1e-5.
    tol = 0.0 if options.get("reduce_scatter") == "fsdp2" else 1e-5
    run_parity(rank, world_size, SCENARIOS, options, sync_check=True, tolerance=tol)
    # Again without host syncs in the all-gather path: stream races would show.
    run_parity(rank, world_size, SCENARIOS, options, sync_check=False, tolerance=tol)
    if expect == "copy_engine":
        try:
            import cuda.bindings.runtime  # noqa: F401
        except ImportError:
            return  # cuda-bindings missing: the copy_ loop ran (logged)
        reason = copy_engine._batch_state["disabled_reason"]
        assert reason is None, f"cudaMemcpyBatchAsync fell back to copy_ loop: {reason}"
        assert copy_engine._batch_state["logged"], "copy engine batch path never ran"
        barrier = copy_engine._barrier_state
        assert barrier["kind"] == options.get("slot_barrier", "copy_engine"), barrier


@pytest.mark.parametrize(
    "options,expect",
    [
        ({}, "copy_engine"),  # auto: one node, P2P -> copy engine
        ({"transport": "copy_engine"}, "copy_engine"),
        # 2 "nodes" x 1: cross-node NCCL p2p between symmetric slots, then own pulls.
        ({"transport": "copy_engine", "local_world_size": 1}, "copy_engine"),
        ({"transport": "nccl_p2p", "local_world_size": 1}, "p2p"),  # 2 "nodes" x 1
        ({"transport": "nccl_p2p", "local_world_size": 2, "pacing": 1}, "p2p"),
        # TIDE-RS variants: own RS slots on FSDP's RS stream; one row per round;
        # TIDE-AG alone (bitwise vs stock).
        ({"slot_reuse": False}, "copy_engine"),
        ({"rs_rows": 1, "rs_ctas": 1}, "copy_engine"),
        ({"reduce_scatter": "fsdp2"}, "copy_engine"),
        ({"slot_barrier": "kernel"}, "copy_engine"),  # torch's barrier kernel
    ],
    ids=[
        "auto",
        "copy_engine",
        "copy_engine-2x1",
        "nccl_p2p-2x1",
        "nccl_p2p-1x2-paced",
        "rs-own-slots",
        "rs-rows1",
        "ag-only",
        "kernel-barrier",
    ],
)
def test_gpu_parity(options, expect):
    spawn(_gpu_parity, 2, options, expect, device_type="cuda")


def _batch_copy_exact(rank: int, world_size: int, n_copies: int) -> None:
    """ONE cudaMemcpyBatchAsync of n_copies peer copies from symmetric memory
    lands exactly (the 576-copy case of the issue), on a non-default stream."""
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots, batch_copy

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    elem = 4096  # bf16 elements per copy
    slots = SymmSlots.create(n_copies * elem * 2, group, device)
    src = slots.buffer.narrow(0, 0, n_copies * elem * 2).view(torch.bfloat16)
    src.copy_(
        torch.arange(n_copies * elem, device=device, dtype=torch.float32).to(torch.bfloat16) + rank
    )
    slots.handle.barrier(channel=0)
    peer = 1 - rank
    dst = torch.full((n_copies * elem,), float("nan"), device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    # Reverse the order of the chunks so a wrong pointer shows up.
    dsts = [dst.data_ptr() + (n_copies - 1 - i) * elem * 2 for i in range(n_copies)]
    srcs = [slots.peer_ptrs[peer] + i * elem * 2 for i in range(n_copies)]
    with torch.cuda.stream(stream):
        batch_copy(dsts, srcs, [elem * 2] * n_copies, [slots.peer_devices[peer]] * n_copies,
                   rank, stream)  # fmt: skip
    stream.synchronize()
    expect = (
        (
            torch.arange(n_copies * elem, device=device, dtype=torch.float32).to(torch.bfloat16)
            + peer
        )
        .view(n_copies, elem)
        .flip(0)
        .reshape(-1)
    )
    assert torch.equal(dst, expect)
    slots.handle.barrier(channel=0)
    torch.cuda.synchronize()


def test_gpu_batch_copy_576():
    pytest.importorskip("cuda.bindings.runtime")
    spawn(_batch_copy_exact, 2, 576, device_type="cuda")


def _ce_barrier_orders_writes(rank: int, world_size: int, rounds: int) -> None:
    """The copy-engine slot barrier (no SM kernel): each round a rank copies fresh
    values into its peer's slot ``round % 2`` (a copy-engine copy on a side
    stream), barriers, and reads what the peer copied into its own slot; every
    round must see the peer's values of that round (nothing stale, no hang). No
    host synchronization between rounds: only the barrier orders the streams."""
    from torchtitan_tide.comm.transports import copy_engine
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots

    device = torch.device("cuda", rank)
    numel = 1 << 18  # fp32 elements per slot
    slots = SymmSlots.create(numel * 4, dist.group.WORLD, device)
    assert slots.barrier_kind == "copy_engine", copy_engine._barrier_state
    peer = 1 - rank
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    wrong = torch.zeros((), dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(1234)  # same sequence on both ranks
    with torch.cuda.stream(stream):
        for rnd in range(rounds):
            base = torch.randn(numel, device=device, generator=gen)
            mine, theirs = base + rank, base + peer
            slot = (rnd % 2) * numel * 4
            dst = slots.peer_bufs[peer].narrow(0, slot, numel * 4).view(torch.float32)
            dst.copy_(mine)  # into the peer's memory: a copy-engine copy
            slots.barrier()
            own = slots.buffer.narrow(0, slot, numel * 4).view(torch.float32)
            wrong += (own != theirs).sum()
            slots.barrier()  # the peer read its slot before the next round writes
    stream.synchronize()
    assert int(wrong) == 0, f"{int(wrong)} stale or wrong elements over {rounds} rounds"
    assert slots.barrier_seq == 2 * rounds


def test_gpu_copy_engine_barrier():
    pytest.importorskip("cuda.bindings.driver")
    spawn(_ce_barrier_orders_writes, 2, 200, device_type="cuda")


def _gpu_rs_numerics(rank: int, world_size: int, options: dict) -> None:
    """TIDE-RS fp32 shards vs a float64 sum of the same bf16 gradients, NaN-poisoned
    outputs, on CUDA (copy engine / NCCL p2p, Triton kernel)."""
    from test_reduce_scatter_cpu import _numerics_worker

    from torchtitan_tide.comm.base import kernels

    assert kernels.triton_status() == "triton", kernels.triton_status()
    _numerics_worker(rank, world_size, options, torch.bfloat16)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"local_world_size": 1},
        {"transport": "nccl_p2p", "local_world_size": 1},
        {"slot_reuse": False},
        {"rs_ctas": 0},
        {"rs_rows": 1, "rs_ctas": 1},
        {"slot_barrier": "kernel"},
    ],
    ids=[
        "copy_engine",
        "copy_engine-2x1",
        "nccl_p2p-2x1",
        "own-slots",
        "short-ctas",
        "rows1",
        "kernel-barrier",
    ],
)
def test_gpu_rs_numerics(options):
    spawn(_gpu_rs_numerics, 2, options, device_type="cuda")
