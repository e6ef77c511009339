"""Point-to-point transport: the plan's exchanges as ``dist.batch_isend_irecv``.

The same code runs on gloo (CPU tests) and NCCL (GPU, cross-node). Every
message is one :class:`~torchtitan_tide.comm.plans.plan.Chunk`: a contiguous byte
range of one parameter's unsharded storage, sent from the sender's storage and
received straight into the receiver's storage at the same offset (no staging
buffer). Messages are byte views (``uint8``) so any dtype goes over gloo.

Ordering: steps depend on each other (recursive doubling forwards what the
previous step received), so every wave is waited before the next is posted.
On NCCL ``Work.wait()`` makes the current stream wait for the NCCL stream (no
host block); on gloo it blocks the host.

:class:`P2PCrossNode` is TIDE-RS phase 2 over the same send/recv: one partial
to the owner's node, one from another node, per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..base import kernels, watchdog
from ..base.poison import poisoned
from ..base.ranks import global_rank
from ..plans.plan import Chunk, GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout

__all__ = ["P2PCrossNode", "P2PTransport"]


def _byte_view(storage: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    return storage.narrow(0, chunk.offset, chunk.numel).view(torch.uint8)


class P2PTransport:
    """Point-to-point exchange of the plan's waves (paced by the plan:
    ``build_group_plan(pacing=...)``, ``TideOptions.pacing``).

    One instance per (process group, ``device``), shared by its FSDP groups: it
    owns the TIDE-RS receive staging (``rows`` x the largest row, grown on
    first use, reused by every round: rounds are ordered on one stream)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.staging: torch.Tensor | None = None  # uint8, TIDE-RS rows
        self.all_sent_bytes = 0  # all-gather bytes this rank posted to peers, every tier
        self.sent_bytes = 0  # of those, to other nodes (the benchmarks' wire bytes)

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        del inputs  # sends read the already-written slots of ``outputs``
        for ex in plan.exchanges:
            send_waves, recv_waves = ex.send_waves, ex.recv_waves
            send_peer = global_rank(group, ex.send_peer)
            recv_peer = global_rank(group, ex.recv_peer)
            for i in range(max(len(send_waves), len(recv_waves))):
                ops: list[dist.P2POp] = []
                for c in send_waves[i] if i < len(send_waves) else ():
                    data = _byte_view(outputs[c.param_index], c)
                    ops.append(dist.P2POp(dist.isend, data, send_peer, group))
                    self.all_sent_bytes += data.numel()
                    if ex.phase == "cross_node":
                        self.sent_bytes += data.numel()
                for c in recv_waves[i] if i < len(recv_waves) else ():
                    ops.append(
                        dist.P2POp(
                            dist.irecv, _byte_view(outputs[c.param_index], c), recv_peer, group
                        )
                    )
                if not ops:
                    continue
                watchdog.wait_works(dist.batch_isend_irecv(ops), "TIDE-AG p2p gather", group,
                                    (send_peer, recv_peer), self.device)  # fmt: skip
        return None

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
    ) -> None:
        """One node-local TIDE-RS round (``plan.rs_schedule``) over send/recv:
        every slice of ``pushes`` (from the plan) goes straight from the sender's gradient into the
        receiver's staging row (the own slice by a local copy); then the received rows
        ``[len(rnd.recvs), target.numel()]`` (gradients' dtype) are summed into
        ``target`` (``kernels.accumulate_beside``: overwritten in round ``rnd.first``,
        added to after; divided by ``divisor``) before the staging is reused."""
        dtype, itemsize = grads[0].dtype, grads[0].element_size()
        rows_used, row_numel = len(rnd.recvs), target.numel()
        nbytes = rows_used * row_numel * itemsize
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rows = self.staging.narrow(0, 0, nbytes).view(dtype).view(rows_used, row_numel)
        local = layout.local_of(rank)
        my_dst = layout.rank_of(rnd.chunk_node, local)
        ops: list[dist.P2POp] = []
        for push in pushes:
            src = grads[push.param_index].narrow(0, push.src_offset, push.numel)
            if push.peer == local:
                rows[push.row].narrow(0, push.dst_offset, push.numel).copy_(src)
            else:
                peer_rank = global_rank(group, layout.rank_of(layout.node_of(rank), push.peer))
                ops.append(dist.P2POp(dist.isend, src.view(torch.uint8), peer_rank, group))
        for peer, row in rnd.recvs:
            if peer == local:
                continue
            peer_rank = global_rank(group, layout.rank_of(layout.node_of(rank), peer))
            for seg in segments:
                valid = seg.valid(my_dst)
                if valid == 0:
                    continue
                dst = rows[row].narrow(0, seg.out_offset, valid)
                ops.append(dist.P2POp(dist.irecv, dst.view(torch.uint8), peer_rank, group))
        if ops:
            peers = tuple(sorted({op.peer for op in ops}))
            watchdog.wait_works(dist.batch_isend_irecv(ops), "TIDE-RS p2p rows", group, peers,
                                self.device)  # fmt: skip
        kernels.accumulate_beside(
            rows, target, accumulate=not rnd.first, divisor=divisor, num_ctas=num_ctas
        )


class P2PCrossNode:
    """TIDE-RS phase 2 over point-to-point (NCCL send/recv; gloo on CPU): one instance
    per (process group, ``device``), shared by its FSDP groups like ``RSBuffers``.

    It owns one receive buffer (grown to the largest partial, any dtype): phase 2
    runs in order on one stream (``cross``; the host on CPU) and each received
    partial is summed (:meth:`reduce_partial`) on that stream before the next
    exchange, so one buffer suffices."""

    name = "p2p"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.recv: torch.Tensor | None = None  # uint8

    def begin_reduce(self) -> None:
        """Called once per TIDE-RS reduce with a cross-node phase (nothing to do here)."""

    def reduce_partial(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, step: int,
        group: dist.ProcessGroup, out: torch.Tensor, *, divisor: float, num_ctas: int,
    ) -> None:  # fmt: skip
        """Send ``send`` (1-D, any dtype) to group rank ``send_peer``, receive the
        partial of group rank ``recv_peer`` (same dtype and numel) and add it into
        ``out`` (fp32, divided by ``divisor``), on the current stream (NCCL) or the
        host (gloo). ``step``: the plan's cross-node step (unused here)."""
        recv = self._exchange(send, send_peer, recv_peer, group)
        kernels.accumulate_rows(
            recv.view(1, -1), out, accumulate=True, divisor=divisor, num_ctas=num_ctas
        )

    def _exchange(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        """``send`` out, the peer's partial in (this transport's receive buffer)."""
        nbytes = send.numel() * send.element_size()
        if self.recv is None or self.recv.numel() < nbytes:
            self.recv = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        recv = poisoned(self.recv.narrow(0, 0, nbytes).view(send.dtype))
        peers = (global_rank(group, send_peer), global_rank(group, recv_peer))
        ops = [
            dist.P2POp(dist.isend, send, peers[0], group),
            dist.P2POp(dist.irecv, recv, peers[1], group),
        ]
        watchdog.wait_works(dist.batch_isend_irecv(ops), "TIDE-RS cross-node p2p", group,
                            peers, self.device)  # fmt: skip
        return recv
