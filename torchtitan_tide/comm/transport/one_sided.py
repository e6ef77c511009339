"""Zero-SM cross-node transport: NCCL one-sided puts into registered windows.

Replaces the cross-node send/recv of TIDE-AG (groups with one rank per node, i.e. every
exchange of the plan is cross-node) and of TIDE-RS phase 2 (any multi-node layout). Each
direction is one TIDE-owned NCCL communicator (``nccl_rma.RmaComm``) with one registered
window; the bytes move by ``ncclPutSignal`` (copy engine within reach of load/store, NCCL's
RMA proxy over IB/RoCE), completion is ``ncclWaitSignal``: no send/recv kernel. Decision
and measurements: docs/2026-12-02-one-sided.md.

TIDE-AG window (:class:`OneSidedAllGather`): two halves (rounds alternate), each
``num_nodes`` entries; entry ``m`` holds the packed shards (per parameter, 16-byte
aligned, all-gather dtype) of node ``m``'s rank. One gather: pack the own shards into the
own entry (the cast FSDP2's copy-in does), then per exchange step put the plan's runs of
entries into the same offsets of the peer's window (one signal per put) and wait for the
peer's puts, then ONE ``cudaMemcpyBatchAsync`` copies every entry into the parameters'
unsharded storage (the own shard included). Safe reuse of a half: a peer writes half
``r % 2`` again only in round ``r + 2``, after it received this rank's round ``r + 1``
data, which this rank put after its round-``r`` copy-out (one stream, in order; every rank
receives from every other one, directly or forwarded, in every round).

TIDE-RS window (:class:`OneSidedCrossNode`): ``inflight`` send slots (the fp32 partial
ring of ``RSBuffers`` lives there, so a partial is put where phase 1 wrote it) then two
parities x ``num_nodes`` receive regions. Step ``s`` of a reduce puts into region
``(parity, s)`` of node ``n + s``'s rank. A sender reaches the same region again two
reduces later, after waiting for this rank's partial of the reduce in between, which this
rank put after accumulating the region (every pair of nodes exchanges in every reduce).
With ``[tide] rs_wire_dtype`` narrower than fp32 the partial is rounded into
:meth:`OneSidedCrossNode.wire_slot` (region ``(0, 0)``: step 0 is the own node, no peer
puts there) and put from it; the next rounding into it follows the put on the stream.

Streams: the puts and waits of TIDE-AG run on the ``tide_one_sided`` stream, those of
TIDE-RS on ``tide_one_sided_rs`` (``streams.run_beside``: in order with the caller's
stream), so a profile shows what runs there: no kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import kernels, streams, watchdog
from ..plan import GroupPlan
from . import global_rank
from .copy_engine import _runs, _try_batch, pack_own_shards
from .nccl_rma import RmaComm, RmaWindow

__all__ = ["OneSidedAllGather", "OneSidedCrossNode", "ag_window_bytes", "rs_window_bytes"]

logger = logging.getLogger(__name__)


def ag_window_bytes(num_nodes: int, entry_bytes: int) -> int:
    """TIDE-AG window: 2 halves x ``num_nodes`` entries of the largest group's packed
    shard bytes (16-byte aligned per parameter)."""
    return 2 * num_nodes * entry_bytes


def rs_window_bytes(num_nodes: int, inflight: int, shard_bytes: int) -> int:
    """TIDE-RS window: ``inflight`` send slots + 2 x ``num_nodes`` receive regions of the
    largest group's reduce shard bytes (fp32), each rounded up to 256 bytes."""
    return (inflight + 2 * num_nodes) * _region(shard_bytes)


