"""TIDE-AG and TIDE-RS phase 1 on ONE registered NCCL window per process group: no SM kernel.

Every layout N nodes x L ranks runs here (L = 1 included): the rounds of
``comm/window_rounds.py`` (where every byte sits, which op runs on which stream; read it
first) executed with NCCL's one-sided calls on the group's TIDE-owned communicator
(``nccl_rma.RmaComm``: puts by copy engine between ranks in load/store reach, NCCL's RMA
proxy across nodes) or, on CPU, the stand-in (``rma_standin.StandinRma``). One registration
serves the cross-node puts, the node-local fan-out and TIDE-RS's rows, and several ranks may
share a GPU (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), which torch's symmetric
memory refuses. Decisions and measurements: docs/2026-12-04-windows.md.

Executing the ops (CUDA): ``main`` is the caller's current stream (TIDE's stream), ``put``
the ``tide_one_sided`` stream (every put and signal, the rail waits), ``place`` the
``tide_place`` stream (placement copies, waits on local peers); ``Fork`` is
``dst.wait_stream(src)``. Placements are ONE ``cudaMemcpyBatchAsync`` per op (copy engine),
TIDE-RS's pack of gradient slices one batch too; the own-shard pack is the cast FSDP2's
copy-in does (one ``_foreach_copy_``), TIDE-RS's sum the few-CTA accumulate kernel. Every
wait on a peer is registered with the watchdog. CPU (stand-in): the same ops in order on the
host (a wait blocks until the peer's signal).

Buffers: the window is owned by :class:`WindowSlots` (one per process group and device,
shared by its FSDP groups; the communicator frees it at ``comm.remove``). With the poison
test hook set (``poison.set_poison``) every half is filled with it after its last read, so a
read of stale bytes shows.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import kernels, streams, watchdog
from ..plan import GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout, packed_entry
from ..poison import poison_value
from ..window_rounds import (
    MAIN,
    PLACE,
    PUT,
    Accumulate,
    Fork,
    Op,
    PackOwn,
    PackSlices,
    Place,
    Put,
    Signal,
    Wait,
    WindowLayout,
    ag_round_ops,
    rs_round_ops,
)
from . import global_rank
from .copy_engine import _try_batch, cast_into_entry

__all__ = ["WindowCounters", "WindowSlots", "WindowTransport"]

logger = logging.getLogger(__name__)

_STREAMS = {PUT: "tide_one_sided", PLACE: "tide_place"}


@dataclass
class WindowCounters:
    """What the window transport moved (tests assert the path ran; benchmarks read it)."""

    puts: int = 0
    put_bytes: int = 0
    cross_node_put_bytes: int = 0  # of put_bytes, to ranks of other nodes
    signals: int = 0
    waits: int = 0
    placed_copies: int = 0
    packed_slices: int = 0
    all_gathers: int = 0
    rs_rounds: int = 0


@dataclass
class WindowSlots:
    """The window of one process group on one device: its communicator (ranks = the FSDP
    group's ranks), the registered window (``window.tensor``: ``uint8``), the byte layout,
    and the counts every rank advances alike (all-gathers: rail parity; rounds: local
    parity). ``peer_ranks``: global rank of each group rank (watchdog reports)."""

    comm: object  # nccl_rma.RmaComm | rma_standin.StandinRma
    window: object  # nccl_rma.RmaWindow
    layout: WindowLayout
    group_name: str
    peer_ranks: tuple[int, ...]
    ag_index: int = 0
    round_index: int = 0
    counters: WindowCounters = field(default_factory=WindowCounters)
    last_ag_ops: list = field(default_factory=list)  # the last all-gather's ops (schedule dumps)


class WindowTransport:
    """TIDE-AG (``gather``) and TIDE-RS's node-local rounds (``reduce_rows``) on a
    :class:`WindowSlots`. The plan is cross-node only (``build_group_plan(...,
    pull_local=True)``): the node-local fan-out is the window's own."""

    name = "nccl_windows"
    writes_own_shard = True  # the own shard is packed and placed like every other entry

    def __init__(self, slots: WindowSlots, pacing: int) -> None:
        self.slots, self.pacing = slots, pacing

    @property
    def counters(self) -> WindowCounters:
        return self.slots.counters

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank put to ranks of other nodes (TIDE-AG's cross-node tier; the
        benchmarks' wire bytes, as ``P2PTransport.sent_bytes``)."""
        return self.slots.counters.cross_node_put_bytes

    @property
    def staging_capacity(self) -> int:
        """Bytes of TIDE-RS rows one round can stage (``reduce_scatter.rows_per_round``)."""
        wl = self.slots.layout
        return wl.rs_area_bytes

    # ------------------------------------------------------------ TIDE-AG

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        slots = self.slots
        packing = packed_entry(plan.params, [o.element_size() for o in outputs])
        ops = ag_round_ops(slots.layout, plan, packing, slots.ag_index, slots.round_index,
                           self.pacing)  # fmt: skip
        slots.ag_index += 1
        slots.round_index += 1
        slots.counters.all_gathers += 1
        run = _Run(slots, group, outputs[0].device if outputs else slots.window.tensor.device,
                   "TIDE-AG")  # fmt: skip
        run.ag = (plan, packing, inputs, outputs)
        run.execute(ops)
        run.poison_read_halves(ops)
        slots.last_ag_ops = ops
        return None

    # ------------------------------------------------------------ TIDE-RS

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
        """One node-local TIDE-RS round (``plan.rs_schedule``) as ``window_rounds.rs_round_ops``:
        the pushes packed into the window, put, the local peers' rows waited for, then summed
        into ``target`` (fp32; overwritten in round ``rnd.first``, divided by ``divisor``)."""
        del segments  # the pushes say where every slice goes
        slots = self.slots
        ops = rs_round_ops(slots.layout, layout, rank, rnd, pushes, target.numel(),
                           grads[0].element_size(), slots.round_index)  # fmt: skip
        slots.round_index += 1
        slots.counters.rs_rounds += 1
        run = _Run(slots, group, target.device, "TIDE-RS")
        run.rs = (grads, target, not rnd.first, divisor, num_ctas)
        run.execute(ops)
        run.poison_read_halves(ops)


class _Run:
    """Executes one round's ops (see the module docstring) for :class:`WindowTransport`."""

    def __init__(
        self, slots: WindowSlots, group: dist.ProcessGroup, device: torch.device, what: str
    ) -> None:
        self.slots, self.group, self.device, self.what = slots, group, device, what
        self.node = group.rank() // slots.layout.local_world_size
        self.cuda = device.type == "cuda"
        self.buf = slots.window.tensor
        self.ag: tuple | None = None
        self.rs: tuple | None = None
        self.streams: dict[str, object] = {}
        if self.cuda:
            self.streams[MAIN] = torch.cuda.current_stream(device)
            for name, stream_name in _STREAMS.items():
                self.streams[name] = streams.stream(stream_name, device)

    def _on(self, stream: str):
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams[stream])

    def execute(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Fork):
                if self.cuda:
                    self.streams[op.dst].wait_stream(self.streams[op.src])
                continue
            with self._on(op.stream):
                self._one(op)

    def _stream_arg(self, name: str):
        return self.streams.get(name)

    def _one(self, op: Op) -> None:
        slots, counters = self.slots, self.slots.counters
        if isinstance(op, PackOwn):
            self._pack_own(op)
        elif isinstance(op, PackSlices):
            self._pack_slices(op)
        elif isinstance(op, Put):
            src = self.buf.narrow(0, op.src, op.nbytes)
            slots.comm.put_signal(src, op.peer, slots.window, op.dst, self._stream_arg(op.stream))
            counters.puts += 1
            counters.put_bytes += op.nbytes
            if op.peer // slots.layout.local_world_size != self.node:
                counters.cross_node_put_bytes += op.nbytes
        elif isinstance(op, Signal):
            slots.comm.signal(op.peer, self._stream_arg(op.stream))
            counters.signals += 1
        elif isinstance(op, Wait):
            slots.comm.wait_signal(op.peer, op.count, self._stream_arg(op.stream))
            counters.waits += 1
            if self.cuda:
                tier = ("node-local" if op.peer // slots.layout.local_world_size == self.node
                        else "cross-node")  # fmt: skip
                watchdog.watch_stream(f"{self.what} {tier} window wait", slots.group_name,
                                      (global_rank(self.group, op.peer),), self.device)  # fmt: skip
        elif isinstance(op, Place):
            self._place(op)
        elif isinstance(op, Accumulate):
            self._accumulate(op)
        else:
            raise TypeError(f"unknown window op {op!r}")

    def _pack_own(self, op: PackOwn) -> None:
        _, packing, inputs, outputs = self.ag
        cast_into_entry(self.buf, op.dst, packing, inputs, outputs)

    def _place(self, op: Place) -> None:
        plan, packing, _, outputs = self.ag
        dsts, srcs, sizes = [], [], []
        base = self.buf.data_ptr()
        for start, src_rank, _ in op.entries:
            for p, out, off, n in zip(plan.params, outputs, packing.offsets, packing.nbytes):
                if n:
                    dsts.append(out.data_ptr() + p.dst_offset(src_rank) * out.element_size())
                    srcs.append(base + start + off)
                    sizes.append(n)
        self.slots.counters.placed_copies += len(dsts)
        index = self.device.index or 0
        if dsts and _try_batch(self.device, dsts, srcs, sizes, [index] * len(dsts), index,
                               "TIDE-AG window placement"):  # fmt: skip
            return
        for start, src_rank, _ in op.entries:
            for p, out, off, n in zip(plan.params, outputs, packing.offsets, packing.nbytes):
                if n:
                    src = self.buf.narrow(0, start + off, n).view(out.dtype)
                    out.narrow(0, p.dst_offset(src_rank), p.shard_numel).copy_(src)

    def _pack_slices(self, op: PackSlices) -> None:
        grads = self.rs[0]
        itemsize = grads[0].element_size()
        base = self.buf.data_ptr()
        dsts = [base + d for d in op.dsts]
        srcs = [grads[s.param_index].data_ptr() + s.src_offset * itemsize for s in op.slices]
        sizes = [s.numel * itemsize for s in op.slices]
        self.slots.counters.packed_slices += len(dsts)
        index = self.device.index or 0
        if dsts and _try_batch(self.device, dsts, srcs, sizes, [index] * len(dsts), index,
                               "TIDE-RS window pack"):  # fmt: skip
            return
        for s, d in zip(op.slices, op.dsts):
            dst = self.buf.narrow(0, d, s.numel * itemsize).view(grads[0].dtype)
            dst.copy_(grads[s.param_index].narrow(0, s.src_offset, s.numel))

    def _accumulate(self, op: Accumulate) -> None:
        grads, target, accumulate, divisor, num_ctas = self.rs
        dtype = grads[0].dtype
        rows = (self.buf.narrow(0, op.start, op.count * op.row_bytes).view(dtype)
                .view(op.count, target.numel()))  # fmt: skip
        kernels.accumulate_beside(rows, target, accumulate=accumulate, divisor=divisor,
                                  num_ctas=num_ctas)  # fmt: skip

    def poison_read_halves(self, ops: list[Op]) -> None:
        """With the poison hook set (any value), fill the bytes this round read (placed entries, summed
        rows) after the round, on ``main``: a later round that reads them before a peer wrote
        them again sees the poison. Safe: peers write these bytes again only after this
        rank's next round signalled them, which is issued after this."""
        value = poison_value()
        if value is None:
            return
        spans = []
        for op in ops:
            if isinstance(op, Place):
                spans += [(start, op.entry_bytes) for start, _, _ in op.entries]
            elif isinstance(op, Accumulate):
                spans.append((op.start, op.count * op.row_bytes))
        with self._on(MAIN):  # 0xFF bytes: NaN in bf16, fp16 and fp32 alike
            for start, nbytes in spans:
                self.buf.narrow(0, start, nbytes).fill_(0xFF)
