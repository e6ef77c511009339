"""TIDE's transports behind three small interfaces: TIDE-AG's ``gather``, TIDE-RS's
node-local ``reduce_rows`` and its cross-node ``reduce_partial``. A transport owns
its staging and receive buffers: TIDE-RS's transports also sum what they received
into the caller's fp32 output (``kernels``), so no buffer of theirs is read outside.

A transport fills the non-own shard slots of every parameter's unsharded
storage of one FSDP group. Contract of :meth:`AllGatherTransport.gather`:

- Called under ``torch.no_grad()`` with the current stream set to the stream
  TIDE-AG runs on (CUDA) and after this rank's own shard has been written to
  ``outputs[i][dst_offset(rank) : + shard_numel]`` on that stream, unless the
  transport sets ``writes_own_shard = True`` (then it writes it itself).
- ``inputs[i]`` is this rank's padded shard of parameter ``i`` in its sharded
  dtype (fp32 master weights, say); ``outputs[i]`` is the 1-D unsharded
  storage in the all-gather dtype (bf16, say), owned by FSDP.
- Work is enqueued on the current stream (or waited into it) before return:
  when ``gather`` returns, an event recorded on the current stream covers every
  write. Returning a ``dist.Work`` is allowed for CPU backends whose work is
  not stream-ordered; the caller waits it before FSDP reads the storage.

Current transports: ``p2p`` (``dist.batch_isend_irecv`` on the group's backend:
gloo on CPU, NCCL on GPU), ``copy_engine`` (one node, peers pull from
symmetric memory with one ``cudaMemcpyBatchAsync``) and ``one_sided`` (NCCL
>= 2.30 puts into registered windows: TIDE-AG with one rank per node, TIDE-RS
phase 2). Transports import nothing of the modules that call them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ..plan import GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout

__all__ = [
    "AllGatherTransport", "CrossNodeTransport", "ReduceScatterTransport", "clear_global_ranks",
    "global_rank", "group_global_ranks",
]  # fmt: skip

# Keyed by the group object itself (a strong reference: no other group can reuse
# its address while it is here); cleared when the last TIDE model is removed.
_GLOBAL_RANKS: dict[dist.ProcessGroup, tuple[int, ...]] = {}


def group_global_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """``dist.get_process_group_ranks(group)``, cached per group (on every collective's
    path: point-to-point peers, watchdog reports)."""
    ranks = _GLOBAL_RANKS.get(group)
    if ranks is None:
        ranks = _GLOBAL_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """``dist.get_global_rank(group, group_rank)``, through :func:`group_global_ranks`."""
    return group_global_ranks(group)[group_rank]


def clear_global_ranks() -> None:
    _GLOBAL_RANKS.clear()


class AllGatherTransport(Protocol):
    name: str

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None: ...


class ReduceScatterTransport(Protocol):
    """Node-local phase of TIDE-RS (copy-engine and point-to-point transports):
    ``reduce_rows`` moves this rank's ``pushes`` of one round (decided by the plan:
    ``plan.RSChunk.pushes``) and sums the rows it received, ``[len(rnd.recvs),
    target.numel()]`` in the gradients' dtype, into ``target`` (fp32, this rank's
    shard or partial): overwritten in the chunk's first round (``rnd.first``), added
    to after, divided by ``divisor``; queued on the current stream (CUDA) or done
    (gloo) on return."""

    def reduce_rows(
        self,
        layout: WorldLayout,
        rank: int,
        rnd: RSRound,
        pushes: tuple[RSSlice, ...],
        grads: list[torch.Tensor],
        segments: tuple[RSSegment, ...],
        group: dist.ProcessGroup,
        target: torch.Tensor,
        *,
        divisor: float,
        num_ctas: int,
    ) -> None: ...


class CrossNodeTransport(Protocol):
    """Cross-node phase of TIDE-RS (``p2p.P2PCrossNode``, ``one_sided.OneSidedCrossNode``):
    ``begin_reduce`` once per reduce with a cross-node phase, then per other node's
    chunk ``reduce_partial``: ``send`` (this rank's partial for group rank
    ``send_peer``, 1-D, the wire dtype) out, the partial of group rank ``recv_peer``
    (same dtype and numel) in and added into ``out`` (fp32, divided by ``divisor``);
    queued on the current stream (CUDA) or done (gloo) on return. ``step``: the plan's
    cross-node step, ``1 .. num_nodes - 1``."""

    name: str

    def begin_reduce(self) -> None: ...

    def reduce_partial(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, step: int,
        group: dist.ProcessGroup, out: torch.Tensor, *, divisor: float, num_ctas: int,
    ) -> None: ...  # fmt: skip