def _region(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


@dataclass
class _Counters:
    """What the transport moved (tests and the wire-bytes benchmark read it)."""

    puts: int = 0
    put_bytes: int = 0
    waits: int = 0


class OneSidedAllGather:
    """TIDE-AG over one-sided puts for groups whose plan is cross-node only (one rank
    per node). ``comm``'s ranks are the FSDP group's ranks."""

    name = "nccl_one_sided"
    writes_own_shard = True

    def __init__(self, comm: RmaComm, window: RmaWindow, pacing: int, group_name: str):
        self.comm, self.window, self.pacing, self.group_name = comm, window, pacing, group_name
        self.half_bytes = window.nbytes // 2
        self.round = 0
        self.counters = _Counters()

    @property
    def sent_bytes(self) -> int:
        """All-gather bytes this rank put to peers (as ``P2PTransport.sent_bytes``)."""
        return self.counters.put_bytes

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        layout = plan.layout
        if layout.local_world_size != 1:
            raise AssertionError("the one-sided all-gather needs one rank per node")
        num_nodes = layout.num_nodes
        base = (self.round % 2) * self.half_bytes
        self.round += 1
        buf = self.window.tensor
        # 1. pack: cast once into this rank's entry (the current stream: TIDE's).
        packing = pack_own_shards(buf, base, self.half_bytes, plan, inputs, outputs)
        nbytes, param_offs, entry_bytes = packing.nbytes, packing.offsets, packing.entry_bytes

        def entry(m: int) -> int:
            return base + m * entry_bytes

        # 2. the plan's exchanges as puts of whole entries (runs) into the peers' windows.
        streams.run_beside(
            streams.stream("tide_one_sided", buf.device),
            lambda: self._exchange(plan, group, entry, entry_bytes),
        )
        # 3. every entry into the parameters' storage: one batch of copies.
        dsts, srcs, sizes = [], [], []
        for m in range(num_nodes):
            src_rank = layout.rank_of(m, 0)
            for p, out, off, n in zip(plan.params, outputs, param_offs, nbytes):
                if n == 0:
                    continue
                dsts.append(out.data_ptr() + p.dst_offset(src_rank) * out.element_size())
                srcs.append(self.window.ptr + entry(m) + off)
                sizes.append(n)
        device = buf.device
        index = device.index or 0
        if dsts and not _try_batch(device, dsts, srcs, sizes, [index] * len(dsts), index,
                                   "TIDE-AG one-sided copy-out"):  # fmt: skip
            for m in range(num_nodes):
                src_rank = layout.rank_of(m, 0)
                for p, out, off, n in zip(plan.params, outputs, param_offs, nbytes):
                    if n:
                        src = buf.narrow(0, entry(m) + off, n).view(out.dtype)
                        out.narrow(0, p.dst_offset(src_rank), p.shard_numel).copy_(src)
        return None

    def _exchange(self, plan: GroupPlan, group: dist.ProcessGroup, entry, entry_bytes: int):
        """On the one-sided stream: each step's runs of entries as puts, ``pacing``
        entries per wave (0: the step's runs whole), each wave followed by the wait for
        the peer's matching wave (both sides split a step the same way)."""
        layout, buf = plan.layout, self.window.tensor
        stream = torch.cuda.current_stream(buf.device)
        for ex in plan.exchanges:
            sends = _pieces(_runs([layout.node_of(r) for r in ex.send_ranks]), self.pacing)
            recvs = _pieces(_runs([layout.node_of(r) for r in ex.recv_ranks]), self.pacing)
            for wave in range(max(len(sends), len(recvs))):
                for m, k in sends[wave] if wave < len(sends) else ():
                    src = buf.narrow(0, entry(m), k * entry_bytes)
                    self.comm.put_signal(src, ex.send_peer, self.window, entry(m), stream)
                    self.counters.puts += 1
                    self.counters.put_bytes += k * entry_bytes
                count = len(recvs[wave]) if wave < len(recvs) else 0
                if count:
                    self.comm.wait_signal(ex.recv_peer, count, stream)
                    self.counters.waits += 1
                    watchdog.watch_stream(
                        "TIDE-AG one-sided wait", self.group_name,
                        (global_rank(group, ex.recv_peer),), buf.device,
                    )  # fmt: skip


def _pieces(runs: list[tuple[int, int]], pacing: int) -> list[list[tuple[int, int]]]:
    """Waves of puts: ``pacing`` <= 0 -> one wave of the runs; else single entries,
    ``pacing`` per wave."""
    if pacing <= 0:
        return [runs] if runs else []
    singles = [(m + i, 1) for m, k in runs for i in range(k)]
    return [singles[i : i + pacing] for i in range(0, len(singles), pacing)]


class OneSidedCrossNode:
    """TIDE-RS phase 2 over one-sided puts (see the module docstring). ``comm``'s ranks
    are the FSDP group's ranks; one instance per (process group, device), shared by its
    FSDP groups like ``RSBuffers``."""

    name = "nccl_one_sided"

    def __init__(
        self, comm: RmaComm, window: RmaWindow, num_nodes: int, inflight: int,
        shard_bytes: int, group_name: str,
    ) -> None:  # fmt: skip
        self.comm, self.window, self.group_name = comm, window, group_name
        self.num_nodes, self.inflight = num_nodes, inflight
        self.region_bytes = _region(shard_bytes)
        self.reduces = 0
        self.counters = _Counters()

    def send_slots(self, numel_capacity: int) -> list[torch.Tensor]:
        """The ``inflight`` fp32 send slots (views of the window), for ``RSBuffers``'
        partial ring: phase 1 accumulates straight into registered memory."""
        if numel_capacity * 4 > self.region_bytes:
            raise ValueError("send slot smaller than the largest partial")
        return [
            self.window.tensor.narrow(0, k * self.region_bytes, numel_capacity * 4).view(
                torch.float32
            )
            for k in range(self.inflight)
        ]

    def wire_slot(self, dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` view of the window for ``RSBuffers.send``: partials rounded to a
        narrower wire dtype are put from registered memory too. It is the receive region
        of parity 0, step 0, which no peer writes (step 0 is this rank's own node)."""
        offset = self._recv_offset(0, 0)
        return self.window.tensor.narrow(0, offset, self.region_bytes).view(dtype)

    def begin_reduce(self) -> None:
        """Called once per TIDE-RS reduce that has a cross-node phase (the parity)."""
        self.reduces += 1

    def _recv_offset(self, parity: int, step: int) -> int:
        return (self.inflight + parity * self.num_nodes + step) * self.region_bytes

    def reduce_partial(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, step: int,
        group: dist.ProcessGroup, out: torch.Tensor, *, divisor: float, num_ctas: int,
    ) -> None:  # fmt: skip
        """:meth:`exchange`, then the received partial added into ``out`` (fp32, divided
        by ``divisor``) on the current stream, before a later reduce of the same parity
        can put into its region again."""
        recv = self.exchange(send, send_peer, recv_peer, step, group)
        kernels.accumulate_rows(
            recv.view(1, -1), out, accumulate=True, divisor=divisor, num_ctas=num_ctas
        )

    def exchange(
        self, send: torch.Tensor, send_peer: int, recv_peer: int, step: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:  # fmt: skip
        """Put ``send`` (1-D, any dtype) into ``send_peer``'s receive region of this
        reduce's step ``step`` and wait for ``recv_peer``'s put into this rank's; returns
        the received tensor (``send``'s dtype and numel), complete on the current
        stream. ``send`` outside the window is first copied into send slot 0's tail
        region (a copy-engine copy)."""
        if not 1 <= step < self.num_nodes:
            raise ValueError(f"cross-node step {step} outside 1..{self.num_nodes - 1}")
        nbytes = send.numel() * send.element_size()
        if nbytes > self.region_bytes:
            raise AssertionError(f"partial of {nbytes} B > region of {self.region_bytes} B")
        buf = self.window.tensor
        parity = (self.reduces - 1) % 2
        offset = self._recv_offset(parity, step)
        if not _inside(send, self.window):
            raise AssertionError("a one-sided put reads registered memory: the partial "
                                 "must be a view of the window (RSBuffers' ring)")  # fmt: skip

        def move() -> None:
            stream = torch.cuda.current_stream(buf.device)
            self.comm.put_signal(send, send_peer, self.window, offset, stream)
            self.comm.wait_signal(recv_peer, 1, stream)
            self.counters.puts += 1
            self.counters.put_bytes += nbytes
            self.counters.waits += 1
            watchdog.watch_stream("TIDE-RS one-sided wait", self.group_name,
                                  (global_rank(group, recv_peer),), buf.device)  # fmt: skip

        streams.run_beside(streams.stream("tide_one_sided_rs", buf.device), move)
        return buf.narrow(0, offset, nbytes).view(send.dtype)


def _inside(t: torch.Tensor, window: RmaWindow) -> bool:
    start = t.data_ptr()
    return (
        window.ptr <= start and start + t.numel() * t.element_size() <= window.ptr + window.nbytes
    )
