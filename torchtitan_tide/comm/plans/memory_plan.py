"""Memory plan: bytes of all-gather (AG) and reduce-scatter (RS) buffers per comm mode.

Pure Python (integer arithmetic on parameter shapes), so it answers for any GPU count
without GPUs. ``python -m torchtitan_tide.memory_report`` prints this plan for the groups of a
training TOML (``torchtitan_tide/fsdp_groups.py``); ``torchtitan_tide.simulator`` shares its groups (``GroupShape``). The
TIDE sizes follow what ``comm.fsdp.install`` allocates (slots through the shared
:func:`slot_sizes`, staging, RSBuffers).

Notation (all per rank, in bytes unless said otherwise):

- ``W``: FSDP shard degree; ``L``: ranks of one node in the FSDP group; ``N = W / L`` nodes.
- ``s_p = ceil(shape[0] / W) * prod(shape[1:])``: padded shard numel of parameter ``p``
  (FSDP2 shards dim 0 and pads every rank to the largest chunk).
- ``S_g = sum_p s_p`` over the parameters of FSDP group ``g``; ``S_max = max_g S_g``.
- ``b_ag``: all-gather (param) dtype bytes; ``b_grad = b_ag`` (unsharded gradients);
  ``b_red``: reduce dtype bytes; ``b_master``: sharded parameter / optimizer dtype bytes.
- ``A = max_g sum_p round16(s_p * b_ag)``: the largest group's shard packed with every
  parameter 16-byte aligned (the copy-engine slot entry,
  ``fsdp.internals.shard_bytes(..., align=16)``).
- ``slot(x) = round128(max(x, 16))``: a symmetric slot as ``SymmSlots.create`` makes it.

Modes (formulas also in :data:`FORMULAS`, printed by the CLI):

- ``fsdp2`` (stock): AG flat buffer ``W * S_g * b_ag`` per group, RS input (the fp32 copy of
  the whole group's gradients) ``W * S_g * b_red``; the RS output ``S_g * b_red`` is the
  sharded gradient itself and counts under gradients. Peak in flight, two groups each
  (current + prefetched): AG ``2 * max_g W * S_g * b_ag``, RS ``2 * max_g W * S_g * b_red``.
- ``symm_mem``: the same bytes, allocated from the symmetric-memory pool (persistent,
  cached by the pool).
- ``tide``: AG writes the unsharded parameters in place (no flat buffer). With the copy
  engine (``L > 1``) it keeps two persistent symmetric slots of ``N * A`` each. TIDE-RS
  stages ``R = min(L, rs_rows)`` source rows of ``S_max * b_grad``: with the copy engine two
  slots of ``R * S_max * b_grad``, shared with the AG slots under Slot-Reuse (two slots of
  ``max(N * A, R * S_max * b_grad)``; TIDE-RS owns only what exceeds the AG slots);
  point-to-point (``L = 1``) one staging buffer of ``R * S_max * b_grad``. Across nodes
  (``N > 1``) add the fp32 partial ring ``K * S_max * 4`` (``K = rs_inflight``) and one fp32
  receive buffer ``S_max * 4`` (``rs_wire_dtype = "bfloat16"``: a bf16 receive buffer and a
  bf16 send buffer, ``2 * S_max * 2``: the same bytes). At fixed per-rank shard size the
  TIDE-RS bytes do not grow with the GPU count; stock RS grows with ``W``.
- ``tide_ag``: TIDE-AG with FSDP2's reduce-scatter (``[tide] reduce_scatter = "fsdp2"``):
  the AG slots of ``tide`` (no Slot-Reuse) and the RS buffers of ``fsdp2``.

Every mode also carries, as context: gradients ``sum_g S_g * b_red`` and sharded fp32
parameters plus AdamW's two moments ``sum_g S_g * b_master * 3``. Unsharded parameters and
activations are the same in every mode and are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .plan import WorldLayout
from .window_arena import aligned, arena_bytes
from .window_rounds import ring_layout, window_layout

__all__ = [
    "FORMULAS",
    "MODES",
    "CommDtypes",
    "GroupShape",
    "ModePlan",
    "aligned_group_bytes",
    "group_shard_numel",
    "padded_shard_numel",
    "plan_memory",
    "rs_staging_bytes",
    "slot_alloc_bytes",
    "slot_sizes",
]

MODES = ("fsdp2", "symm_mem", "tide", "tide_ag")
SLOT_ELEMENT_ALIGN = 16  # bytes; each parameter's entry in a copy-engine slot
SLOT_ALLOC_ALIGN = 128  # bytes; SymmSlots.create rounds a slot up to this
ADAMW_STATES = 3  # sharded master parameter + exp_avg + exp_avg_sq
# Groups FSDP2 holds unsharded at once under TorchTitan's defaults: the root group, the last
# block (not resharded after forward), the current block and the prefetched one.
IN_FLIGHT_GROUPS = 4

FORMULAS: dict[str, dict[str, str]] = {
    "fsdp2": {
        "ag": "2 * max_g W*S_g*b_ag (flat AG buffer; current + prefetched group); part "
              "ag_outputs_in_flight: + the unsharded parameters of the IN_FLIGHT_GROUPS largest "
              "groups (FSDP2's all_gather_outputs, transient; TIDE in place holds them in its "
              "window's arena instead)",
        "rs": "2 * max_g W*S_g*b_red (RS input: whole group's grads in reduce dtype; 2 groups)",
        "gradients": "sum_g S_g*b_red (RS output = sharded gradient)",
        "params_optimizer": "sum_g S_g*b_master*3 (params + AdamW exp_avg, exp_avg_sq)",
    },
    "symm_mem": {
        "ag": "same as fsdp2, from the symmetric-memory pool (persistent, cached by the pool)",
        "rs": "same as fsdp2, from the symmetric-memory pool (persistent, cached by the pool)",
        "gradients": "sum_g S_g*b_red",
        "params_optimizer": "sum_g S_g*b_master*3",
    },
    "tide": {
        "ag": "2 * slot(N*A) symmetric slots, persistent (copy engine, L > 1; else 0)",
        "rs": (
            "copy engine: Slot-Reuse 2*slot(max(N*A, R*S_max*b_grad)) - AG slots, else "
            "2*slot(R*S_max*b_grad); p2p (L = 1): R*S_max*b_grad; R = min(L, rs_rows); "
            "+ (N > 1) (K+1)*S_max*4 fp32 partial ring and receive buffer, K = rs_inflight; "
            "one-sided cross-node transport instead (N > 1): one NCCL window of 2*N*A rail "
            "entries + 2*max((L-1)*N*A, R*S_max*b_grad) local entries / rows (Slot-Reuse) + "
            "R*S_max*b_grad send rows, and a phase-2 ring of 2K*round256(S_max*4); the "
            "window also holds the in-place all-gather's arena (any L): the unsharded bytes "
            "(each parameter round256(W*s_p*b_ag)) of the ag_in_place_groups largest groups"
        ),
        "gradients": "sum_g S_g*b_red",
        "params_optimizer": "sum_g S_g*b_master*3",
    },
    "tide_ag": {
        "ag": "as tide without Slot-Reuse: 2 * slot(N*A) (copy engine, L > 1; else 0)",
        "rs": "as fsdp2: 2 * max_g W*S_g*b_red, transient",
        "gradients": "sum_g S_g*b_red",
        "params_optimizer": "sum_g S_g*b_master*3",
    },
}


@dataclass(frozen=True)
class GroupShape:
    """One FSDP group: the full (unsharded) shapes of its parameters.

    ``reshard_after_forward`` is FSDP's flag for the group (False: gathered once per
    step, kept unsharded from forward to backward); the step simulator counts
    all-gathers with it, the memory plan does not need it.
    """

    name: str
    param_shapes: tuple[tuple[int, ...], ...]
    reshard_after_forward: bool = True

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes)


@dataclass(frozen=True)
class CommDtypes:
    """Element sizes in bytes: all-gather (param), unsharded gradient, reduce, master."""

    param_bytes: int = 2
    reduce_bytes: int = 4
    grad_bytes: int | None = None  # None: same as param_bytes
    master_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("param_bytes", "reduce_bytes", "grad_bytes", "master_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"CommDtypes.{name} = {value!r} must be a positive integer")

    @property
    def grad(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes


@dataclass(frozen=True)
class ModePlan:
    """Bytes per rank one comm mode needs.

    ``ag_bytes`` / ``rs_bytes``: peak all-gather / reduce-scatter buffer bytes (for
    TIDE-RS only what it adds on top of the AG slots). ``gradient_bytes``: sharded
    gradients. ``params_optimizer_bytes``: sharded master params + AdamW states.
    ``residency``: "transient" (caching-allocator blocks taken and freed per
    collective), "persistent" (held for the whole run: symmetric memory) or
    "AG persistent, RS transient". ``parts`` names every term that was added up, except
    fsdp2's and symm_mem's ``ag_outputs_in_flight`` (shown beside them, not summed: the flat
    AG buffers plus the unsharded parameters of the groups in flight, what TIDE's in-place
    arena is compared with).
    """

    mode: str
    ag_bytes: int
    rs_bytes: int
    gradient_bytes: int
    params_optimizer_bytes: int
    residency: str
    parts: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def comm_buffer_bytes(self) -> int:
        return self.ag_bytes + self.rs_bytes

    @property
    def total_bytes(self) -> int:
        """Comm buffers + gradients + params and optimizer states."""
        return self.comm_buffer_bytes + self.gradient_bytes + self.params_optimizer_bytes

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "ag_bytes": self.ag_bytes,
            "rs_bytes": self.rs_bytes,
            "comm_buffer_bytes": self.comm_buffer_bytes,
            "gradient_bytes": self.gradient_bytes,
            "params_optimizer_bytes": self.params_optimizer_bytes,
            "total_bytes": self.total_bytes,
            "residency": self.residency,
            "parts": dict(self.parts),
            "formulas": dict(FORMULAS[self.mode]),
            "notes": list(self.notes),
        }


def padded_shard_numel(shape: Sequence[int], world: int) -> int:
    """``ceil(shape[0] / world) * prod(shape[1:])``; a 0-d parameter counts as shape (1,)."""
    if not shape:
        shape = (1,)
    return -(-shape[0] // world) * math.prod(shape[1:])


def group_shard_numel(group: GroupShape, world: int) -> int:
    """``S_g``: padded per-rank shard numel of ``group`` at shard degree ``world``."""
    return sum(padded_shard_numel(shape, world) for shape in group.param_shapes)


def aligned_group_bytes(group: GroupShape, world: int, itemsize: int) -> int:
    """Bytes of ``group``'s per-rank shard packed with each parameter 16-byte aligned."""
    return sum(
        _round_up(padded_shard_numel(shape, world) * itemsize, SLOT_ELEMENT_ALIGN)
        for shape in group.param_shapes
    )


