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

Owns: these interfaces and the transports: ``p2p.py`` (``dist.batch_isend_irecv`` on the
group's backend: gloo on CPU, NCCL on GPU), ``copy_engine.py`` (peers of a node pull from
symmetric memory with one ``cudaMemcpyBatchAsync``) and ``windows/`` (NCCL >= 2.30 one-sided
puts into registered windows: TIDE-AG and TIDE-RS phase 1 on one window per process group,
TIDE-RS phase 2 in a ring; the window's set-up and NCCL binding with it). Also which
parameters' unsharded storage a transport holds (:func:`hold_unsharded`).

May import: ``plans``, ``base`` and ``options`` of ``comm``; never ``fsdp``, the package
that calls the transports (docs/design/2026-12-07-comm-rooms.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ..plans.plan import GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout

__all__ = [
    "AllGatherTransport", "CrossNodeTransport", "ReduceScatterTransport", "clear_held",
    "drop_unsharded", "hold_unsharded", "take_held",
]  # fmt: skip

# Parameters whose unsharded storage a transport pointed at its own memory (the windows'
# in-place all-gather), by ``id(FSDPParam)``: the FSDP2 seam (``fsdp/patch.py``) hands each
# back to its owner, ``owner.release(fsdp_param)``, before FSDP2 frees the storage.
_held: dict[int, object] = {}


def hold_unsharded(fsdp_param, owner) -> None:
    """``owner`` pointed ``fsdp_param``'s unsharded storage at its own memory: FSDP2's next
    free of it calls ``owner.release(fsdp_param)`` first."""
    _held[id(fsdp_param)] = owner


def drop_unsharded(fsdp_param) -> None:
    """Forget :func:`hold_unsharded` (the owner took the storage back itself)."""
    _held.pop(id(fsdp_param), None)


def take_held(fsdp_param) -> object | None:
    """The owner that holds ``fsdp_param``'s unsharded storage, forgotten here; or None."""
    return _held.pop(id(fsdp_param), None)


def clear_held() -> None:
    _held.clear()


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
    """Cross-node phase of TIDE-RS (``p2p.P2PCrossNode``, ``windows.ring.OneSidedCrossNode``):
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
