"""Copy-engine transport (CUDA): node-local pulls from symmetric memory.

Protocol of one all-gather (all on the current stream, which is TIDE's
all-gather stream; every rank runs the same sequence of all-gathers on a
process group, so ``round`` advances identically everywhere):

1. pack: this rank's shards are cast once (e.g. fp32 -> bf16) into slot
   ``round % 2`` of a symmetric-memory buffer of the node-local group, shared
   by all TIDE groups of the process group (``SymmSlots``; capacity =
   ``num_nodes`` x the largest group's packed shard bytes).
2. (more than one node) cross-node phase: the plan's recursive-doubling
   steps move whole node entries of the slot over point-to-point (NCCL), one
   message per step for the whole group, into the peers' slots.
3. node-local barrier (``SymmSlots.barrier``): every local peer has packed
   (and received) round ``r``. Because each rank runs all rounds in order on
   one stream, the barrier of round ``r`` also proves every local peer
   finished its pulls of round ``r - 1``; so when round ``r + 1`` writes slot
   ``(r + 1) % 2`` (the slot of ``r - 1``) no peer still reads it. Two slots
   and one barrier per all-gather make reuse safe.
4. pull: ONE ``cudaMemcpyBatchAsync`` call copies every (source rank,
   parameter) shard from the holder's slot straight into this rank's
   parameter storage at ``dst_offset(source rank)``. Same dtype on both sides:
   a pure copy-engine copy, no SM kernel. Measured (docs/design/2026-11-29-h200-facts.md): 576
   copies at 330 GiB/s as one batch versus 69 GiB/s as a loop of ``copy_``.

If ``cuda-bindings`` is missing (or the batch call fails once), the pulls run
as a loop of ``Tensor.copy_`` (each a ``cudaMemcpyAsync``), logged once as a
warning; ``_batch_state`` records why.

The barrier (``slot_barrier``): ``"copy_engine"`` (default) uses no SM: on the
current stream each rank writes the barrier's sequence number into every local
peer's flag word (``cuStreamWriteValue32``, fenced: the writes and copies before
it on the stream are visible first), then waits until its own flag words from
every peer reach that number (``cuStreamWaitValue32``, cyclic >=). The flag
words are the last ``world`` 32-bit words of each buffer's symmetric signal pad
(torch's barrier kernels use the first words). ``"kernel"``: torch's
``handle.barrier``, a 1-CTA kernel that spins on an SM while it waits.

Memory ordering (docs/design/2026-12-01-cluster-layouts.md): peers' data writes into this
rank's slot (TIDE-RS pushes) precede their flag write on their stream, and that
write is fenced (``cuStreamWriteValue32`` without ``NO_MEMORY_BARRIER``: a
system-scope fence for the stream's prior work), so the rows are visible once the
flag is. Where the device reports ``CAN_FLUSH_REMOTE_WRITES`` the waits also carry
``CU_STREAM_WAIT_VALUE_FLUSH``, which CUDA asks for when remote writes precede the
flag. With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue
and a parked wait would stall compute: the kernel barrier is used then (logged).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base import kernels, watchdog
from ..base.ranks import global_rank
from ..plans.memory_plan import slot_alloc_bytes
from ..plans.plan import (
    GroupPlan,
    PackedEntry,
    RSRound,
    RSSegment,
    RSSlice,
    WorldLayout,
    entry_runs,
    packed_entry,
)

__all__ = ["CopyEngineTransport", "SymmSlots", "batch_copy", "cast_into_entry"]

logger = logging.getLogger(__name__)

_batch_state: dict[str, object] = {"disabled_reason": None, "logged": False}
_CU_STREAM_WAIT_VALUE_GEQ = 0  # cyclic: (int32)(*addr - value) >= 0
_CU_STREAM_WAIT_VALUE_FLUSH = 1 << 30  # flush remote writes that reached the device
# The barrier the last ``SymmSlots.create`` chose, and why not the copy engine (tests, logs).
_barrier_state: dict[str, str | None] = {"kind": None, "fallback_reason": None}


@dataclass
class SymmSlots:
    """Two slots of ``slot_bytes`` in one symmetric-memory buffer, shared by
    all TIDE groups of one process group on one device. Owned by TIDE; lives
    until ``remove``. ``round`` counts all-gathers issued on it."""

    buffer: torch.Tensor  # uint8, 2 * slot_bytes, symmetric
    handle: object  # torch._C._distributed_c10d._SymmetricMemory
    slot_bytes: int
    peer_bufs: list[torch.Tensor]  # each group rank's buffer, mapped here
    peer_ptrs: list[int]  # data_ptr of each group rank's buffer
    peer_devices: list[int]  # CUDA device index of each group rank
    round: int = 0
    barrier_kind: str = "kernel"  # options.SLOT_BARRIERS; "copy_engine" set by create
    barrier_seq: int = 0  # uint32 sequence number of the last copy-engine barrier
    peer_flags: list[torch.Tensor] | None = None  # uint32 signal pad of each rank, mapped here
    flags_base: int = 0  # first flag word in every signal pad (word ``flags_base + src``)
    wait_flags: int = 0  # extra cuStreamWaitValue32 flags (FLUSH where the device has it)
    group_name: str = ""  # the node-local group (watchdog reports)
    peer_ranks: tuple[int, ...] = ()  # its global ranks (watchdog reports)

    @classmethod
    def create(
        cls,
        slot_bytes: int,
        group: dist.ProcessGroup,
        device: torch.device,
        barrier: str = "copy_engine",
    ) -> SymmSlots:
        """Collective over ``group``: :meth:`allocate` then :meth:`connect`."""
        return cls.connect(cls.allocate(slot_bytes, device), group, device, barrier)

    @staticmethod
    def allocate(slot_bytes: int, device: torch.device) -> torch.Tensor:
        """This rank's symmetric buffer of two slots (local: may fail alone, e.g. out of
        memory, so ``install`` agrees on it before any collective)."""
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = 2 * slot_alloc_bytes(slot_bytes)
        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)

    @classmethod
    def connect(
        cls,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        device: torch.device,
        barrier: str = "copy_engine",
        exchange: Callable[[object], list] | None = None,
    ) -> SymmSlots:
        """Collective over ``group``: rendezvous ``buffer`` (from :meth:`allocate`), set
        up the ``barrier`` (``options.SLOT_BARRIERS``). A copy-engine barrier that cannot
        run on some rank (no cuda-bindings, no signal pad) gives the kernel barrier on
        every rank, logged with the reason. ``exchange(value)``: every group rank's
        ``value`` in group-rank order (default ``all_gather_object`` over ``group``;
        ``install`` passes its bounded one, ``setup_steps.SetupSteps.exchange``)."""
        import torch.distributed._symmetric_memory as symm_mem

        slot_bytes = buffer.numel() // 2
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                enable(group.group_name)
            except Exception as e:  # noqa: BLE001 - deprecated/no-op on newer torch
                logger.debug("enable_symm_mem_for_group: %s", e)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        world = group.size()
        peer_bufs = [handle.get_buffer(r, (2 * slot_bytes,), torch.uint8, 0) for r in range(world)]
        peer_ptrs = [t.data_ptr() for t in peer_bufs]
        slots = cls(buffer, handle, slot_bytes, peer_bufs, peer_ptrs, [0] * world)
        slots.group_name, slots.peer_ranks = group.group_name, watchdog.group_ranks(group)
        reason = _setup_ce_barrier(slots, device) if barrier == "copy_engine" else "option"
        # One collective: every rank's device, and whether its copy-engine barrier works.
        if exchange is None:
            infos: list[tuple[int, str | None]] = [(0, None)] * world
            dist.all_gather_object(infos, (device.index, reason), group=group)
        else:
            infos = exchange((device.index, reason))
        slots.peer_devices = [index for index, _ in infos]
        failed = sorted({r for _, r in infos if r is not None})
        if barrier == "copy_engine" and not failed:
            slots.barrier_kind = "copy_engine"
        _barrier_state.update(kind=slots.barrier_kind, fallback_reason="; ".join(failed) or None)
        if barrier == "copy_engine" and failed:
            logger.warning(
                "TIDE slots: copy-engine barrier unavailable on some rank (%s); every rank "
                "uses the barrier kernel", "; ".join(failed)
            )  # fmt: skip
        return slots

    def barrier(self) -> None:
        """Node-local barrier on the current stream (module docstring): every local
        peer reached the same barrier, and what it wrote before is visible."""
        if self.barrier_kind == "copy_engine":
            _ce_barrier(self, torch.cuda.current_stream(self.buffer.device))
        else:
            self.handle.barrier(channel=0)
        watchdog.watch_stream(f"{self.barrier_kind} slot barrier", self.group_name,
                              self.peer_ranks, self.buffer.device)  # fmt: skip


def _setup_ce_barrier(slots: SymmSlots, device: torch.device) -> str | None:
    """Map every rank's signal pad as uint32, zero this rank's flag words and run
    each driver call once locally (nothing to wait for); None on success, else why
    the copy-engine barrier cannot run here."""
    handle, world = slots.handle, len(slots.peer_ptrs)
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
        # One hardware queue: a stream parked on a peer's flag would stall every
        # other stream of this GPU (compute included) until the peer arrives.
        return "CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue for every stream)"
    try:
        driver = _cuda_driver()
        pad_words = int(handle.signal_pad_size) // 4
        if pad_words < 2 * world:
            return f"signal pad of {pad_words} words is too small for {world} ranks"
        base = pad_words - world
        flags = [handle.get_signal_pad(r, [pad_words], torch.uint32, 0) for r in range(world)]
        me = handle.rank
        torch.ops.symm_mem.memset32_(flags[me], base, 0, world)
        torch.ops.symm_mem.stream_write_value32_(flags[me], base + me, 0)
        stream = torch.cuda.current_stream(device)
        _wait_value32(stream, flags[me].data_ptr() + 4 * (base + me), 0)
        torch.cuda.synchronize(device)
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
        index = device.index if device.index is not None else torch.cuda.current_device()
        err, can_flush = driver.cuDeviceGetAttribute(attr, index)
    except Exception as e:  # noqa: BLE001 - any failure means "use the kernel barrier"
        return f"{type(e).__name__}: {e}"
    slots.peer_flags, slots.flags_base = flags, base
    slots.wait_flags = _CU_STREAM_WAIT_VALUE_FLUSH if can_flush and not err else 0
    logger.info(
        "TIDE slots on cuda:%d: copy-engine barrier waits %s CU_STREAM_WAIT_VALUE_FLUSH "
        "(CAN_FLUSH_REMOTE_WRITES = %s%s)",
        index, "with" if slots.wait_flags else "without", can_flush,
        "" if not err else f", query failed: {err}",
    )  # fmt: skip
    return None


def _cuda_driver():
    from cuda.bindings import driver  # lazy: GPU machines only

    return driver


def _wait_value32(stream: torch.cuda.Stream, address: int, value: int, flags: int = 0) -> None:
    """``stream`` waits (no SM) until the uint32 at ``address`` is cyclically >= ``value``;
    ``flags`` may add ``_CU_STREAM_WAIT_VALUE_FLUSH``."""
    driver = _cuda_driver()

    def wait():
        res = driver.cuStreamWaitValue32(
            driver.CUstream(stream.cuda_stream),
            driver.CUdeviceptr(address),
            driver.cuuint32_t(value),
            _CU_STREAM_WAIT_VALUE_GEQ | flags,
        )
        return res[0] if isinstance(res, tuple) else res

    with torch.cuda.device(stream.device):
        err = wait()
        if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            # A thread that has used only torch's runtime calls may have no current
            # driver context: make the device's primary context (torch's) current.
            res = driver.cuDevicePrimaryCtxRetain(stream.device.index)
            driver.cuCtxSetCurrent(res[1])
            driver.cuDevicePrimaryCtxRelease(stream.device.index)
            err = wait()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWaitValue32 failed: {err}")


def _ce_barrier(slots: SymmSlots, stream: torch.cuda.Stream) -> None:
    """The copy-engine barrier on ``stream`` (module docstring). Every rank calls
    its barriers in the same order, so sequence numbers agree."""
    assert slots.peer_flags is not None
    slots.barrier_seq = (slots.barrier_seq + 1) & 0xFFFFFFFF
    seq, me, base = slots.barrier_seq, slots.handle.rank, slots.flags_base
    peers = [p for p in range(len(slots.peer_flags)) if p != me]
    with torch.cuda.stream(stream):
        for peer in peers:  # fenced: this stream's earlier writes land first
            torch.ops.symm_mem.stream_write_value32_(slots.peer_flags[peer], base + me, seq)
    own = slots.peer_flags[me].data_ptr()
    for peer in peers:
        _wait_value32(stream, own + 4 * (base + peer), seq, slots.wait_flags)


def _cudart():
    from cuda.bindings import runtime as cudart  # lazy: GPU machines only

    return cudart


def _check(err: object, what: str) -> None:
    cudart = _cudart()
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err}")


def batch_copy(
    dsts: list[int],
    srcs: list[int],
    sizes: list[int],
    src_devices: list[int],
    dst_devices: list[int] | int,
    stream: torch.cuda.Stream,
) -> None:
    """ONE ``cudaMemcpyBatchAsync`` of device-to-device copies on ``stream``
    (must not be the legacy default stream). ``dst_devices``: one CUDA device
    index per copy, or one for all. One attribute entry per run of copies with
    the same (source, destination) device, with location hints set,
    ``srcAccessOrder=Stream`` and ``PreferOverlapWithCompute``. Raises on error
    (the caller falls back). Issued with ``stream``'s device current."""
    cudart = _cudart()
    if stream.cuda_stream == 0:
        raise ValueError("cudaMemcpyBatchAsync rejects the legacy default stream")
    if isinstance(dst_devices, int):
        dst_devices = [dst_devices] * len(dsts)
    device_loc = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
    overlap = int(cudart.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute)
    attrs, attrs_idxs, prev = [], [], None
    for i, pair in enumerate(zip(src_devices, dst_devices)):
        if pair == prev:
            continue
        a = cudart.cudaMemcpyAttributes()
        a.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        a.srcLocHint.type = device_loc
        a.srcLocHint.id = pair[0]
        a.dstLocHint.type = device_loc
        a.dstLocHint.id = pair[1]
        a.flags = overlap
        attrs.append(a)
        attrs_idxs.append(i)
        prev = pair
    # cuda-bindings returns (err,) on CUDA 13 and (err, failIdx) on 12.8/12.9;
    # the inputs are the same.
    with torch.cuda.device(stream.device):
        res = cudart.cudaMemcpyBatchAsync(
            dsts, srcs, sizes, len(dsts), attrs, attrs_idxs, len(attrs), stream.cuda_stream
        )
    err = res[0] if isinstance(res, tuple) else res
    _check(err, f"cudaMemcpyBatchAsync({len(dsts)} copies)")