@dataclass(frozen=True)
class SlotSizes:
    """Bytes of ONE slot (of the two) of the copy-engine buffers of one process group,
    before ``slot_alloc_bytes`` rounding. ``rs_slot_bytes`` is 0 when TIDE-RS stages
    in the AG slots (Slot-Reuse: ``ag_slot_bytes`` already covers it) or is off."""

    ag_slot_bytes: int
    rs_slot_bytes: int


def slot_sizes(
    *,
    num_nodes: int,
    local_world_size: int,
    packed_shard_bytes: Sequence[int],
    grad_shard_bytes: Sequence[int],
    reduce_shard_bytes: Sequence[int],
    rs_rows: int,
    tide_rs: bool,
    slot_reuse: bool,
) -> SlotSizes:
    """The one sizing rule of TIDE's copy-engine slots, used by ``install.install``
    (real FSDP groups) and :func:`plan_memory` (shapes). Per FSDP group of one process
    group: ``packed_shard_bytes`` = the rank's shards packed 16-byte aligned (``A_g``),
    ``grad_shard_bytes`` = its shard in the gradient dtype (``S_g * b_grad``),
    ``reduce_shard_bytes`` = in the reduce dtype (``S_g * b_red``).

    AG: ``N * max_g A_g``. RS: ``max_g max(R * S_g * b_grad, S_g * b_red)`` with
    ``R = min(L, rs_rows)``: R rows of gradients, and at least one row of the gradients
    FSDP accumulated in the reduce dtype over steps without sync."""
    ag = num_nodes * max(packed_shard_bytes, default=0)
    rs = rs_staging_bytes(local_world_size, grad_shard_bytes, reduce_shard_bytes, rs_rows)
    if not tide_rs:
        return SlotSizes(ag, 0)
    if slot_reuse:
        return SlotSizes(max(ag, rs), 0)
    return SlotSizes(ag, rs)


