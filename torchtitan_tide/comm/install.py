"""``comm.apply(mode="tide")``: which FSDP groups TIDE takes, with what, agreed by all ranks.

:func:`install` is collective over each FSDP process group of the groups TIDE may take,
and atomic: local selection first (no collective), then one ``all_gather_object`` of every
rank's :class:`~.topology.RankInfo` per process group, local planning, an agreement
(every rank's error and transport proposal), the collective set-up (node-local groups,
symmetric slots), and a second agreement. A failure on any rank raises on every rank of
its groups with that rank's message, and frees what was set up. Nothing collective runs
when no group can use TIDE. The state of one model (slots, node-local groups, the bypass
hook) is owned by its :class:`TideContext`, dropped by :func:`uninstall`; the groups
are marked for the wrappers with ``fsdp_patch.mark``. Decisions:
docs/design/2026-12-01-cluster-layouts.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import fsdp_internals, fsdp_patch, kernels, topology, window_arena, window_setup
from .all_gather import TideGroupState
from .fsdp_internals import fsdp_param_groups
from .memory_plan import rs_staging_bytes, slot_sizes
from .options import TideOptions
from .plan import ParamSpec, WorldLayout, build_group_plan
from .poison import poison_value
from .reduce_scatter import WIRE_DTYPES, RSBuffers, TideRSState, wire_label
from .setup_steps import SetupSteps
from .transport import (
    AllGatherTransport,
    CrossNodeTransport,
    ReduceScatterTransport,
    clear_global_ranks,
    group_global_ranks,
    storage_swap,
)
from .transport.copy_engine import CopyEngineTransport, SymmSlots
from .transport.one_sided import OneSidedCrossNode, rs_ring_bytes
from .transport.p2p import P2PCrossNode, P2PTransport
from .transport.windows import InPlace, WindowSlots, WindowTransport
from .window_arena import ARENA_ALIGN, WindowArena
from .window_rounds import window_layout

__all__ = [
    "TideConfigError", "TideContext", "TideInstallError", "context", "install", "uninstall",
]  # fmt: skip

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_tide_ag_installed"
_installs = itertools.count()  # names install's set-up keys in the store (setup_steps)


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


class TideInstallError(RuntimeError):
    """comm.apply(mode='tide') failed on some rank; raised on every rank of its groups
    (as ``TideConfigError``, a ``ValueError``, when every failure was a bad option)."""


class TideConfigError(TideInstallError, ValueError):
    pass


@dataclass
class _Candidate:
    """One FSDP param group TIDE may take, with what install decided for it."""

    fqn: str
    pg: object  # FSDPParamGroup
    group: dist.ProcessGroup
    device: torch.device
    root: str
    kind: str | None = None  # "windows" | "copy_engine" | "p2p" | None (FSDP2's path)
    why: str = ""
    plan: object = None  # GroupPlan
    layout: WorldLayout | None = None
    access: tuple[bool, str] = (False, "")  # topology.local_peer_access
    backend: str = ""
    fallback: str | None = None  # the kind ``auto`` takes if the windows fail
    fallback_why: str = ""


@contextlib.contextmanager
def _control_plane():
    """Install's own collectives run outside any dispatch mode or functorch
    transform the caller may be in (they are control plane, not model math)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisableFuncTorch():
        yield


def _distinct_groups(cands: list[_Candidate]) -> list[tuple[dist.ProcessGroup, torch.device]]:
    """Each process group once, in model order (the same order on every rank)."""
    seen: dict[int, tuple[dist.ProcessGroup, torch.device]] = {}
    for c in cands:
        seen.setdefault(id(c.group), (c.group, c.device))
    return list(seen.values())