def _try_batch(
    device: torch.device,
    dsts: list[int],
    srcs: list[int],
    sizes: list[int],
    src_devs: list[int],
    dst_devs: list[int] | int,
    what: str,
) -> bool:
    """Run the copies as ONE ``cudaMemcpyBatchAsync`` on the current stream;
    False when that path is unavailable (CPU, no cuda-bindings, or it failed
    once: logged once, then the caller's ``copy_`` loop is used for good)."""
    if device.type != "cuda" or _batch_state["disabled_reason"] is not None:
        return False
    try:
        batch_copy(dsts, srcs, sizes, src_devs, dst_devs, torch.cuda.current_stream(device))
    except Exception as e:  # noqa: BLE001 - ImportError or CUDA error
        _batch_state["disabled_reason"] = f"{type(e).__name__}: {e}"
        logger.warning(
            "TIDE copy engine: cudaMemcpyBatchAsync unavailable (%s); "
            "falling back to one copy_ per shard (slower submission)",
            _batch_state["disabled_reason"],
        )
        return False
    if not _batch_state["logged"]:
        logger.info("TIDE copy engine: cudaMemcpyBatchAsync, %d copies (%s)", len(dsts), what)
        _batch_state["logged"] = True
    return True


def pack_own_shards(
    buffer: torch.Tensor,
    base: int,
    half_bytes: int,
    plan: GroupPlan,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
) -> PackedEntry:
    """Step 1 of a staged all-gather (copy-engine slot, one-sided window): cast this
    rank's shards ``inputs`` once into its entry of the round's half at byte ``base`` of
    ``buffer`` (``uint8``), on the current stream, in ``outputs``' dtypes. Raises when
    ``num_nodes`` entries do not fit in ``half_bytes``."""
    packing = packed_entry(plan.params, [o.element_size() for o in outputs])
    num_nodes = plan.layout.num_nodes
    if num_nodes * packing.entry_bytes > half_bytes:
        raise AssertionError(
            f"TIDE staging too small: {num_nodes} x {packing.entry_bytes} > {half_bytes}"
        )
    cast_into_entry(buffer, base + plan.layout.node_of(plan.rank) * packing.entry_bytes,
                    packing, inputs, outputs)  # fmt: skip
    return packing


