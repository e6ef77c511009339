"""TIDE-AG and TIDE-RS phase 1 on ONE registered NCCL window per process group: no SM kernel.

Every layout N nodes x L ranks runs here (L = 1 included): the rounds of
``comm/plans/window_rounds.py`` (where every byte sits, which op runs on which stream; read it
first) executed with NCCL's one-sided calls on the group's TIDE-owned communicator
(``nccl_rma.RmaComm``: puts by copy engine between ranks in load/store reach, NCCL's RMA
proxy across nodes) or, on CPU, the stand-in (``rma_standin.StandinRma``). One registration
serves the cross-node puts, the node-local fan-out and TIDE-RS's rows, and several ranks may
share a GPU (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), which torch's symmetric
memory refuses. Decisions and measurements: docs/design/2026-12-04-windows.md.

Executing the ops (CUDA): ``main`` is the caller's current stream (TIDE's stream), ``put``
the ``tide_one_sided`` stream (cross-node puts, the rail waits), ``fan`` the ``tide_fan``
stream (node-local puts and signals: the fan-out), ``place`` the ``tide_place`` stream
(placement copies, waits on local peers); ``Fork`` is ``dst.wait_stream(src)``. Placements
are ONE ``cudaMemcpyBatchAsync`` per op (copy engine), TIDE-RS's pack of gradient slices one
batch too; the own-shard pack is the cast FSDP2's copy-in does (one ``_foreach_copy_``),
TIDE-RS's sum the few-CTA accumulate kernel. Every wait on a peer is registered with the
watchdog. CPU (stand-in): the same ops in order on the host (a wait blocks until the peer's
signal).

Buffers: the window is owned by :class:`WindowSlots` (one per process group and device,
shared by its FSDP groups; the communicator frees it at ``comm.remove``). With the poison
test hook set (``poison.set_poison``) every half is filled with it after its last read, so a
read of stale bytes shows.

In place (any layout across nodes, :class:`InPlace`; docs/design/2026-12-07-zero-copy-nxl.md):
TIDE-AG points each parameter's unsharded storage at a range of the window's arena before
the all-gather (``bind_in_place``: the storage object's data pointer is swapped,
``storage_swap``, so every view of it, autograd's saved ones included, follows, as with
FSDP2's ``resize_``), the own shards are cast there by ``tide_all_gather`` and every other
shard is put there (``window_rounds.ag_in_place_ops``): no pack, no placement copy. FSDP2's
reshard (``FSDPParam.free_unsharded_param``, patched by ``fsdp/patch.py``; also an all-gather
FSDP2 drops at the end of a backward) calls :meth:`WindowTransport.release`: the pointer is
swapped back, the range freed, and a credit sent on the ``ag_credit`` communicator to every
rank that writes into this one (its local peers and the rail peers it receives from), on the
``tide_credit`` stream after the reshard point of the caller's stream. An all-gather that
finds no free range takes the placement path (logged once per group). With the poison hook
set, a released range is filled with it before the credit goes out.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...base import kernels, streams, watchdog
from ...base.poison import poison_value
from ...base.ranks import global_rank
from ...plans.plan import GroupPlan, RSRound, RSSegment, RSSlice, WorldLayout, packed_entry
from ...plans.window_arena import Taken, WindowArena, aligned
from ...plans.window_rounds import (
    FAN,
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
    ag_in_place_ops,
    ag_round_ops,
    in_place_writers,
    rs_round_ops,
)
from .. import drop_unsharded, hold_unsharded
from ..copy_engine import _try_batch, cast_into_entry
from .ring import AG_PUT_STREAM
from .storage_swap import swap_storage_pairs, swap_storages

__all__ = ["InPlace", "WindowCounters", "WindowSlots", "WindowTransport"]

logger = logging.getLogger(__name__)

_STREAMS = {PUT: AG_PUT_STREAM, FAN: "tide_fan", PLACE: "tide_place"}


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
    in_place_all_gathers: int = 0  # of all_gathers, delivered straight into parameter storage
    arena_full: int = 0  # all-gathers that found no free arena range (placement path)
    credits: int = 0  # ag_credit signals sent
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


@dataclass
class InPlace:
    """TIDE-AG in place on a window's arena (module docstring): the host allocator, the
    ``ag_credit`` communicator (same ranks as the window's), the group ranks that put into
    this rank (fixed by the first all-gather: every group of the window has the same
    exchanges), and the credits waited for per peer."""

    arena: WindowArena
    credit_comm: object  # nccl_rma.RmaComm | rma_standin.StandinRma
    writers: tuple[int, ...] | None = None
    credits_seen: dict = field(default_factory=dict)


@dataclass
class _Binding:
    """One in-place all-gather's arena range and the parameters pointed at it: ``params``
    id -> (FSDPParam, the storage holding the parameter's own empty memory meanwhile)."""

    start: int
    nbytes: int
    params: dict = field(default_factory=dict)


class WindowTransport:
    """TIDE-AG (``gather``) and TIDE-RS's node-local rounds (``reduce_rows``) on a
    :class:`WindowSlots`. The plan is cross-node only (``build_group_plan(...,
    pull_local=True)``): the node-local fan-out is the window's own. With ``in_place``
    (more than one node, any ranks per node) all-gathers go straight into the parameters'
    storage."""

    name = "nccl_windows"

    def __init__(self, slots: WindowSlots, pacing: int, in_place: InPlace | None = None) -> None:
        self.slots, self.pacing, self.in_place = slots, pacing, in_place
        self._pending: tuple | None = None  # the bound all-gather ``gather`` runs next
        self._bindings: dict[int, _Binding] = {}  # id(FSDPParam) -> its range
        self._full_logged: set[str] = set()
        self._rebind_logged: set[str] = set()

    @property
    def writes_own_shard(self) -> bool:
        """Placement path: the own shard is packed and placed like every other entry; in
        place, ``tide_all_gather`` casts it into the parameter's (arena) storage."""
        return self._pending is None

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

    # ------------------------------------------------------------ TIDE-AG in place

    def bind_in_place(self, plan: GroupPlan, fsdp_params: list, outputs: list[torch.Tensor],
                      fqn: str) -> bool:  # fmt: skip
        """Point ``outputs`` (the FSDPParams' ``all_gather_outputs[0]``, not allocated yet or
        allocated once by FSDP2's first ``init_all_gather_outputs``) at a free arena range for
        the next :meth:`gather`; False (nothing changed) when this group does not go in place
        or no range is free. A range these parameters still hold (an all-gather FSDP2 dropped
        without a reshard) is given back first. Called on TIDE's stream, which then waits for
        this rank's last use of the range."""
        ip = self.in_place
        if ip is None or not outputs or not plan.exchanges:
            return False
        if any(type(o) is not torch.Tensor or getattr(fp, "_unsharded_inner_tensors", None)
               for fp, o in zip(fsdp_params, outputs)):  # fmt: skip
            return False
        if any(id(fp) in self._bindings for fp in fsdp_params):
            if fqn not in self._rebind_logged:
                self._rebind_logged.add(fqn)
                logger.info("TIDE %s: an earlier in-place all-gather of this group was never "
                            "resharded; its arena range is given back first", fqn)  # fmt: skip
            self.release_group(fsdp_params)
        sizes = [o.numel() * o.element_size() for o in outputs]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += aligned(n)
        writers = in_place_writers(plan.layout, plan.rank, plan.exchanges)
        if ip.writers is not None and ip.writers != writers:
            raise AssertionError(f"TIDE {fqn}: writers {writers} differ from the window's "
                                 f"{ip.writers}")  # fmt: skip
        taken = ip.arena.take(total)
        if taken is None:
            self.slots.counters.arena_full += 1
            if fqn not in self._full_logged:
                self._full_logged.add(fqn)
                logger.info(
                    "TIDE %s: the window arena has no free %d B (%d of %d B held by unsharded "
                    "groups): this all-gather, and any later one that finds it full, places "
                    "its shards with copies ([tide] ag_in_place_groups sizes the arena)",
                    fqn, total, ip.arena.in_use, ip.arena.nbytes,
                )  # fmt: skip
            return False
        ip.writers = writers
        try:
            binding = self._swap_into(taken, total, fsdp_params, outputs, offsets, sizes)
        except RuntimeError as e:  # refused before any exchange: place this all-gather
            # Every rank refuses alike: the checks read storages FSDP2 built the same way on
            # each rank (SPMD); a rank alone in placing would leave its peers' in-place puts
            # unmatched until TIDE's watchdog ends the job.
            ip.arena.untake(taken)  # nobody wrote the range; not a release
            logger.warning("TIDE %s: the storage swap refused a parameter (%s); this "
                           "all-gather places its shards with copies", fqn, e)  # fmt: skip
            return False
        except BaseException:
            ip.arena.untake(taken)
            raise
        for fp in fsdp_params:
            self._bindings[id(fp)] = binding
            hold_unsharded(fp, self)
        world = plan.layout.world_size
        self._pending = (plan, tuple(offsets), tuple(n // world for n in sizes), taken, binding)
        return True

    def _swap_into(self, taken: Taken, total: int, fsdp_params: list,
                   outputs: list[torch.Tensor], offsets: list[int],
                   sizes: list[int]) -> _Binding:  # fmt: skip
        """Swap each output's storage with its range of ``taken`` (``total`` bytes; the
        current stream first waits for this rank's last use of it); raises, with no storage
        swapped, if the swap refuses one."""
        device = outputs[0].device
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            for event in taken.events:
                current.wait_event(event)
        base = self.slots.window.tensor.data_ptr() + taken.start
        binding = _Binding(taken.start, total)
        pairs = []
        for fp, out, off, n in zip(fsdp_params, outputs, offsets, sizes):
            storage = out.untyped_storage()
            if storage.nbytes():  # FSDP2's first init_all_gather_outputs allocated it
                storage.resize_(0)
            held = torch._C._construct_storage_from_data_pointer(base + off, device, n)
            pairs.append((storage, held))  # ``held`` then holds the parameter's empty memory
            binding.params[id(fp)] = (fp, held)
        swap_storage_pairs(pairs)
        return binding

    def release(self, fsdp_param) -> None:
        """FSDP2 frees ``fsdp_param``'s unsharded storage (its reshard; on the stream current
        there): point it back at its own empty memory; once every parameter of the range is
        back, free the range and credit every writer (module docstring)."""
        binding = self._bindings.pop(id(fsdp_param))
        _, held = binding.params.pop(id(fsdp_param))
        swap_storages(fsdp_param.all_gather_outputs[0].untyped_storage(), held)
        if not binding.params:
            self._give_range(binding)

    def release_group(self, fsdp_params: list) -> None:
        """Give back every arena range any of ``fsdp_params`` holds (their all-gather was
        dropped without a reshard, or did not complete): every parameter of such a range
        is pointed back at its own empty memory, the range freed and every writer credited,
        as a reshard would (on the stream current here)."""
        bindings = {id(b): b for fp in fsdp_params if (b := self._bindings.get(id(fp)))}
        for binding in bindings.values():
            self._unbind(binding)
            self._give_range(binding)

    def _unbind(self, binding: _Binding) -> list[tuple[object, torch.UntypedStorage]]:
        """Point every parameter still in ``binding`` back at its own empty memory (one
        batch of swaps) and forget it; returns ``(FSDPParam, storage now over the range)``."""
        members = list(binding.params.values())
        swap_storage_pairs([(fp.all_gather_outputs[0].untyped_storage(), held)
                            for fp, held in members])  # fmt: skip
        for fp, _ in members:
            del self._bindings[id(fp)]
            drop_unsharded(fp)
        binding.params.clear()
        return members

    def cancel_pending(self) -> None:
        """An exception between :meth:`bind_in_place` and :meth:`gather`: forget the bound
        plan (the next all-gather must not run it) and give its range back."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.release_group([fp for fp, _ in pending[4].params.values()])

    def _give_range(self, binding: _Binding) -> None:
        ip = self.in_place
        assert ip is not None and ip.writers is not None
        window = self.slots.window.tensor
        if poison_value() is not None:  # 0xFF bytes: NaN in bf16, fp16 and fp32 alike
            window.narrow(0, binding.start, binding.nbytes).fill_(0xFF)
        if window.device.type == "cuda":
            current = torch.cuda.current_stream(window.device)
            event = current.record_event()
            ip.arena.give(binding.start, binding.nbytes, event, current.stream_id)
            credit_stream = streams.stream("tide_credit", window.device)
            credit_stream.wait_event(event)
        else:
            ip.arena.give(binding.start, binding.nbytes)
            credit_stream = None
        for peer in ip.writers:
            ip.credit_comm.signal(peer, credit_stream)
        self.slots.counters.credits += len(ip.writers)

    @property
    def arena_in_use(self) -> int:
        """Bytes of the arena held by unsharded groups now (0 without an arena)."""
        return self.in_place.arena.in_use if self.in_place is not None else 0

    def detach_all(self) -> None:
        """Before the window is freed (``comm.remove``): every parameter still pointed at
        the arena is pointed back at its own storage, which gets the bytes in memory of its
        own (FSDP2's storage, resized by its allocator: no owning swap; nothing lost)."""
        self._pending = None
        if not self._bindings:
            return
        device = self.slots.window.tensor.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the puts have landed
        bindings = {id(b): b for b in self._bindings.values()}
        for binding in bindings.values():
            for fp, held in self._unbind(binding):
                storage = fp.all_gather_outputs[0].untyped_storage()
                storage.resize_(held.nbytes())
                own = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                own.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(held))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # before the window goes

    def _gather_in_place(self, group: dist.ProcessGroup, device: torch.device) -> None:
        plan, offsets, shard_bytes, taken, _ = self._pending
        self._pending = None
        slots, ip = self.slots, self.in_place
        ops, ip.credits_seen = ag_in_place_ops(
            plan, offsets, shard_bytes, taken.start, taken.credit, ip.credits_seen,
            slots.counters.in_place_all_gathers, self.pacing,
        )  # fmt: skip
        slots.counters.all_gathers += 1
        slots.counters.in_place_all_gathers += 1
        run = _Run(slots, group, device, "TIDE-AG", ip.credit_comm)
        run.execute(ops)
        slots.last_ag_ops = ops

    # ------------------------------------------------------------ TIDE-AG

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        slots = self.slots
        if self._pending is not None:
            self._gather_in_place(group, outputs[0].device)
            return None
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
        self, slots: WindowSlots, group: dist.ProcessGroup, device: torch.device, what: str,
        credit_comm: object = None,
    ) -> None:  # fmt: skip
        self.slots, self.group, self.device, self.what = slots, group, device, what
        self.comms = {"slots": slots.comm, "ag_credit": credit_comm}
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
            self.comms[op.comm].signal(op.peer, self._stream_arg(op.stream))
            counters.signals += 1
        elif isinstance(op, Wait):
            self.comms[op.comm].wait_signal(op.peer, op.count, self._stream_arg(op.stream))
            counters.waits += 1
            if self.cuda:
                tier = ("node-local" if op.peer // slots.layout.local_world_size == self.node
                        else "cross-node")  # fmt: skip
                kind = "credit" if op.comm == "ag_credit" else "window"
                watchdog.watch_stream(f"{self.what} {tier} {kind} wait", slots.group_name,
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
