"""Options of TIDE-AG and TIDE-RS: the one definition and the one validation.

:class:`TideOptions` is the source: ``comm.apply(model, "tide", **options)`` builds it
(:meth:`TideOptions.from_kwargs`), ``install`` reads it, and the ``[tide]`` TOML section
(``torchtitan_tide.config.Tide``) holds the same options under the names of
:data:`TOML_KEYS`, with its defaults taken from here and its values checked by
:func:`validate_options` (so the launcher, ``comm.apply`` and ``install`` apply one set of
rules, and an error names the TOML key as well as the ``comm.apply`` keyword).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = [
    "CROSS_NODE_TRANSPORTS", "REDUCE_SCATTERS", "RS_WIRE_DTYPES", "RS_WIRE_ITEMSIZE",
    "SLOT_BARRIERS", "STORAGE_SWAPS", "TOML_KEYS", "TRANSPORTS", "TideOptionError", "TideOptions",
    "option_label", "toml_key", "validate_options",
]  # fmt: skip

TRANSPORTS = ("auto", "nccl_windows", "copy_engine", "nccl_p2p", "gloo")
CROSS_NODE_TRANSPORTS = ("auto", "p2p", "nccl_one_sided")
REDUCE_SCATTERS = ("tide", "fsdp2")
SLOT_BARRIERS = ("copy_engine", "kernel")
STORAGE_SWAPS = ("native", "ctypes")
# [tide] rs_wire_dtype -> bytes per element on TIDE-RS's cross-node wire (torch-free:
# the simulator reads it).
RS_WIRE_ITEMSIZE = {"float32": 4, "bfloat16": 2}
RS_WIRE_DTYPES = tuple(RS_WIRE_ITEMSIZE)
# The [tide] TOML key of a TideOptions field, where the two names differ.
TOML_KEYS = {"transport": "ag_transport", "pacing": "ag_pacing"}


class TideOptionError(ValueError):
    """A TIDE option has a bad value; the message names the ``[tide]`` key and the fix."""


def toml_key(name: str) -> str:
    """The ``[tide]`` key of the :class:`TideOptions` field ``name``."""
    return TOML_KEYS.get(name, name)


def option_label(name: str) -> str:
    """How errors name an option: its TOML key, and its ``comm.apply`` keyword if it differs."""
    key = toml_key(name)
    return f"[tide] {key}" + (f" (comm.apply option {name})" if key != name else "")


@dataclass(frozen=True)
class TideOptions:
    """Options of the TIDE all-gather (AG) and reduce-scatter (RS).

    transport:
        ``"auto"``: NCCL windows (``"nccl_windows"``) for groups across nodes (unless
        ``cross_node_transport = "p2p"``) and for local peers that torch's symmetric memory
        cannot join (ranks sharing a GPU, no CUDA P2P), where the loaded NCCL (>= 2.29;
        >= 2.30 for ranks sharing a GPU) reports host RMA between every pair of the group's
        ranks; the copy engine (``"copy_engine"``) for one node of ranks on their own GPUs
        with CUDA P2P; point-to-point send/recv otherwise. What ``auto`` took, and why, is
        logged per group; a failed window set-up falls back to what it would take without.
        ``"nccl_windows"``: TIDE-AG and TIDE-RS's node-local rounds as one-sided puts into
        ONE registered NCCL window per process group (copy engine in the node, NCCL's RMA
        proxy across nodes: no SM kernel; docs/design/2026-12-04-windows.md); a named error where
        it cannot run.
        ``"copy_engine"``: force the copy engine (peers pull from torch's symmetric memory
        with one ``cudaMemcpyBatchAsync``; its cross-node phase is send/recv).
        ``"nccl_p2p"`` / ``"gloo"``: force point-to-point send/recv through the
        group's backend; both names select the same code, the name only
        documents the expected backend and is checked against it.
    local_world_size:
        Ranks per node within the FSDP group. ``None`` (or 0, as the TOML
        writes it): found from the nodes of the group's ranks
        (``topology.resolve_local_world_size``; right for strided sub-groups
        where ``LOCAL_WORLD_SIZE`` or the device count are not). Set it to
        test the cross-node path on one machine, e.g. 1 on 2 GPUs (2 "nodes"
        of 1) or 2 on 4 gloo ranks (2 x 2). Must divide the size of every FSDP
        group (``group_sizes.check_local_world_size``).
    pacing:
        Maximum number of chunks (one contiguous range of one parameter) posted
        per direction in one batch of point-to-point operations. A step of the
        exchange with more chunks is split into waves; wave ``i + 1`` is posted
        after wave ``i`` completes. ``0``: a whole step in one batch. It bounds
        the number of outstanding send/recv operations (and NCCL p2p
        channels/fifo slots) per step; it does not affect the copy engine.
    cross_node_transport:
        What moves TIDE's cross-node traffic (TIDE-AG across nodes, TIDE-RS phase 2).
        ``"auto"``: NCCL's one-sided puts (no send/recv kernel: TIDE-AG through the group's
        window, TIDE-RS phase 2 through a ring of ``rs_inflight`` regions) where the loaded
        NCCL is >= 2.29 and reports host RMA between every pair of the group's ranks; else
        point-to-point send/recv, with the reason logged. ``"p2p"``: always send/recv.
        ``"nccl_one_sided"``: the one-sided path or a named error at ``comm.apply``.
        Docs: docs/design/2026-12-04-windows.md.
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
        waits only when all of them are still in flight. Over one-sided puts it is also
        the number of receive regions per rank (credits bound the senders): phase 2's
        window holds ``2 * rs_inflight`` regions whatever the node count.
    rs_wire_dtype:
        Cross-node phase: the dtype of the partials on the wire. ``"float32"``:
        the fp32 partials as they are. ``"bfloat16"``: each node's fp32 partial
        is rounded once (round to nearest even) to bf16 before it is sent, half
        the bytes; the owner still accumulates in fp32. The error is one bf16
        rounding (relative 2**-8) of every other node's partial
        (docs/design/2026-12-02-rs-wire.md). fp32 gradients are rounded too. The
        node-local phase is unchanged (it moves the gradients in their dtype).
    slot_reuse:
        Copy engine and NCCL windows: TIDE-RS stages gradients in the same slots
        as TIDE-AG (one buffer, one protocol on one stream) instead of a
        buffer of its own.
    slot_barrier:
        Copy engine only: how local peers synchronize on the slots.
        ``"copy_engine"``: stream memory operations (a fenced flag write into
        each peer's signal pad, a stream wait on the own flags): no SM kernel.
        ``"kernel"``: torch's symmetric-memory barrier kernel (1 CTA that spins
        on an SM while it waits). Where the copy-engine barrier cannot run on
        some rank, every rank takes the kernel, logged.
    ag_in_place_groups:
        NCCL windows across nodes (any N x L): TIDE-AG puts every shard straight into its
        parameter's unsharded storage, which then lives in the window's arena until FSDP2
        reshards the group (no pack, no placement copy; docs/design/2026-12-04-windows.md). The
        arena holds this many of the largest groups at once (4 covers the root group, the
        last block and two in flight); an all-gather that finds it full places its shards
        with copies, logged. ``0``: every all-gather places (no arena). Default 4.
    ag_storage_swap:
        How TIDE-AG in place points a parameter's storage at the arena. ``"native"``
        (default): torch's ``UntypedStorage._swap_data_ptr_`` (torch >= 2.12); on a torch
        without it (2.11) every all-gather places, with the reason logged. ``"ctypes"``: on
        such a torch, exchange the two storages' fields with ctypes instead (offsets probed
        and a trial swap checked at start-up, both storages checked at every swap, signals
        held off across it; docs/design/2026-12-07-in-place-robust.md); where torch has the native
        swap, the native one runs (logged).
    """

    transport: str = "auto"
    local_world_size: int | None = None
    pacing: int = 0
    cross_node_transport: str = "auto"
    reduce_scatter: str = "tide"
    rs_ctas: int = 0
    rs_rows: int = 2
    rs_inflight: int = 2
    rs_wire_dtype: str = "float32"
    slot_reuse: bool = True
    slot_barrier: str = "copy_engine"
    ag_in_place_groups: int = 4
    ag_storage_swap: str = "native"
    install_timeout_s: int = 120

    def __post_init__(self) -> None:
        if type(self.local_world_size) is int and self.local_world_size == 0:  # TOML: detect
            object.__setattr__(self, "local_world_size", None)
        validate_options(self)

    @classmethod
    def from_kwargs(cls, **options: object) -> TideOptions:
        """Build from ``apply(**options)``; unknown names raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown tide option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]