def _agree(
    groups: list[tuple[dist.ProcessGroup, torch.device]], what: str, payload: dict
) -> dict[int, list[dict]]:
    """One ``all_gather_object`` per process group of ``payload`` (which carries this
    rank's ``"error"``, or None). Raises :class:`TideInstallError` on every rank when
    any rank of any of this rank's groups reported an error; else returns every
    rank's payload per ``id(group)``."""
    gathered: dict[int, list[dict]] = {}
    failures: dict[int, tuple[str, bool]] = {}
    for group, _ in groups:
        out: list[dict | None] = [None] * group.size()
        dist.all_gather_object(out, payload, group=group)
        gathered[id(group)] = out  # type: ignore[assignment]
        for item in out:
            if item is not None and item.get("error"):
                failures[item["rank"]] = item["error"]
    if failures:
        by_message: dict[str, list[int]] = {}
        for r, (msg, _) in sorted(failures.items()):
            by_message.setdefault(msg, []).append(r)
        lines = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
            for msg, rs in by_message.items()
        )
        config = all(is_config for _, is_config in failures.values())
        cls = TideConfigError if config else TideInstallError
        raise cls(f"comm.apply(mode='tide') failed during {what} on {lines}")
    return gathered


def _error_text(e: BaseException) -> tuple[str, bool]:
    """(message, whether it is a bad option: ``ValueError``) of a failure to report."""
    return f"{type(e).__name__}: {e}", isinstance(e, ValueError)


def _select(model: nn.Module, decisions: list[str]) -> list[_Candidate]:
    """The groups TIDE may take (no collectives); the others' reasons go to ``decisions``."""
    roots = fsdp_internals.group_root_fqns(model)
    cands: list[_Candidate] = []
    for fqn, pg in fsdp_param_groups(model):
        group = fsdp_internals.shard_group(pg)
        device = pg.device
        if group is None:
            decisions.append(f"{fqn}: FSDP2 path (replicate-only mesh: nothing to all-gather)")
        elif group.size() == 1:
            decisions.append(f"{fqn}: FSDP2 path (group of 1 rank: FSDP2 skips the all-gather)")
        elif device.type not in ("cuda", "cpu"):
            decisions.append(f"{fqn}: FSDP2 path (device {device.type} not supported)")
        elif (reason := fsdp_internals.custom_comm_reason(pg)) is not None:
            decisions.append(f"{fqn}: FSDP2 path ({reason} set on this group)")
        else:
            cands.append(_Candidate(fqn, pg, group, device, roots.get(id(pg), "<root>")))
    return cands


def _layouts(
    cands: list[_Candidate],
    options: TideOptions,
    infos: dict[int, list[topology.RankInfo]],
) -> None:
    """Per candidate: layout, CUDA P2P to its local peers, backend (local only)."""
    for c in cands:
        rank_infos = infos[id(c.group)]
        lws, lws_source = topology.resolve_local_world_size(options, topology.node_keys(rank_infos))
        layout = WorldLayout(c.group.size(), lws)
        c.access = (
            topology.local_peer_access(rank_infos, layout, c.group.rank())
            if c.device.type == "cuda" and lws > 1
            else (False, "not CUDA" if c.device.type != "cuda" else "no node-local peers")
        )
        c.backend = str(dist.get_backend(c.group))
        c.layout = layout
        c.why = f"{layout.shape} ({lws_source})"


def _choose(cands: list[_Candidate], options: TideOptions, probes: dict) -> None:
    """Per candidate: this rank's transport proposal, given what the one-sided probe of its
    process group found (``probes``, agreed by every rank of the group)."""
    for c in cands:
        assert c.layout is not None
        found = probes.get((id(c.group), c.device))
        windows = (
            (False, "") if found is None or found.api is None
            else (True, found.api.version()) if found.capable else (False, found.reason)
        )  # fmt: skip
        kind, why, fallback = topology.choose_transport(
            options, c.layout, c.device, c.backend, c.access, windows
        )
        c.kind, c.fallback = kind, fallback
        c.why = f"{why}; {c.why}"
        if fallback is not None:
            _, c.fallback_why, _ = topology.choose_transport(
                options, c.layout, c.device, c.backend, c.access, (False, "set-up failed")
            )


