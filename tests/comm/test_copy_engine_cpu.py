"""The copy-engine transport's protocol on CPU (white-box).

The real transport pulls from CUDA symmetric memory. Here each rank's "symmetric"
buffer is a shared-memory CPU tensor created before fork (every process maps
all of them) and the barrier is a gloo barrier, so packing, slot parity,
offsets and the pull loop (the no-cuda-bindings fallback) run end to end under
FSDP2 with parity checks; TIDE-RS pushes into the same slots (Slot-Reuse: one
round counter for AG and RS rounds). What this cannot test: cudaMemcpyBatchAsync,
the device-side barrier and stream ordering (see test_gpu.py).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _harness import Scenario, run_parity, spawn

SLOT_BYTES = 1 << 16

SCENARIOS = [
    Scenario(reshard_after_forward=True, bf16=True, prefetch=True, grad_accum=2),
    Scenario(reshard_after_forward=False, bf16=False, prefetch=False, grad_accum=1),
]


class _GlooBarrier:
    def barrier(self, channel: int = 0) -> None:
        dist.barrier()


def _use_shared_memory_copy_engine(buffers):
    """Swap every TIDE group's transport for a copy engine whose node-local
    peers' slots are the shared-memory ``buffers`` (indexed by group rank)."""
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.plans.plan import cross_node_exchanges
    from torchtitan_tide.comm.transports.copy_engine import CopyEngineTransport, SymmSlots

    def post_apply(model):
        transport = None
        n = 0
        for _, group in fsdp_patch.fsdp_param_groups(model):
            state = group._tide_ag_state
            layout, rank = state.plan.layout, state.plan.rank
            if transport is None:
                node = layout.node_of(rank)
                local_bufs = [buffers[r] for r in layout.node_ranks(node)]
                slots = SymmSlots(
                    buffer=buffers[rank],
                    handle=_GlooBarrier(),
                    slot_bytes=SLOT_BYTES,
                    peer_bufs=local_bufs,
                    peer_ptrs=[b.data_ptr() for b in local_bufs],
                    peer_devices=[0] * len(local_bufs),
                )
                transport = CopyEngineTransport(slots)
            # pull_local plan: the cross-node phase only.
            state.plan = dataclasses.replace(
                state.plan, exchanges=tuple(cross_node_exchanges(layout, rank))
            )
            state.transport = transport
            rs_state = getattr(group, "_tide_rs_state", None)
            if rs_state is not None:
                rs_state.transport = transport  # Slot-Reuse: RS rows in the AG slots
            n += 1
        assert n > 0

    return post_apply


def _worker(rank, world_size, buffers, options):
    run_parity(
        rank,
        world_size,
        SCENARIOS,
        options,
        post_apply=_use_shared_memory_copy_engine(buffers),
        tolerance=0.0 if world_size == 2 else 1e-5,
    )


def _node_group_worker(rank, world_size):
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.comm.plans.topology import make_node_local_group

    world = dist.group.WORLD
    sub = make_node_local_group(world, WorldLayout(4, 2), dist.get_process_group_ranks(world))
    assert sub.size() == 2
    assert dist.get_global_rank(sub, 0) == (rank // 2) * 2


def test_node_local_group_cpu():
    spawn(_node_group_worker, 4)


@pytest.mark.parametrize(
    "world_size,options",
    [(2, {}), (4, {}), (4, {"local_world_size": 2}), (4, {"local_world_size": 1})],
    ids=["1x2", "1x4", "2x2", "4x1"],
)
def test_copy_engine_protocol_cpu(world_size, options):
    buffers = [
        torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8).share_memory_() for _ in range(world_size)
    ]
    spawn(_worker, world_size, buffers, options)
