"""Transports of TIDE-AG behind one small interface.

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
gloo on CPU, NCCL on GPU) and ``copy_engine`` (one node, peers pull from
symmetric memory with one ``cudaMemcpyBatchAsync``). A zero-SM transport on
NCCL >= 2.29 one-sided puts would implement the same method.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ..plan import GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout

__all__ = [
    "AllGatherTransport", "ReduceScatterTransport", "clear_global_ranks", "global_rank",
    "group_global_ranks",
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
    """Node-local phase of TIDE-RS: ``exchange_rows`` moves this rank's ``pushes`` of
    one round (decided by the plan: ``plan.RSChunk.pushes``) and returns its received rows
    ``[len(rnd.recvs), row_numel]`` in the gradients' dtype, complete on the
    current stream (CUDA) or the host (gloo). Implemented by the copy-engine and
    point-to-point transports."""

    def exchange_rows(
        self,
        layout: WorldLayout,
        rank: int,
        rnd: RSRound,
        pushes: tuple[RSSlice, ...],
        grads: list[torch.Tensor],
        segments: tuple[RSSegment, ...],
        row_numel: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor: ...