def _settle_transports(cands: list[_Candidate], gathered: dict[int, list[dict]]) -> None:
    """Every rank of a group takes the same transport: the copy engine only where
    every rank proposed it, else point-to-point where every rank can, else FSDP2's
    path (the reason names the ranks that differ)."""
    for i, c in enumerate(cands):
        kinds = [item["kinds"][i] for item in gathered[id(c.group)]]
        if len(set(kinds)) == 1:
            continue
        differ = sorted(r for r, k in enumerate(kinds) if k != c.kind)
        c.kind = None if None in kinds else "p2p"
        c.why = (
            f"ranks disagree ({dict(enumerate(kinds))}; group ranks {differ} differ from this "
            f"rank): {'point-to-point' if c.kind else 'FSDP2 path'} on every rank"
        )


def _build_plans(
    cands: list[_Candidate], decisions: list[str] | None, fqns: dict[int, str], pacing: int
) -> list[_Candidate]:
    """Plan every candidate with a transport (local); ``fqns``: parameter names;
    ``pacing``: the most point-to-point chunks per wave (``TideOptions.pacing``);
    ``decisions`` None: plan only (the log lines come once the transports are final)."""
    taken = []
    for c in cands:
        if c.kind is None:
            if decisions is not None:
                decisions.append(f"{c.fqn}: FSDP2 path ({c.why})")
            continue
        specs = [
            ParamSpec(
                fqn=fsdp_internals.param_fqn(fp, fqns),
                shard_numel=fp._sharded_param_data.numel(),
                dtype=str(fsdp_internals.ag_dtype(fp, c.pg)),
                unsupported=fsdp_internals.unsupported_param_reason(fp),
            )
            for fp in c.pg.fsdp_params
        ]
        assert c.layout is not None
        c.plan = build_group_plan(
            specs, c.layout, c.group.rank(), pull_local=c.kind in ("copy_engine", "windows"),
            pacing=pacing,
        )
        if not c.plan.uses_tide:
            if decisions is not None:
                decisions.append(f"{c.fqn}: FSDP2 path ({c.plan.fallback_reason})")
            continue
        taken.append(c)
    return taken


def _log_transports(taken: list[_Candidate], decisions: list[str]) -> None:
    for c in taken:
        decisions.append(
            f"{c.fqn}: transport={c.kind} ({c.why}); {len(c.plan.params)} params, "
            f"dtypes {list(c.plan.dtypes)}"
        )


@dataclass
class _PendingSlots:
    """The copy-engine slots of one (process group, device), allocated, not yet connected."""

    group: dist.ProcessGroup
    device: torch.device
    layout: WorldLayout
    ag_buffer: torch.Tensor
    rs_buffer: torch.Tensor | None


def _allocate_slots(cands: list[_Candidate], options: TideOptions) -> dict[tuple, _PendingSlots]:
    """This rank's symmetric buffers per (process group, device) of the copy-engine
    candidates, sized by ``memory_plan.slot_sizes`` (local: an out-of-memory here is
    reported by the agreement before any rank starts a rendezvous)."""
    tide_rs = options.reduce_scatter == "tide"
    by_key: dict[tuple[int, torch.device], list[_Candidate]] = {}
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


