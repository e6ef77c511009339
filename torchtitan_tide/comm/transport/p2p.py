"""Point-to-point transport: the plan's exchanges as ``dist.batch_isend_irecv``.

The same code runs on gloo (CPU tests) and NCCL (GPU, cross-node). Every
message is one :class:`~torchtitan_tide.comm.plan.Chunk`: a contiguous byte
range of one parameter's unsharded storage, sent from the sender's storage and
received straight into the receiver's storage at the same offset (no staging
buffer). Messages are byte views (``uint8``) so any dtype goes over gloo.

Ordering: steps depend on each other (recursive doubling forwards what the
previous step received), so every wave is waited before the next is posted.
On NCCL ``Work.wait()`` makes the current stream wait for the NCCL stream (no
host block); on gloo it blocks the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Chunk, GroupPlan, chunks_for_ranks, pace_chunks
from . import global_rank

__all__ = ["P2PTransport"]


def _byte_view(storage: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    return storage.narrow(0, chunk.offset, chunk.numel).view(torch.uint8)


class P2PTransport:
    """Paced point-to-point exchange. ``pacing``: see ``TideAGOptions.pacing``."""

    def __init__(self, name: str, pacing: int = 0) -> None:
        self.name = name
        self.pacing = pacing

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        del inputs  # sends read the already-written slots of ``outputs``
        for ex in plan.exchanges:
            send_waves = pace_chunks(chunks_for_ranks(plan.params, ex.send_ranks), self.pacing)
            recv_waves = pace_chunks(chunks_for_ranks(plan.params, ex.recv_ranks), self.pacing)
            send_peer = global_rank(group, ex.send_peer)
            recv_peer = global_rank(group, ex.recv_peer)
            for i in range(max(len(send_waves), len(recv_waves))):
                ops: list[dist.P2POp] = []
                for c in send_waves[i] if i < len(send_waves) else ():
                    ops.append(
                        dist.P2POp(
                            dist.isend, _byte_view(outputs[c.param_index], c), send_peer, group
                        )
                    )
                for c in recv_waves[i] if i < len(recv_waves) else ():
                    ops.append(
                        dist.P2POp(
                            dist.irecv, _byte_view(outputs[c.param_index], c), recv_peer, group
                        )
                    )
                if not ops:
                    continue
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return None