def _choice(options: TideOptions, name: str, choices: tuple[str, ...], hint: str) -> None:
    value = getattr(options, name)
    if value not in choices:
        raise TideOptionError(
            f"{option_label(name)} = {value!r} is not valid; choose one of {list(choices)}{hint}"
        )


def _integer(options: TideOptions, name: str, minimum: int, hint: str = "") -> None:
    value = getattr(options, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TideOptionError(
            f"{option_label(name)} = {value!r} must be an integer >= {minimum}{hint}"
        )


def validate_options(options: TideOptions) -> None:
    """Check every field of ``options`` (the one validation of the TIDE options: run
    when a :class:`TideOptions` is made, i.e. by ``comm.apply``, and by the ``[tide]``
    section's ``Tide``, which the launcher and TorchTitan's config parsing build).

    Raises:
        TideOptionError: naming the ``[tide]`` key (and ``comm.apply`` keyword), the bad
            value and what is accepted.
    """
    _choice(options, "transport", TRANSPORTS, "; use 'auto' unless you are testing one transport")
    if options.local_world_size is not None:
        _integer(options, "local_world_size", 0,
                 " (0 or None: detect; else ranks per node, dividing every FSDP group)")  # fmt: skip
    _integer(options, "pacing", 0, " (0 = no limit)")
    _choice(options, "cross_node_transport", CROSS_NODE_TRANSPORTS,
            "; 'auto' takes NCCL's one-sided puts where the job's NCCL supports them")  # fmt: skip
    _choice(options, "reduce_scatter", REDUCE_SCATTERS, "; 'fsdp2' keeps FSDP2's reduce-scatter")
    _integer(options, "rs_ctas", 0)
    _integer(options, "rs_rows", 1)
    _integer(options, "rs_inflight", 1)
    _choice(options, "rs_wire_dtype", RS_WIRE_DTYPES,
            "; 'bfloat16' halves TIDE-RS's cross-node bytes at one bf16 rounding of each "
            "node's partial (docs/design/2026-12-02-rs-wire.md)")  # fmt: skip
    if not isinstance(options.slot_reuse, bool):
        raise TideOptionError(
            f"{option_label('slot_reuse')} = {options.slot_reuse!r} is not a boolean; "
            "write slot_reuse = true or false"
        )
    _choice(options, "slot_barrier", SLOT_BARRIERS,
            "; 'kernel' uses torch's symmetric-memory barrier kernel")  # fmt: skip
    _integer(options, "ag_in_place_groups", 0,
             " (groups whose unsharded parameters the window arena holds; 0 = placement "
             "copies)")  # fmt: skip
    _choice(options, "ag_storage_swap", STORAGE_SWAPS,
            "; 'ctypes' lets TIDE-AG go in place on a torch without "
            "UntypedStorage._swap_data_ptr_ (2.11)")  # fmt: skip
    _integer(options, "install_timeout_s", 1, " (seconds)")