def _connect_slots(
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


def _by_key(cands: list[_Candidate]) -> dict[tuple, list[_Candidate]]:
    """Candidates per (process group, device), in model order."""
    out: dict[tuple, list[_Candidate]] = {}
    for c in cands:
        out.setdefault((id(c.group), c.device), []).append(c)
    return out


def _ring_wanted(members: list[_Candidate], options: TideOptions) -> bool:
    """TIDE-RS phase 2 could go one-sided for this process group."""
    layout = members[0].layout
    assert layout is not None
    return (
        options.reduce_scatter == "tide"
        and layout.num_nodes > 1
        and options.cross_node_transport != "p2p"
        and any(m.pg._reduce_scatter_process_group is m.group for m in members)
    )


def _probe_windows(
    cands: list[_Candidate], options: TideOptions, decisions: list[str], install_seq: int
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


def _one_sided_refusal(members: list[_Candidate], options: TideOptions, why: str) -> None:
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
    place (None: in place; ``transport/windows.py``)."""
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


def _connect_windows(
    taken: list[_Candidate],
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
                _build_plans(users, None, fqns, options.pacing)
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


def _mark_groups(
    cands: list[_Candidate],
    options: TideOptions,
    ag_slots: dict,
    rs_slots: dict,
    windows: dict[tuple, WindowTransport],
    rings: dict[tuple, OneSidedCrossNode],
    ctx: TideContext,
    decisions: list[str],
) -> None:
    """Attach TIDE-AG/RS state to every taken group (local; no collective)."""
    tide_rs = options.reduce_scatter == "tide"
    multi_root = len({c.root for c in cands}) > 1
    p2p_by_key: dict[tuple[int, torch.device], P2PTransport] = {}
    buffers_by_key: dict[tuple[int, torch.device], RSBuffers] = {}
    p2p_cross_by_key: dict[tuple[int, torch.device], P2PCrossNode] = {}
    for c in cands:
        key = (id(c.group), c.device)
        ring = rings.get(key)
        transport: AllGatherTransport
        if key not in p2p_by_key and c.kind == "p2p":
            p2p_by_key[key] = P2PTransport(
                "nccl_p2p" if c.device.type == "cuda" else "gloo", c.device
            )
        if c.kind == "copy_engine":
            transport = CopyEngineTransport(ag_slots[key])
        elif c.kind == "windows":
            transport = windows[key]
        else:
            transport = p2p_by_key[key]
        ag_comm = getattr(c.pg, "_all_gather_comm", None)
        ag_state = TideGroupState(c.plan, transport, c.group, c.fqn, ag_comm)
        ctx.groups.append(c.pg)
        if not tide_rs or c.pg._reduce_scatter_process_group is not c.group:
            fsdp_patch.mark(c.pg, ag_state, None)
            why = (
                "option reduce_scatter='fsdp2'"
                if not tide_rs
                else "all-gather and RS groups differ"
            )
            decisions.append(f"{c.fqn}: reduce-scatter FSDP2 ({why})")
            continue
        shared = c.kind in ("copy_engine", "windows") and options.slot_reuse
        rs_transport: ReduceScatterTransport = (
            CopyEngineTransport(rs_slots[key]) if key in rs_slots
            else p2p_by_key[key] if c.kind == "p2p"
            else transport
        )  # fmt: skip
        buffers = buffers_by_key.setdefault(
            key, RSBuffers(options.rs_inflight, WIRE_DTYPES[options.rs_wire_dtype])
        )
        if ring is not None and not buffers.partials:
            # the partial ring lives in the registered window: puts read it in place
            buffers.partials = ring.send_slots(ring.region_bytes // 4)
            buffers.partial_free = [None] * len(buffers.partials)
            buffers.partials_fixed = True
            if buffers.wire_dtype != torch.float32:  # partials rounded for the wire: put too
                buffers.send = ring.wire_slot(buffers.wire_dtype)
        layout = c.plan.layout
        cross_node: CrossNodeTransport | None = ring
        if layout.num_nodes > 1 and cross_node is None:
            if key not in p2p_cross_by_key:
                p2p_cross_by_key[key] = P2PCrossNode(c.device)
            cross_node = p2p_cross_by_key[key]
        # Several FSDP roots have one reduce-scatter stream each; staging shared by
        # the groups of a process group is only safe on one stream: TIDE's. The windows'
        # rounds (all-gathers and TIDE-RS rounds) are one protocol: always TIDE's stream.
        on_tide_stream = shared or c.kind == "windows" or (
            multi_root and c.device.type == "cuda")  # fmt: skip
        fsdp_patch.mark(
            c.pg,
            ag_state,
            TideRSState(
                layout=layout,
                rank=c.plan.rank,
                group=c.group,
                fqn=c.fqn,
                transport=rs_transport,
                buffers=buffers,
                rows=options.rs_rows,
                ctas=options.rs_ctas,
                use_tide_stream=on_tide_stream,
                fsdp_comm=getattr(c.pg, "_reduce_scatter_comm", None),
                cross_node=cross_node,
                param_fqns=tuple(p.fqn for p in c.plan.params),
            ),
        )
        wire = wire_label(buffers.wire_dtype)
        cross = (
            "" if layout.num_nodes == 1
            else f"; cross-node nccl_one_sided, {options.rs_inflight} partials in flight, {wire}"
            if ring is not None
            else f"; cross-node p2p over {str(dist.get_backend(c.group)).lower()}, "
            f"{options.rs_inflight} partials in flight, {wire}"
        )  # fmt: skip
        accumulate = (
            f"{kernels.triton_status()}, {options.rs_ctas} CTAs"
            if c.device.type == "cuda"
            else "torch"
        )
        stream_note = (
            " (staging in the TIDE-AG slots: Slot-Reuse)" if shared
            else " (on TIDE's stream: the window's rounds are one protocol)"
            if c.kind == "windows"
            else " (several FSDP roots: on TIDE's stream)" if on_tide_stream else ""
        )  # fmt: skip
        decisions.append(
            f"{c.fqn}: TIDE-RS node-local {c.kind}{stream_note}, "
            f"{min(options.rs_rows, layout.local_world_size)} rows per round{cross}; "
            f"accumulate {accumulate}"
        )


def install(model: nn.Module, options: TideOptions) -> None:
    """Mark every FSDP param group of ``model`` that can use TIDE for TIDE-AG (and
    TIDE-RS) and install the wrappers. Collective over each FSDP process group of
    the groups TIDE may take (none when it can take none): call on all ranks, in
    the same order. Raises on every rank of a group when any of its ranks fails."""
    install_seq = next(_installs)
    if getattr(model, _MODEL_ATTR, None) is not None:
        raise ValueError(
            "comm.apply(mode='tide') was already called on this model; call remove first"
        )
    decisions: list[str] = []
    if not fsdp_param_groups(model):
        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                "comm.apply(mode='tide') found no FSDP2 module in the model: shard it with "
                "torch.distributed.fsdp.fully_shard first"
            )
        logger.info(
            "TIDE: the model's %d FSDP module(s) manage no parameters; nothing to install",
            fsdp_internals.fsdp_modules_without_groups(model),
        )
        setattr(model, _MODEL_ATTR, TideContext())
        return
    cands = _select(model, decisions)
    ctx = TideContext()
    if not cands:  # nothing collective when TIDE takes nothing
        _log_decisions(decisions, None)
        logger.warning("TIDE: no FSDP group of this model can use TIDE; all take FSDP2's path")
        setattr(model, _MODEL_ATTR, ctx)
        return
    groups = _distinct_groups(cands)
    me = dist.get_rank()
    with _control_plane():
        info, error = None, None
        try:
            info = topology.local_rank_info(cands[0].device)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        gathered = _agree(groups, "topology", {"rank": me, "error": error, "info": info})
        infos = {gid: [item["info"] for item in items] for gid, items in gathered.items()}
        error = None
        try:
            _layouts(cands, options, infos)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        _agree(groups, "layout", {"rank": me, "error": error})
        # Whether NCCL windows can run, per process group (collective, bounded, soft).
        error, probes, steps = None, {}, None
        try:
            probes, steps = _probe_windows(cands, options, decisions, install_seq)
            _choose(cands, options, probes)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        try:
            gathered = _agree(
                groups, "planning", {"rank": me, "error": error, "kinds": [c.kind for c in cands]}
            )
        except TideInstallError:
            for found in probes.values():
                found.abort()
            raise
        _settle_transports(cands, gathered)
        # Windows (collective, soft: a failure falls back under auto), then the local work
        # that can fail alone (plans, symmetric buffers) before any rendezvous.
        error, taken, pending, windows, rings = None, [], {}, {}, {}
        fqns = fsdp_internals.param_fqns(model)
        try:
            taken = _build_plans(cands, decisions, fqns, options.pacing)
            windows, rings = _connect_windows(taken, options, probes, steps, ctx, decisions, fqns)
            _log_transports(taken, decisions)
            pending = _allocate_slots(taken, options)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
            for found in probes.values():
                found.abort()
        try:
            _agree(groups, "allocation", {"rank": me, "error": error})
        except TideInstallError:
            _drop(ctx)
            raise
        error = None
        try:
            ag_slots, rs_slots = _connect_slots(pending, options, ctx, decisions, install_seq)
            _mark_groups(taken, options, ag_slots, rs_slots, windows, rings, ctx, decisions)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        try:
            gathered = _agree(groups, "set-up", {"rank": me, "error": error, "log": decisions})
        except TideInstallError:
            _drop(ctx)
            if fsdp_patch.installed_refcount() == 0:
                clear_global_ranks()  # nothing of this install stays cached
            raise
    _log_decisions(decisions, gathered[id(groups[0][0])][0]["log"])
    ctx.decisions = decisions
    setattr(model, _MODEL_ATTR, ctx)
    if ctx.groups:
        fsdp_patch.acquire()
        ctx.forward_hook = model.register_forward_pre_hook(fsdp_patch.check_not_bypassed)
    else:
        logger.warning("TIDE: no FSDP group of this model can use TIDE; all take FSDP2's path")


def _log_decisions(decisions: list[str], reference: list[str] | None) -> None:
    """Global rank 0 logs its decisions; other ranks log (rank-tagged) only the
    ones that differ from ``reference`` (the first group's rank 0 decisions,
    gathered by install's agreement: no collective of its own), or, when nothing
    was gathered (no group taken), at debug level."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        for d in decisions:
            logger.info("TIDE group %s", d)
        return
    if reference is None:  # nothing was gathered: rank 0 said it; here for debugging only
        for d in decisions:
            logger.debug("TIDE group [rank %d] %s", rank, d)
        return
    for i, d in enumerate(decisions):
        if i >= len(reference) or reference[i] != d:
            logger.info("TIDE group [rank %d] %s", rank, d)


def _drop(ctx: TideContext, abort_rma: bool = True) -> None:
    """Unmark the context's groups and free its slots, node-local groups and one-sided
    communicators (local; the caller synchronized what peers may still read; with
    ``abort_rma=False`` the communicators are finalized, collective over their ranks)."""
    for pg in ctx.groups:
        fsdp_patch.unmark(pg)
    for transport in ctx.window_transports:  # parameters still in a window get their own
        transport.detach_all()
    ctx.window_transports.clear()
    ctx.slots.clear()  # symmetric buffers are freed with their last reference
    for node_group in ctx.node_groups:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(node_group)
    ctx.node_groups.clear()
    for comm in ctx.rma_comms:  # a failed set-up or after the devices synchronized
        with contextlib.suppress(Exception):
            comm.abort() if abort_rma else comm.destroy()
    ctx.rma_comms.clear()


def context(model: nn.Module) -> TideContext | None:
    """What :func:`install` set up for ``model`` (its ``decisions``: the path of every group
    and why, as logged), or None when TIDE is not installed on it."""
    return getattr(model, _MODEL_ATTR, None)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` for ``model``; FSDP2's stock path is used again.
    Call it on all ranks between steps (never while an all-gather is pending):
    with the copy engine it is collective, since peers may still be pulling
    from this rank's symmetric buffer until everyone synchronizes."""
    ctx: TideContext | None = getattr(model, _MODEL_ATTR, None)
    if ctx is None:
        return
    for slots in ctx.slots:
        device = slots.buffer.device
        torch.cuda.synchronize(device)  # own pulls and packs done
        slots.handle.barrier(channel=0)  # every local peer got here too
        torch.cuda.synchronize(device)
    for comm in ctx.rma_comms:  # every put into or from this rank's windows is done
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
    _drop(ctx, abort_rma=False)
    if ctx.forward_hook is not None:
        ctx.forward_hook.remove()
    delattr(model, _MODEL_ATTR)
    if ctx.groups:
        fsdp_patch.release()