def cast_into_entry(
    buffer: torch.Tensor,
    start: int,
    packing: PackedEntry,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
) -> None:
    """Cast ``inputs`` (this rank's shards) into the packed entry at byte ``start`` of
    ``buffer`` (``uint8``), parameter ``i`` in ``outputs[i]``'s dtype: one
    ``_foreach_copy_`` on the current stream (the cast FSDP2's copy-in does)."""
    packed = [
        buffer.narrow(0, start + off, n).view(o.dtype)
        for off, n, o in zip(packing.offsets, packing.nbytes, outputs)
    ]
    torch._foreach_copy_(packed, inputs)


class CopyEngineTransport:
    """Node-local pulls from symmetric memory, optionally after a cross-node phase.

    ``slots`` belong to the node-local process group: ``slots.peer_*[l]`` is
    local index ``l``'s buffer. The plan must be built with ``pull_local=True``
    (its exchanges are the cross-node phase only).

    Slot layout of one round (per rank, local index ``l``): ``num_nodes``
    entries of ``entry_bytes``; entry ``m`` holds the packed shards of rank
    ``(m, l)`` (per parameter, 16-byte aligned). With more than one node:

    1. pack the own shards into entry ``node``;
    2. cross-node phase over point-to-point (``group``'s backend, NCCL): the
       plan's exchanges, each a run of consecutive node entries = ONE message
       per step for the whole group, from and into the slot (staging: this is
       the one place TIDE-AG is not zero-copy, the slot is peer-readable);
    3. node-local barrier (also proves peers finished the previous round);
    4. ONE batch pulls, for every local index ``l'`` and node ``m``, entry
       ``m`` of ``l'``'s slot into this rank's storage at
       ``dst_offset(rank(m, l'))`` (``l' == l``: from the own slot, the own
       shard included, so the own shard is cast only once, by the pack).
    """

    name = "copy_engine"
    # The own shard is pulled from the own slot in the same batch (a copy-engine
    # copy), so the caller does not cast it into the storage with a kernel.
    writes_own_shard = True

    def __init__(self, slots: SymmSlots) -> None:
        self.slots = slots

    @property
    def staging_capacity(self) -> int:
        """Bytes of TIDE-RS rows one round can stage (one slot)."""
        return self.slots.slot_bytes

    def gather(
        self,
        plan: GroupPlan,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> dist.Work | None:
        slots = self.slots
        layout = plan.layout
        num_nodes, lws = layout.num_nodes, layout.local_world_size
        base = (slots.round % 2) * slots.slot_bytes
        slots.round += 1
        packing = pack_own_shards(slots.buffer, base, slots.slot_bytes, plan, inputs, outputs)
        nbytes, param_offs, entry_bytes = packing.nbytes, packing.offsets, packing.entry_bytes

        def entry(m: int) -> int:
            return base + m * entry_bytes

        # 2. cross-node phase: whole node entries, one message per run.
        for ex in plan.exchanges:
            ops = [
                dist.P2POp(
                    dist.isend,
                    slots.buffer.narrow(0, entry(m), k * entry_bytes),
                    global_rank(group, ex.send_peer),
                    group,
                )
                for m, k in entry_runs([layout.node_of(r) for r in ex.send_ranks])
            ] + [
                dist.P2POp(
                    dist.irecv,
                    slots.buffer.narrow(0, entry(m), k * entry_bytes),
                    global_rank(group, ex.recv_peer),
                    group,
                )
                for m, k in entry_runs([layout.node_of(r) for r in ex.recv_ranks])
            ]
            peers = (global_rank(group, ex.send_peer), global_rank(group, ex.recv_peer))
            watchdog.wait_works(dist.batch_isend_irecv(ops), "TIDE-AG cross-node p2p", group,
                                peers, slots.buffer.device)  # fmt: skip
        # 3. local peers packed/received round r and finished pulling round r - 1.
        slots.barrier()
        # 4. pull every (local index, node, param) shard, the own one included
        # (from the own slot: a copy-engine copy instead of a second cast kernel).
        sources = [(lp, m) for lp in range(lws) for m in range(num_nodes)]
        dsts, srcs, sizes, src_devs = [], [], [], []
        for lp, m in sources:
            src_rank = layout.rank_of(m, lp)
            for p, out, off, n in zip(plan.params, outputs, param_offs, nbytes):
                if n == 0:
                    continue
                dsts.append(out.data_ptr() + p.dst_offset(src_rank) * out.element_size())
                srcs.append(slots.peer_ptrs[lp] + entry(m) + off)
                sizes.append(n)
                src_devs.append(slots.peer_devices[lp])
        if not dsts:
            return None
        device = outputs[0].device
        if _try_batch(device, dsts, srcs, sizes, src_devs, device.index or 0, "TIDE-AG pulls"):
            return None
        # Fallback (and the CPU test path with shared-memory slots): one copy_
        # per (source, parameter), each a cudaMemcpyAsync on CUDA.
        for lp, m in sources:
            src_rank = layout.rank_of(m, lp)
            peer_buf = slots.peer_bufs[lp]
            for p, out, off, n in zip(plan.params, outputs, param_offs, nbytes):
                if n == 0:
                    continue
                src = peer_buf.narrow(0, entry(m) + off, n).view(out.dtype)
                out.narrow(0, p.dst_offset(src_rank), p.shard_numel).copy_(src)
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
        """One node-local TIDE-RS round (``plan.rs_schedule``): push this rank's
        gradient slices (``pushes``, from the plan) straight from ``grads`` (flat, where autograd left
        them) into the local peers' staging rows, in ONE batch of copy-engine
        copies, then the node-local barrier; then sum this rank's received rows
        ``[len(rnd.recvs), target.numel()]`` (a view of its slot, in the gradients'
        dtype) into ``target`` (``kernels.accumulate_beside``: ``target`` overwritten
        in round ``rnd.first``, added to after; divided by ``divisor``), before the
        next round's barrier can let a peer overwrite them.

        Slot protocol: the same as the all-gather (round counter shared when
        the slots are shared): the barrier of round r proves every local peer
        finished reading slot ``(r - 1) % 2``, and pushes of round r land in
        slot ``r % 2``, which no peer reads before the barrier of round r."""
        del layout, rank, segments  # the plan's pushes say where every slice goes
        del group  # node-local only: the slots' handle does the synchronization
        slots = self.slots
        dtype, itemsize = grads[0].dtype, grads[0].element_size()
        rows_used, row_numel = len(rnd.recvs), target.numel()
        if rows_used * row_numel * itemsize > slots.slot_bytes:
            raise AssertionError(
                f"TIDE-RS staging too small: {rows_used} x {row_numel} x {itemsize} B "
                f"> {slots.slot_bytes} B"
            )
        base = (slots.round % 2) * slots.slot_bytes
        slots.round += 1
        device = grads[0].device

        def dst_byte(push: RSSlice) -> int:  # byte offset in the peer's buffer
            return base + (push.row * row_numel + push.dst_offset) * itemsize

        dsts = [slots.peer_ptrs[p.peer] + dst_byte(p) for p in pushes]
        srcs = [grads[p.param_index].data_ptr() + p.src_offset * itemsize for p in pushes]
        sizes = [p.numel * itemsize for p in pushes]
        dst_devs = [slots.peer_devices[p.peer] for p in pushes]
        src_devs = [device.index or 0] * len(pushes)
        if pushes and not _try_batch(device, dsts, srcs, sizes, src_devs, dst_devs, "TIDE-RS"):
            for p in pushes:
                dst = slots.peer_bufs[p.peer].narrow(0, dst_byte(p), p.numel * itemsize)
                dst.view(dtype).copy_(grads[p.param_index].narrow(0, p.src_offset, p.numel))
        slots.barrier()
        rows = (
            slots.buffer.narrow(0, base, rows_used * row_numel * itemsize)
            .view(dtype)
            .view(rows_used, row_numel)
        )
        kernels.accumulate_beside(
            rows, target, accumulate=not rnd.first, divisor=divisor, num_ctas=num_ctas
        )
