"""Options of TIDE-AG and TIDE-RS (the ``[tide]`` TOML section maps onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = [
    "REDUCE_SCATTERS", "SLOT_BARRIERS", "TRANSPORTS", "TideOptions",
]  # fmt: skip

TRANSPORTS = ("auto", "copy_engine", "nccl_p2p", "gloo")
REDUCE_SCATTERS = ("tide", "fsdp2")
SLOT_BARRIERS = ("copy_engine", "kernel")


@dataclass(frozen=True)
class TideOptions:
    """Options of the TIDE all-gather (AG) and reduce-scatter (RS).

    transport:
        ``"auto"``: the copy engine (peers pull from symmetric memory with one
        ``cudaMemcpyBatchAsync``) when all ranks of the group are on one node,
        CUDA is used and every peer is P2P-reachable; point-to-point
        send/recv (NCCL on GPU, gloo on CPU) otherwise.
        ``"copy_engine"``: force the copy engine (CUDA, one node only).
        ``"nccl_p2p"`` / ``"gloo"``: force point-to-point send/recv through the
        group's backend; both names select the same code, the name only
        documents the expected backend and is checked against it.
    local_world_size:
        Ranks per node within the FSDP group. ``None``: found from the nodes
        of the group's ranks (``topology.resolve_local_world_size``; right for
        strided sub-groups where ``LOCAL_WORLD_SIZE`` or the device count are
        not). Set it to test the cross-node path on one machine,
        e.g. 1 on 2 GPUs (2 "nodes" of 1) or 2 on 4 gloo ranks (2 x 2). Must
        divide the size of every FSDP group.
    pacing:
        Maximum number of chunks (one contiguous range of one parameter) posted
        per direction in one batch of point-to-point operations. A step of the
        exchange with more chunks is split into waves; wave ``i + 1`` is posted
        after wave ``i`` completes. ``0``: a whole step in one batch. It bounds
        the number of outstanding send/recv operations (and NCCL p2p
        channels/fifo slots) per step; it does not affect the copy engine.
    reduce_scatter:
        ``"tide"``: TIDE-RS (bf16 gradients read where autograd left them,
        reduced into fp32 shards; node-local phase on the AG transport, then
        the cross-node phase over point-to-point). ``"fsdp2"``: keep FSDP2's
        own reduce-scatter (TIDE-AG only).
    rs_ctas:
        Programs (CTAs) of the TIDE-RS accumulate kernel: ``N > 0`` persistent
        CTAs (never more than N SMs), ``0`` short-lived CTAs, one per block
        (see ``kernels``).
    rs_rows:
        Source rows per staging slot: how many node-local peers' gradient
        slices are summed per kernel pass. Buffer = ``rs_rows`` x the largest
        group's shard; independent of the GPU count.
    rs_inflight:
        Cross-node phase: fp32 partials that may wait for the network at once
        (a ring of buffers). The node-local phase of the next chunk or group
        waits only when all of them are still in flight.
    slot_reuse:
        Copy engine only: TIDE-RS stages gradients in the same symmetric slots
        as TIDE-AG (one buffer, one protocol on one stream) instead of a
        buffer of its own.
    slot_barrier:
        Copy engine only: how local peers synchronize on the slots.
        ``"copy_engine"``: stream memory operations (a fenced flag write into
        each peer's signal pad, a stream wait on the own flags): no SM kernel.
        ``"kernel"``: torch's symmetric-memory barrier kernel (1 CTA that spins
        on an SM while it waits). Where the copy-engine barrier cannot run on
        some rank, every rank takes the kernel, logged.
    """

    transport: str = "auto"
    local_world_size: int | None = None
    pacing: int = 0
    reduce_scatter: str = "tide"
    rs_ctas: int = 0
    rs_rows: int = 2
    rs_inflight: int = 2
    slot_reuse: bool = True
    slot_barrier: str = "copy_engine"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"tide option transport={self.transport!r} is not one of {TRANSPORTS}; "
                "use 'auto' unless you are testing one transport"
            )
        if self.local_world_size is not None and (
            not isinstance(self.local_world_size, int) or self.local_world_size < 1
        ):
            raise ValueError(
                f"tide option local_world_size={self.local_world_size!r} must be a positive "
                "int that divides the world size, or None to detect it"
            )
        if not isinstance(self.pacing, int) or self.pacing < 0:
            raise ValueError(
                f"tide option pacing={self.pacing!r} must be an int >= 0 (0 = no limit)"
            )
        if self.reduce_scatter not in REDUCE_SCATTERS:
            raise ValueError(
                f"tide option reduce_scatter={self.reduce_scatter!r} is not one of "
                f"{REDUCE_SCATTERS}; 'fsdp2' keeps FSDP2's reduce-scatter"
            )
        for name, minimum in (("rs_ctas", 0), ("rs_rows", 1), ("rs_inflight", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"tide option {name}={value!r} must be an int >= {minimum}")
        if not isinstance(self.slot_reuse, bool):
            raise ValueError(  # noqa: TRY004 - every bad option is a ValueError here
                f"tide option slot_reuse={self.slot_reuse!r} must be True or False"
            )
        if self.slot_barrier not in SLOT_BARRIERS:
            raise ValueError(
                f"tide option slot_barrier={self.slot_barrier!r} is not one of {SLOT_BARRIERS}; "
                "'kernel' uses torch's symmetric-memory barrier kernel"
            )

    @classmethod
    def from_kwargs(cls, **options: object) -> TideOptions:
        """Build from ``apply(**options)``; unknown names raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown tide option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]