def rs_staging_bytes(
    local_world_size: int, grad_shard_bytes: Sequence[int], reduce_shard_bytes: Sequence[int],
    rs_rows: int,
) -> int:  # fmt: skip
    """TIDE-RS staging of one round (copy-engine slot, NCCL window rows): ``R = min(L,
    rs_rows)`` rows of the largest group's gradients, and at least one row of the gradients
    FSDP accumulated in the reduce dtype over steps without sync."""
    rows = min(rs_rows, local_world_size)
    return max(
        (max(rows * g, r) for g, r in zip(grad_shard_bytes, reduce_shard_bytes)), default=0
    )


def slot_alloc_bytes(nbytes: int) -> int:
    """A symmetric slot as ``SymmSlots.create`` allocates it: at least 16 bytes,
    rounded up to 128."""
    return _round_up(max(nbytes, SLOT_ELEMENT_ALIGN), SLOT_ALLOC_ALIGN)


def plan_memory(
    groups: Sequence[GroupShape],
    world: int,
    local_world_size: int,
    dtypes: CommDtypes,
    rs_rows: int = 2,
    rs_inflight: int = 2,
    slot_reuse: bool = True,
    cross_node: str = "p2p",
    ag_in_place_groups: int = 0,
) -> dict[str, ModePlan]:
    """Per-rank buffer bytes of every mode in :data:`MODES` (see the module docstring).

    Args:
        groups: the FSDP groups (empty groups are ignored).
        world: FSDP shard degree ``W``.
        local_world_size: ranks of one node inside the FSDP group ``L``; must divide ``W``.
        dtypes: element sizes.
        rs_rows: TIDE-RS source rows per staging slot (``R = min(L, rs_rows)``).
        rs_inflight: TIDE-RS cross-node fp32 partials in flight ``K``.
        slot_reuse: TIDE-RS stages gradients in the AG slots (only with the copy engine).
        cross_node: TIDE's cross-node transport, ``"p2p"`` (send/recv) or ``"one_sided"``
            (NCCL windows, ``[tide] cross_node_transport``: what ``auto`` takes where
            NCCL has host RMA): more than one node then runs TIDE-AG and TIDE-RS's rows in
            one window (``window_rounds.window_layout``) and TIDE-RS phase 2 in a ring of
            ``2K x round256(S_max x 4)``, persistent, whatever the node count.
        ag_in_place_groups: ``[tide] ag_in_place_groups``: one-sided across nodes (any L),
            the window also holds an arena of that many of the largest groups' unsharded
            parameters (TIDE-AG in place, ``window_arena``).

    Raises:
        ValueError: naming the argument that is out of range.
    """
    layout = WorldLayout(world, local_world_size)  # validates world and local_world_size
    for name, value, least in (("rs_rows", rs_rows, 1), ("rs_inflight", rs_inflight, 1),
                               ("ag_in_place_groups", ag_in_place_groups, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} = {value!r} must be an integer >= {least}")
    if cross_node not in ("p2p", "one_sided"):
        raise ValueError(f"cross_node = {cross_node!r}: choose 'p2p' or 'one_sided'")
    groups = [g for g in groups if g.param_shapes]
    if not groups:
        raise ValueError("plan_memory needs at least one FSDP group with parameters")

    shard = [group_shard_numel(g, world) for g in groups]
    context = {
        "gradient_bytes": sum(shard) * dtypes.reduce_bytes,
        "params_optimizer_bytes": sum(shard) * dtypes.master_bytes * ADAMW_STATES,
    }
    stock_ag = 2 * max(world * s * dtypes.param_bytes for s in shard)
    stock_rs = 2 * max(world * s * dtypes.reduce_bytes for s in shard)
    in_flight = sum(sorted((_unsharded_bytes(g, world, dtypes) for g in groups),
                           reverse=True)[:IN_FLIGHT_GROUPS])  # fmt: skip
    stock_parts = {"ag_flat_buffers": stock_ag, "rs_input_buffers": stock_rs,
                   "ag_outputs_in_flight": stock_ag + in_flight}  # fmt: skip
    pool_note = "same sizes as fsdp2, from the symmetric-memory pool (persistent, cached)"
    tide = _tide_buffers(groups, layout, dtypes, rs_rows, rs_inflight, slot_reuse, cross_node,
                         ag_in_place_groups)  # fmt: skip
    tide_ag = _tide_buffers(
        groups, layout, dtypes, rs_rows, rs_inflight, slot_reuse=False, cross_node=cross_node,
        ag_in_place_groups=ag_in_place_groups,
    )
    ag_note = tide.notes[0]
    return {
        "fsdp2": ModePlan(
            "fsdp2",
            stock_ag,
            stock_rs,
            **context,
            residency="transient",
            parts=stock_parts,
            notes=("caching-allocator blocks, freed per collective",),
        ),
        "symm_mem": ModePlan(
            "symm_mem",
            stock_ag,
            stock_rs,
            **context,
            residency="persistent",
            parts=dict(stock_parts),
            notes=(pool_note,),
        ),
        "tide": ModePlan(
            "tide",
            tide.ag_slots,
            tide.rs_bytes,
            **context,
            residency="persistent",
            parts=tide.parts(),
            notes=tide.notes,
        ),
        "tide_ag": ModePlan(
            "tide_ag",
            tide_ag.ag_slots,
            stock_rs,
            **context,
            residency="AG persistent, RS transient",
            parts={"ag_slots": tide_ag.ag_slots, "rs_input_buffers": stock_rs},
            notes=(ag_note, "RS: FSDP2's reduce-scatter ([tide] reduce_scatter = 'fsdp2')"),
        ),
    }


@dataclass(frozen=True)
class _TideBuffers:
    ag_slots: int
    rs_staging_extra: int
    rs_cross_node_fp32: int
    notes: tuple[str, ...]
    ag_arena: int = 0  # of ag_slots: the in-place all-gather's arena (any N x L across nodes)

    @property
    def rs_bytes(self) -> int:
        return self.rs_staging_extra + self.rs_cross_node_fp32

    def parts(self) -> dict[str, int]:
        parts = {
            "ag_slots": self.ag_slots,
            "rs_staging_extra": self.rs_staging_extra,
            "rs_cross_node_fp32": self.rs_cross_node_fp32,
        }
        if self.ag_arena:  # a share of ag_slots, not a term of its own
            parts["ag_arena"] = self.ag_arena
        return parts


def _tide_buffers(
    groups: Sequence[GroupShape],
    layout: WorldLayout,
    dtypes: CommDtypes,
    rs_rows: int,
    rs_inflight: int,
    slot_reuse: bool,
    cross_node: str = "p2p",
    ag_in_place_groups: int = 0,
) -> _TideBuffers:
    """TIDE-AG slots and TIDE-RS buffers as ``install.install`` sizes them
    (the copy-engine slots through the same :func:`slot_sizes`; the NCCL windows through
    ``window_rounds.window_layout`` and ``ring_layout``, the rules ``install`` uses)."""
    world, local, nodes = layout.world_size, layout.local_world_size, layout.num_nodes
    shard = [group_shard_numel(g, world) for g in groups]
    shard_max = max(shard)
    rows = min(local, rs_rows)
    if local > 1:  # copy engine: symmetric slots

        def sizes(tide_rs: bool) -> SlotSizes:
            return slot_sizes(
                num_nodes=nodes,
                local_world_size=local,
                packed_shard_bytes=[aligned_group_bytes(g, world, dtypes.param_bytes) for g in groups],
                grad_shard_bytes=[s * dtypes.grad for s in shard],
                reduce_shard_bytes=[s * dtypes.reduce_bytes for s in shard],
                rs_rows=rs_rows,
                tide_rs=tide_rs,
                slot_reuse=slot_reuse,
            )

        ag_slots = 2 * slot_alloc_bytes(sizes(tide_rs=False).ag_slot_bytes)
        with_rs = sizes(tide_rs=True)
        notes = ["AG: unsharded parameters written in place; two persistent symmetric slots"]
        if slot_reuse:
            rs_staging = 2 * slot_alloc_bytes(with_rs.ag_slot_bytes) - ag_slots
            notes.append(f"RS: Slot-Reuse, {rows} staging rows share the AG slots")
        else:
            rs_staging = 2 * slot_alloc_bytes(with_rs.rs_slot_bytes)
            notes.append(f"RS: two staging slots of {rows} rows of its own (no Slot-Reuse)")
    else:  # one rank per node: point-to-point straight into storage, one staging buffer
        ag_slots = 0
        rs_staging = rows * shard_max * dtypes.grad  # grown on first use to what a reduce needs
        notes = [
            "AG: one rank per node, point-to-point straight into storage, no slots",
            f"RS: point-to-point staging of {rows} row(s)",
        ]
    one_sided = cross_node == "one_sided" and nodes > 1
    arena = 0
    if one_sided:  # NCCL windows: one window for TIDE-AG and TIDE-RS's rows, a phase-2 ring
        entry = max(aligned_group_bytes(g, world, dtypes.param_bytes) for g in groups)
        rs_area = rs_staging_bytes(local, [s * dtypes.grad for s in shard],
                                   [s * dtypes.reduce_bytes for s in shard], rs_rows)  # fmt: skip
        if ag_in_place_groups:  # as install: fsdp_internals.unsharded_bytes, any L
            arena = arena_bytes((_unsharded_bytes(g, world, dtypes) for g in groups),
                                ag_in_place_groups)  # fmt: skip
        ag_slots = window_layout(nodes, local, entry, 0, slot_reuse, arena).total_bytes
        rs_staging = (window_layout(nodes, local, entry, rs_area, slot_reuse, arena).total_bytes
                      - ag_slots)  # fmt: skip
        cross = ring_layout(rs_inflight, shard_max * 4, wire=False).total_bytes
        notes = [
            f"AG: one NCCL window, 2 x {nodes} rail entries"
            + (f" + 2 x {(local - 1) * nodes} local entries" if local > 1 else ""),
            f"RS: {rows} staging row(s) + send rows in the window"
            + (" (Slot-Reuse over the local entries)" if slot_reuse and local > 1 else ""),
            (f"RS: one-sided ring of {rs_inflight} send + {rs_inflight} receive regions "
             "(constant in the node count)"),
        ]
        if arena:
            notes.insert(1, (
                f"AG in place: ag_arena (in ag_slots) holds the unsharded parameters of the "
                f"{ag_in_place_groups} largest groups, persistent; stock FSDP2 holds the "
                f"same parameters in caching-allocator blocks while a group is unsharded (up "
                f"to {IN_FLIGHT_GROUPS} groups at once under torchtitan's defaults: its "
                "ag_outputs_in_flight, with its flat buffers); [tide] ag_in_place_groups = 0: "
                "no arena, placement copies"))
    else:
        cross = (rs_inflight + 1) * shard_max * 4 if nodes > 1 else 0
        if cross:
            notes.append(f"RS: cross-node fp32 ring of {rs_inflight} partials + 1 receive buffer")
    return _TideBuffers(ag_slots, rs_staging, cross, tuple(notes), arena)


def _unsharded_bytes(group: GroupShape, world: int, dtypes: CommDtypes) -> int:
    """A group's unsharded parameters in the all-gather dtype, every parameter 256-byte
    aligned (``fsdp.internals.unsharded_bytes``: what an in-place range takes)."""
    return sum(aligned(padded_shard_numel(shape, world) * world * dtypes.param_bytes)
               for shape in group.param_shapes)  # fmt: skip


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple



