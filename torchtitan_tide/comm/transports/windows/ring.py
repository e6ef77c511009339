"""Zero-SM TIDE-RS phase 2: the cross-node partials as NCCL one-sided puts into a ring.

Replaces the send/recv of TIDE-RS phase 2 for any multi-node layout. The protocol is
``window_rounds.ring_step_ops`` (read its section comment): ``slots`` receive regions per
rank whatever the node count, each step's partial put into region ``step % slots`` of its
receiver, a credit back to the next sender of that region once it is summed. Two
TIDE-owned communicators over the FSDP group (``nccl_rma.RmaComm``, or the CPU stand-in):
``data`` (the puts; its window holds the send regions, the ring and the wire region) and
``credit`` (bare signals), so each counts one kind of signal. TIDE-AG's and TIDE-RS phase
1's window is another one (``transport.py``). Decisions: docs/design/2026-12-04-windows.md
(the earlier design, regions per node and parity, is in docs/design/2026-12-02-one-sided.md).

Streams (CUDA): the puts, waits and credits run on ``tide_one_sided_rs``
(``streams.run_beside``: in order with the caller's stream, phase 2's), the sum on the
caller's stream between them; a profile shows no kernel but the accumulate. The NIC rule
(``ring_step_ops``): before each piece of a partial, that stream waits for TIDE-AG's
cross-node put stream (``tide_one_sided``, the windows' ``put``): an all-gather issued
before it goes first, one issued after waits behind at most one piece.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...base import kernels, streams, watchdog
from ...base.ranks import global_rank
from ...plans.plan import WorldLayout
from ...plans.window_rounds import (
    PUT,
    Accumulate,
    Fork,
    Put,
    RingLayout,
    Signal,
    Wait,
    ring_layout,
    ring_step_ops,
)

__all__ = ["AG_PUT_STREAM", "OneSidedCrossNode", "rs_ring_bytes"]

AG_PUT_STREAM = "tide_one_sided"  # TIDE-AG's cross-node puts (``transport.py``'s ``put``)

logger = logging.getLogger(__name__)


def rs_ring_bytes(inflight: int, shard_bytes: int, wire: bool) -> int:
    """Bytes of phase 2's window: ``2 * inflight`` regions of the largest group's fp32
    reduce shard (+ one wire region for a narrower wire dtype), whatever the node count."""
    return ring_layout(inflight, shard_bytes, wire).total_bytes


@dataclass
class _Counters:
    """What the transport moved (tests and the wire-bytes benchmark read it)."""

    puts: int = 0
    put_bytes: int = 0
    waits: int = 0
    credits: int = 0
    yields: int = 0  # waits for TIDE-AG's put stream before a piece (the NIC rule)


class OneSidedCrossNode:
    """TIDE-RS phase 2 over one-sided puts (module docstring). One instance per (process
    group, device), shared by its FSDP groups like ``RSBuffers``; ``layout`` and ``rank``:
    the group's."""

    name = "nccl_one_sided"

    def __init__(
        self, data_comm, credit_comm, window, layout: WorldLayout, rank: int, inflight: int,
        shard_bytes: int, wire: bool, group_name: str,
    ) -> None:  # fmt: skip
        self.data_comm, self.credit_comm, self.window = data_comm, credit_comm, window
        self.layout, self.rank, self.group_name = layout, rank, group_name
        self.ring: RingLayout = ring_layout(inflight, shard_bytes, wire)
        if self.ring.total_bytes > window.nbytes:
            raise ValueError(f"phase-2 window of {window.nbytes} B < the ring's "
                             f"{self.ring.total_bytes} B")  # fmt: skip
        self.region_bytes = self.ring.region_bytes
        self.steps = 0  # phase-2 steps run: the ring position, identical on every rank
        self.counters = _Counters()

    def send_slots(self, numel_capacity: int) -> list[torch.Tensor]:
        """The ``slots`` fp32 send regions (views of the window), for ``RSBuffers``' partial
        ring: phase 1 accumulates straight into registered memory."""
        if numel_capacity * 4 > self.region_bytes:
            raise ValueError("send slot smaller than the largest partial")
        return [
            self.window.tensor.narrow(0, self.ring.send(k), numel_capacity * 4).view(torch.float32)
            for k in range(self.ring.slots)
        ]

    def wire_slot(self, dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` view of the wire region for ``RSBuffers.send``: partials rounded to a
        narrower wire dtype are put from registered memory too. Reused every step: phase 2
        runs in order on one stream and a put has read its source once it completed there."""
        return self.window.tensor.narrow(0, self.ring.wire_start, self.region_bytes).view(dtype)

    def begin_reduce(self) -> None:
        """Called once per TIDE-RS reduce with a cross-node phase (the ring counts steps)."""

    def reduce_partial(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, step: int,
        group: dist.ProcessGroup, out: torch.Tensor, *, divisor: float, num_ctas: int,
    ) -> None:  # fmt: skip
        """One phase-2 step: ``send`` (1-D, the wire dtype, a view of this window) to group
        rank ``send_peer``, the partial of ``recv_peer`` added into ``out`` (fp32, divided by
        ``divisor``), on the current stream (CUDA) or the host (CPU stand-in). ``step``: the
        plan's cross-node step (1 .. N - 1); it must be the ring's next one."""
        nbytes = send.numel() * send.element_size()
        base = self.window.tensor.data_ptr()
        start = send.data_ptr() - base
        if not (0 <= start and start + nbytes <= self.window.nbytes) or not send.is_contiguous():
            raise AssertionError("a one-sided put reads registered memory: the partial must "
                                 "be a contiguous view of the phase-2 window")  # fmt: skip
        ops = ring_step_ops(self.ring, self.layout, self.rank, self.steps, start, nbytes)
        put = next(op for op in ops if isinstance(op, Put))
        if (put.peer, step) != (send_peer, self.steps % (self.layout.num_nodes - 1) + 1):
            raise AssertionError(
                f"TIDE-RS phase 2 out of step: the ring expects step "
                f"{self.steps % (self.layout.num_nodes - 1) + 1} to group rank {put.peer}, the "
                f"reduce asks step {step} to group rank {send_peer}"
            )
        del recv_peer  # the ring's own (checked by the data wait)
        self.steps += 1
        cuda = out.device.type == "cuda"
        side = streams.stream("tide_one_sided_rs", out.device) if cuda else None
        pending: list = []  # ops of the side stream, run together (one pair of stream waits)

        def flush() -> None:
            if pending and cuda:
                batch = list(pending)
                streams.run_beside(side, lambda: [self._one(o, group, side, out.device)
                                                  for o in batch])  # fmt: skip
            elif pending:
                for o in pending:
                    self._one(o, group, None, out.device)
            pending.clear()

        for op in ops:
            if not isinstance(op, Accumulate):
                pending.append(op)
                continue
            flush()
            rows = (self.window.tensor.narrow(0, op.start, op.row_bytes).view(send.dtype)
                    .view(1, -1))  # fmt: skip
            kernels.accumulate_rows(rows, out, accumulate=True, divisor=divisor,
                                    num_ctas=num_ctas)  # fmt: skip
        flush()

    def _one(self, op, group: dist.ProcessGroup, stream, device: torch.device) -> None:
        if isinstance(op, Fork):  # the NIC rule: TIDE-AG's puts issued so far go first
            assert op.src == PUT, op
            if stream is not None:
                stream.wait_stream(streams.stream(AG_PUT_STREAM, device))
            self.counters.yields += 1
            return
        comm = self.data_comm if op.comm == "data" else self.credit_comm
        if isinstance(op, Put):
            src = self.window.tensor.narrow(0, op.src, op.nbytes)
            comm.put_signal(src, op.peer, self.window, op.dst, stream)
            self.counters.puts += 1
            self.counters.put_bytes += op.nbytes
        elif isinstance(op, Wait):
            comm.wait_signal(op.peer, op.count, stream)
            self.counters.waits += 1
            if stream is not None:
                what = "TIDE-RS one-sided " + ("credit" if op.comm == "credit" else "wait")
                watchdog.watch_stream(what, self.group_name, (global_rank(group, op.peer),),
                                      device)  # fmt: skip
        elif isinstance(op, Signal):
            comm.signal(op.peer, stream)
            self.counters.credits += 1
        else:
            raise TypeError(f"unexpected phase-2 op {op!r}")
