"""The collective set-up of ``install``: the NCCL windows and the copy-engine slots of the
groups TIDE takes, each step bounded (``base.setup_steps``), owned by a :class:`TideContext`.

- :func:`probe_windows` (before the transports are chosen) and :func:`connect_windows` (once
  they are): per process group whose groups could use NCCL windows or the one-sided phase 2
  of TIDE-RS, the window's sizes from the FSDP groups and ``transports/windows/connect.py``'s
  probe and connect; the ``WindowTransport`` and the phase-2 ring they make. A failure under
  ``auto`` gives the groups their fallback transport; under an explicit option it raises.
- :func:`allocate_slots` (local, agreed before any rendezvous) and :func:`connect_slots`
  (collective over each node's ranks): the symmetric-memory slots of the copy-engine
  groups, sized by ``plans.memory_plan.slot_sizes``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..base.poison import poison_value
from ..base.ranks import group_global_ranks
from ..base.setup_steps import SetupSteps
from ..options import TideOptions
from ..plans import topology, window_arena
from ..plans.memory_plan import rs_staging_bytes, slot_sizes
from ..plans.plan import WorldLayout
from ..plans.window_arena import ARENA_ALIGN, WindowArena
from ..plans.window_rounds import window_layout
from ..transports.copy_engine import SymmSlots
from ..transports.windows import connect as window_setup
from ..transports.windows import storage_swap
from ..transports.windows.ring import OneSidedCrossNode, rs_ring_bytes
from ..transports.windows.transport import InPlace, WindowSlots, WindowTransport
from . import internals as fsdp_internals
from .install_groups import Candidate, build_plans

__all__ = [
    "TideContext", "allocate_slots", "connect_slots", "connect_windows", "probe_windows",
]  # fmt: skip


@dataclass
class TideContext:
    """Everything TIDE set up for one model; :func:`uninstall` drops it."""

    groups: list = field(default_factory=list)  # FSDPParamGroup marked for TIDE
    slots: list = field(default_factory=list)  # SymmSlots
    node_groups: list = field(default_factory=list)  # node-local process groups made here
    rma_comms: list = field(default_factory=list)  # one-sided communicators (windows, ring)
    window_transports: list = field(default_factory=list)  # WindowTransport (in-place owners)
    decisions: list = field(default_factory=list)  # what install logged: path per group, why
    forward_hook: object = None  # RemovableHandle of the bypass check


@dataclass
class _PendingSlots:
    """The copy-engine slots of one (process group, device), allocated, not yet connected."""

    group: dist.ProcessGroup
    device: torch.device
    layout: WorldLayout
    ag_buffer: torch.Tensor
    rs_buffer: torch.Tensor | None


def allocate_slots(cands: list[Candidate], options: TideOptions) -> dict[tuple, _PendingSlots]:
    """This rank's symmetric buffers per (process group, device) of the copy-engine
    candidates, sized by ``memory_plan.slot_sizes`` (local: an out-of-memory here is
    reported by the agreement before any rank starts a rendezvous)."""
    tide_rs = options.reduce_scatter == "tide"
    by_key: dict[tuple[int, torch.device], list[Candidate]] = {}
    for c in cands:
        if c.kind == "copy_engine":
            by_key.setdefault((id(c.group), c.device), []).append(c)
    pending: dict[tuple, _PendingSlots] = {}
    for key, members in by_key.items():
        layout = members[0].layout
        assert layout is not None
        sizes = slot_sizes(
            num_nodes=layout.num_nodes,
            local_world_size=layout.local_world_size,
            packed_shard_bytes=[
                fsdp_internals.shard_bytes(c.pg, "param", align=16) for c in members
            ],
            grad_shard_bytes=[fsdp_internals.shard_bytes(c.pg, "param") for c in members],
            reduce_shard_bytes=[fsdp_internals.shard_bytes(c.pg, "reduce") for c in members],
            rs_rows=options.rs_rows,
            tide_rs=tide_rs,
            slot_reuse=options.slot_reuse,
        )
        rs_buffer = (
            SymmSlots.allocate(sizes.rs_slot_bytes, key[1])
            if tide_rs and not options.slot_reuse
            else None
        )
        pending[key] = _PendingSlots(
            members[0].group, key[1], layout, SymmSlots.allocate(sizes.ag_slot_bytes, key[1]),
            rs_buffer,
        )  # fmt: skip
    return pending


def connect_slots(
    pending: dict[tuple, _PendingSlots],
    options: TideOptions,
    ctx: TideContext,
    decisions: list[str],
    install_seq: int,
) -> tuple[dict, dict]:
    """Collective over each node's ranks, each step bounded by ``[tide]
    install_timeout_s`` (``setup_steps``: a rank that fails tells its node's peers at
    once): the node-local group of each pending key and the rendezvous of its buffers.
    A failure raises here on every rank of the node (the agreement after this turns it
    into one error on every rank of the FSDP groups)."""
    if not pending:
        return {}, {}
    steps = SetupSteps(install_seq, options.install_timeout_s)
    ag_slots: dict = {}
    rs_slots: dict = {}
    for k, (key, p) in enumerate(pending.items()):
        global_ranks = group_global_ranks(p.group)
        node = p.layout.node_of(p.group.rank())
        peers = [global_ranks[r] for r in topology.node_local_group_ranks(p.layout)[node]]
        # unique per node-local peer set: groups of other TP ranks, stages or replicas share k
        scope = f"slots{k}/node{node}/{zlib.crc32(repr(peers).encode()):08x}"
        node_group = steps.run(
            "node-local group", scope, peers,
            lambda p=p, g=global_ranks: _node_local_group(p, g, options.install_timeout_s),
            p.device,
        )  # fmt: skip
        if node_group is not p.group:
            ctx.node_groups.append(node_group)

        def connect(buffer, what: str, p=p, group=node_group, scope=scope, peers=peers):
            def exchange(value: object) -> list:
                return steps.exchange(f"{what} slot details", scope, peers, value)

            def rendezvous() -> SymmSlots:
                return SymmSlots.connect(buffer, group, p.device, options.slot_barrier, exchange)

            return steps.run(
                f"{what} symmetric-memory rendezvous", scope, peers, rendezvous, p.device
            )

        ag_slots[key] = connect(p.ag_buffer, "TIDE-AG")
        ctx.slots.append(ag_slots[key])
        barrier = ag_slots[key].barrier_kind
        decisions.append(
            f"copy-engine slots on {p.device}: 2 x {ag_slots[key].slot_bytes} B, barrier "
            + ("stream flag write/wait (no SM kernel)" if barrier == "copy_engine" else
               f"kernel (option slot_barrier={options.slot_barrier!r}"
               f"{'' if options.slot_barrier == 'kernel' else ': copy-engine barrier unavailable'})")
        )  # fmt: skip
        if p.rs_buffer is not None:
            rs_slots[key] = connect(p.rs_buffer, "TIDE-RS")
            ctx.slots.append(rs_slots[key])
    return ag_slots, rs_slots


def _node_local_group(
    p: _PendingSlots, global_ranks: tuple[int, ...], timeout_s: float
) -> dist.ProcessGroup:
    node_group = topology.make_node_local_group(p.group, p.layout, list(global_ranks), timeout_s)
    if node_group is None:
        raise RuntimeError(
            "the copy engine across nodes needs a node-local process group, and "
            "torch.distributed.new_group could not make one; "
            "set [tide] ag_transport = 'nccl_p2p'"
        )
    return node_group


def _by_key(cands: list[Candidate]) -> dict[tuple, list[Candidate]]:
    """Candidates per (process group, device), in model order."""
    out: dict[tuple, list[Candidate]] = {}
    for c in cands:
        out.setdefault((id(c.group), c.device), []).append(c)
    return out


def _ring_wanted(members: list[Candidate], options: TideOptions) -> bool:
    """TIDE-RS phase 2 could go one-sided for this process group."""
    layout = members[0].layout
    assert layout is not None
    return (
        options.reduce_scatter == "tide"
        and layout.num_nodes > 1
        and options.cross_node_transport != "p2p"
        and any(m.pg._reduce_scatter_process_group is m.group for m in members)
    )


def probe_windows(
    cands: list[Candidate], options: TideOptions, decisions: list[str], install_seq: int
) -> tuple[dict[tuple, window_setup.Probe], SetupSteps | None]:
    """``window_setup.probe`` for every (process group, device) whose groups could use NCCL
    windows or the one-sided phase 2 (collective over each such group, bounded)."""
    probes: dict[tuple, window_setup.Probe] = {}
    steps: SetupSteps | None = None
    for k, (key, members) in enumerate(_by_key(cands).items()):
        c, layout = members[0], members[0].layout
        assert layout is not None
        if options.cross_node_transport == "p2p" and layout.num_nodes > 1:
            decisions.append(f"{c.fqn}: cross-node p2p (option cross_node_transport='p2p')")
        wanted = any(topology.windows_wanted(options, m.layout, m.access) for m in members)
        if not (wanted or _ring_wanted(members, options)):
            if options.cross_node_transport == "nccl_one_sided":  # asked for, nothing to carry
                decisions.append(
                    f"{c.fqn}: [tide] cross_node_transport = 'nccl_one_sided' unused (no "
                    "cross-node traffic of TIDE's here)"
                )
            continue
        shared = bool(topology.SHARED_GPU in c.access[1])
        api, how = window_setup.api_for(c.device, c.backend, shared)
        if api is None and how == window_setup.NOT_NCCL:  # alike on every rank of the group
            probes[key] = window_setup.Probe(None, how)
            continue
        steps = steps or SetupSteps(install_seq, options.install_timeout_s)
        peers = list(group_global_ranks(c.group))
        scope = f"onesided{k}/{zlib.crc32(repr(peers).encode()):08x}"
        probes[key] = window_setup.probe(steps, scope, c.group, c.device, api, how)
    return probes, steps


def _one_sided_refusal(members: list[Candidate], options: TideOptions, why: str) -> None:
    """Raise the named error of an explicit one-sided option that cannot run."""
    c = members[0]
    if options.transport == "nccl_windows" and any(m.kind == "windows" for m in members):
        raise ValueError(
            f"[tide] ag_transport = 'nccl_windows' cannot run for {c.fqn}: {why}; use 'auto'"
        )
    if options.cross_node_transport == "nccl_one_sided":
        raise ValueError(
            f"[tide] cross_node_transport = 'nccl_one_sided' cannot run for {c.fqn}: {why}; "
            "use 'auto' (falls back to send/recv) or 'p2p'"
        )


def _in_place_missing(
    layout, users: list, options: TideOptions, device: torch.device
) -> str | None:
    """Why the windows of this process group place with copies instead of delivering in
    place (None: in place; ``transports/windows/transport.py``)."""
    if not users:
        return "no group on the window"
    if options.ag_in_place_groups == 0:
        return "[tide] ag_in_place_groups = 0"
    if layout.num_nodes < 2:
        return "one node"
    return storage_swap.swap_missing_reason(device, options.ag_storage_swap == "ctypes")


def _swap_taken(device: torch.device, options: TideOptions) -> str:
    """The storage swap TIDE-AG in place runs on, as logged; says so where ``[tide]
    ag_storage_swap = "ctypes"`` was asked for and torch's native swap runs instead."""
    allow_ctypes = options.ag_storage_swap == "ctypes"
    kind, how = storage_swap.swap_backend(device, allow_ctypes)
    if kind == "native" and allow_ctypes:
        how += " ([tide] ag_storage_swap = 'ctypes' not needed: this torch has the native swap)"
    return how


def connect_windows(
    taken: list[Candidate],
    options: TideOptions,
    probes: dict[tuple, window_setup.Probe],
    steps: SetupSteps | None,
    ctx: TideContext,
    decisions: list[str],
    fqns: dict[int, str],
) -> tuple[dict[tuple, WindowTransport], dict[tuple, OneSidedCrossNode]]:
    """The windows of every probed process group (``window_setup.connect``): TIDE-AG and
    TIDE-RS phase 1 for its ``windows`` groups, the phase-2 ring where TIDE-RS crosses
    nodes. Collective over each group, bounded. A failure (probe or set-up, on any rank)
    under ``auto`` gives every group of the process group its fallback transport and
    phase 2 send/recv, logged with the reason; under an explicit option it raises
    ``ValueError`` naming it."""
    windows: dict[tuple, WindowTransport] = {}
    rings: dict[tuple, OneSidedCrossNode] = {}
    tide_rs = options.reduce_scatter == "tide"
    wire = options.rs_wire_dtype != "float32"
    by_key = _by_key(taken)
    for key, found in probes.items():
        if key not in by_key:  # probed, then no group of it took TIDE: nothing to set up
            found.abort()
    for k, (key, members) in enumerate(by_key.items()):
        found = probes.get(key)
        if found is None:
            continue
        c, layout = members[0], members[0].layout
        assert layout is not None
        users = [m for m in members if m.kind == "windows"]
        ring_wanted = _ring_wanted(members, options)
        reduce_numel = max(
            sum(fp._sharded_param_data.numel() for fp in m.pg.fsdp_params) for m in members
        )
        why = found.reason
        slots_bytes = ring_bytes = arena_bytes = 0
        wl = None
        in_place_why = _in_place_missing(layout, users, options, c.device)
        peers = list(group_global_ranks(c.group))
        scope = f"windows{k}/{zlib.crc32(repr(peers).encode()):08x}"
        if why is None and users:  # one decision for the group: it sizes every rank's window
            assert steps is not None
            in_place_why = window_setup.agree(steps, scope, c.group, c.device,
                                              "TIDE-AG in place", in_place_why)  # fmt: skip
        if in_place_why is None:
            arena_bytes = window_arena.arena_bytes(
                (fsdp_internals.unsharded_bytes(m.pg, layout.world_size, ARENA_ALIGN)
                 for m in users), options.ag_in_place_groups,
            )  # fmt: skip
        if why is None:
            if users:
                wl = window_layout(
                    layout.num_nodes, layout.local_world_size,
                    max(fsdp_internals.shard_bytes(m.pg, "param", align=16) for m in users),
                    rs_staging_bytes(
                        layout.local_world_size,
                        [fsdp_internals.shard_bytes(m.pg, "param") for m in users],
                        [fsdp_internals.shard_bytes(m.pg, "reduce") for m in users],
                        options.rs_rows,
                    ) if tide_rs else 0,
                    options.slot_reuse,
                    arena_bytes,
                )  # fmt: skip
                slots_bytes = wl.total_bytes
            if ring_wanted:
                ring_bytes = rs_ring_bytes(options.rs_inflight, 4 * reduce_numel, wire)
            assert steps is not None
            slots_window, ring, why = window_setup.connect(
                steps, scope, c.group, c.device, found, slots_bytes, ring_bytes,
                ag_credit=bool(arena_bytes),
            )
        if why is not None:  # probe and connect aborted what they made
            if users or ring_wanted:
                _one_sided_refusal(members, options, why)
            for m in users:  # auto: what it takes without windows
                m.kind, m.why = m.fallback, f"{m.fallback_why}; NCCL windows: {why}"
            if users:
                build_plans(users, None, fqns, options.pacing)
            if ring_wanted or layout.num_nodes > 1:
                decisions.append(f"{c.fqn}: cross-node p2p (auto: {why})")
            continue
        ctx.rma_comms.extend(found.made)
        name = c.group.group_name
        if slots_window is not None:
            slots = WindowSlots(found.slots_comm, slots_window, wl, name,
                                tuple(group_global_ranks(c.group)))  # fmt: skip
            in_place = None
            if arena_bytes:
                in_place = InPlace(WindowArena(wl.arena_base, wl.arena_bytes),
                                   found.ag_credit_comm)  # fmt: skip
                if poison_value() is not None:  # tests: a range never written reads NaN
                    slots_window.tensor.narrow(0, wl.arena_base, wl.arena_bytes).fill_(0xFF)
                    if c.device.type == "cuda":
                        torch.cuda.synchronize(c.device)
            windows[key] = WindowTransport(slots, options.pacing, in_place)
            ctx.window_transports.append(windows[key])
        if ring is not None:
            rings[key] = OneSidedCrossNode(
                ring[0], ring[1], ring[2], layout, c.group.rank(), options.rs_inflight,
                4 * reduce_numel, wire, name,
            )  # fmt: skip
        parts = ([f"window {slots_bytes} B (TIDE-AG, TIDE-RS rows)"] if slots_window else []) + (
            [(f"TIDE-AG in place: arena {arena_bytes} B for {options.ag_in_place_groups} "
              f"groups, storage swap: {_swap_taken(c.device, options)}")]
            if slots_window and arena_bytes else
            [f"TIDE-AG placement copies: {in_place_why}"] if slots_window else []) + (
            [f"phase-2 ring {ring_bytes} B ({options.rs_inflight} regions)"] if ring else [])
        if ring is not None or (slots_window is not None and layout.num_nodes > 1):
            decisions.append(
                f"{c.fqn}: cross-node nccl_one_sided ("
                f"{'auto: ' if options.cross_node_transport == 'auto' else ''}"
                f"{found.api.version()} with host RMA; {', '.join(parts)})"
            )
        elif slots_window is not None:
            decisions.append(f"{c.fqn}: NCCL windows ({found.api.version()}; {', '.join(parts)})")
    return windows, rings
