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
docs/2026-12-01-cluster-layouts.md.
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

from . import fsdp_internals, fsdp_patch, kernels, topology
from .all_gather import TideGroupState
from .fsdp_internals import fsdp_param_groups
from .memory_plan import slot_sizes
from .options import TideOptions
from .plan import ParamSpec, WorldLayout, build_group_plan
from .reduce_scatter import WIRE_DTYPES, RSBuffers, TideRSState, wire_label
from .setup_steps import SetupSteps
from .transport import (
    AllGatherTransport,
    CrossNodeTransport,
    ReduceScatterTransport,
    clear_global_ranks,
    group_global_ranks,
    nccl_rma,
)
from .transport.copy_engine import CopyEngineTransport, SymmSlots
from .transport.one_sided import (
    OneSidedAllGather,
    OneSidedCrossNode,
    ag_window_bytes,
    rs_window_bytes,
)
from .transport.p2p import P2PCrossNode, P2PTransport

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
    rma_comms: list = field(default_factory=list)  # nccl_rma.RmaComm of the one-sided path
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
    kind: str | None = None  # "copy_engine" | "p2p" | None (FSDP2's path)
    why: str = ""
    plan: object = None  # GroupPlan
    layout: WorldLayout | None = None


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


def _decide(
    cands: list[_Candidate],
    options: TideOptions,
    infos: dict[int, list[topology.RankInfo]],
) -> None:
    """Per candidate: layout, this rank's transport proposal, plan (local only)."""
    for c in cands:
        rank_infos = infos[id(c.group)]
        lws, lws_source = topology.resolve_local_world_size(options, topology.node_keys(rank_infos))
        layout = WorldLayout(c.group.size(), lws)
        rank = c.group.rank()
        access = (
            topology.local_peer_access(rank_infos, layout, rank)
            if c.device.type == "cuda" and lws > 1
            else (False, "not CUDA" if c.device.type != "cuda" else "no node-local peers")
        )
        backend = str(dist.get_backend(c.group))
        c.kind, c.why = topology.choose_transport(options, layout, c.device, backend, access)
        c.layout = layout
        c.why += f"; {layout.shape} ({lws_source})"


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
    cands: list[_Candidate], decisions: list[str], fqns: dict[int, str], pacing: int
) -> list[_Candidate]:
    """Plan every candidate with a transport (local); ``fqns``: parameter names;
    ``pacing``: the most point-to-point chunks per wave (``TideOptions.pacing``)."""
    taken = []
    for c in cands:
        if c.kind is None:
            decisions.append(f"{c.fqn}: FSDP2 path ({c.why})")
            continue
        specs = [
            ParamSpec(
                fqn=fsdp_internals.param_fqn(fp, fqns),
                shard_numel=fp._sharded_param_data.numel(),
                dtype=str(fsdp_internals.ag_dtype(fp, c.pg.mp_policy)),
                unsupported=fsdp_internals.unsupported_param_reason(fp),
            )
            for fp in c.pg.fsdp_params
        ]
        assert c.layout is not None
        c.plan = build_group_plan(
            specs, c.layout, c.group.rank(), pull_local=c.kind == "copy_engine",
            pacing=pacing,
        )
        if not c.plan.uses_tide:
            decisions.append(f"{c.fqn}: FSDP2 path ({c.plan.fallback_reason})")
            continue
        decisions.append(
            f"{c.fqn}: transport={c.kind} ({c.why}); {len(c.plan.params)} params, "
            f"dtypes {list(c.plan.dtypes)}"
        )
        taken.append(c)
    return taken


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


@dataclass
class _OneSided:
    """The one-sided transports of one (process group, device); None where not used."""

    ag: OneSidedAllGather | None = None
    rs: OneSidedCrossNode | None = None


_NOT_NCCL = "needs CUDA parameters and an NCCL process group"


def _agree_to_try(
    soft: _SoftSteps, failure: str | None, is_first: bool, sides: int
) -> tuple[list[bytes], str | None]:
    """One exchange over the group: every rank's reason not to try the one-sided path
    (None: none) and the first rank's unique ids. Returns ``(ids, None)`` when every rank
    can try, else ``([], the reasons naming their ranks)``: the whole group decides alike,
    also when one node loaded another NCCL."""
    ids: list[bytes] | None = None
    if is_first and failure is None:
        try:
            ids = [nccl_rma.new_unique_id() for _ in range(sides)]
        except Exception as e:  # noqa: BLE001 - a reason like any other, told to every rank
            failure = f"{type(e).__name__}: {e}"
    posted = soft.exchange("one-sided reasons and unique ids", (failure, ids))
    reasons = [(r, why) for r, (why, _) in enumerate(posted) if why is not None]
    if reasons:
        return [], "; ".join(f"group rank {r}: {why}" for r, why in reasons)
    return posted[0][1], None


def _one_sided_wanted(
    members: list[_Candidate], options: TideOptions
) -> tuple[bool, bool, str | None]:
    """``(for TIDE-AG, for TIDE-RS phase 2, why not)`` of one process group's candidates,
    before any collective: the AG of groups with one rank per node, the RS phase 2 of any
    multi-node TIDE-RS group; ``why not``: this process cannot use the API at all."""
    c = members[0]
    layout = c.layout
    assert layout is not None
    want_ag = any(m.kind == "p2p" and layout.local_world_size == 1 for m in members)
    want_rs = options.reduce_scatter == "tide" and any(
        m.pg._reduce_scatter_process_group is m.group for m in members
    )
    if c.device.type != "cuda" or "nccl" not in str(dist.get_backend(c.group)).lower():
        return want_ag, want_rs, _NOT_NCCL
    return want_ag, want_rs, nccl_rma.one_sided_missing_reason()


class _SoftSteps:
    """One group's one-sided set-up steps: each a bounded collective (``SetupSteps``,
    run on the group's ``device``) whose NCCL error is an outcome every rank learns (one
    exchange), not a failure."""

    def __init__(
        self, steps: SetupSteps, scope: str, peers: list[int], device: torch.device
    ) -> None:
        self.steps, self.scope, self.peers, self.device = steps, scope, peers, device

    def exchange(self, what: str, value: object) -> list:
        return self.steps.exchange(what, self.scope, self.peers, value)

    def attempt(self, what: str, fn):
        """``(fn's value or None, None or every failing rank's error)``."""

        def soft():
            try:
                return fn(), None
            except Exception as e:  # noqa: BLE001 - an outcome every rank learns, not a failure
                return None, f"{type(e).__name__}: {e}" if not isinstance(
                    e, nccl_rma.NcclError) else str(e)  # fmt: skip

        value, error = self.steps.run(what, self.scope, self.peers, soft, self.device)
        bad = [(r, e) for r, e in enumerate(self.exchange(f"{what} outcome", error)) if e]
        return value, "; ".join(f"group rank {r}: {e}" for r, e in bad) or None


def _one_sided_side(
    soft: _SoftSteps, c: _Candidate, uid: bytes, nbytes: int, made: list
) -> tuple[tuple | None, str | None]:
    """One communicator + host-RMA check + window of one side (TIDE-AG or TIDE-RS):
    ``((comm, window), None)`` or ``(None, why not)``; communicators made go to ``made``."""
    rank, size = c.group.rank(), c.group.size()
    comm, failure = soft.attempt(
        "one-sided NCCL communicator", lambda: nccl_rma.RmaComm.create(uid, rank, size, c.device)
    )
    if comm is None:
        return None, failure
    made.append(comm)
    if failure is not None:
        return None, failure
    support, failure = soft.attempt("one-sided host RMA query", comm.host_rma_supported)
    if failure is not None:
        return None, failure
    supported = soft.exchange("one-sided host RMA", support)
    lacking = [r for r, ok in enumerate(supported) if ok is False]
    if lacking:
        version = nccl_rma.version_text(nccl_rma.nccl_version())
        return (
            None,
            f"NCCL {version} reports no host RMA between these nodes (group ranks {lacking})",
        )
    window, failure = soft.attempt("one-sided window", lambda: comm.register(nbytes))
    return (None, failure) if failure is not None else ((comm, window), None)


def _connect_one_sided(
    taken: list[_Candidate],
    options: TideOptions,
    ctx: TideContext,
    decisions: list[str],
    install_seq: int,
) -> dict[tuple, _OneSided]:
    """The one-sided cross-node transports per (process group, device) of multi-node
    candidates (``[tide] cross_node_transport``). Collective over each such group's ranks,
    every step bounded by ``install_timeout_s``: two NCCL communicators of TIDE's own
    (TIDE-AG, TIDE-RS: one signal protocol each), the host-RMA query and the window
    registrations. Under ``"auto"`` an outcome short of one-sided on any rank (old NCCL,
    no host RMA across these nodes, a NULL window) makes every rank of the group keep
    send/recv, logged with the reason; under ``"nccl_one_sided"`` it raises ``ValueError``
    naming it (install reports it on every rank)."""
    choice = options.cross_node_transport
    by_key: dict[tuple[int, torch.device], list[_Candidate]] = {}
    for c in taken:
        assert c.layout is not None
        if c.layout.num_nodes > 1:
            by_key.setdefault((id(c.group), c.device), []).append(c)
    out: dict[tuple, _OneSided] = {}
    if choice == "p2p":
        for members in by_key.values():
            decisions.append(
                f"{members[0].fqn}: cross-node p2p (option cross_node_transport='p2p')"
            )
        return out
    steps: SetupSteps | None = None  # made on the first group that tries (a store client)
    for k, (key, members) in enumerate(by_key.items()):
        c, layout = members[0], members[0].layout
        assert layout is not None
        want_ag, want_rs, failure = _one_sided_wanted(members, options)
        if not (want_ag or want_rs):
            if choice == "nccl_one_sided":  # asked for, nothing to carry: say so
                decisions.append(
                    f"{c.fqn}: [tide] cross_node_transport = 'nccl_one_sided' unused (no "
                    "TIDE-RS phase 2 here and TIDE-AG has several ranks per node)"
                )
            continue
        sides: list[tuple[str, int]] = []
        if want_ag:
            entry = max(fsdp_internals.shard_bytes(m.pg, "param", align=16) for m in members)
            sides.append(("TIDE-AG", ag_window_bytes(layout.num_nodes, entry)))
        rs_shard_bytes = 4 * max(
            sum(fp._sharded_param_data.numel() for fp in m.pg.fsdp_params) for m in members
        )
        if want_rs:
            sides.append(("TIDE-RS phase 2",
                          rs_window_bytes(layout.num_nodes, options.rs_inflight, rs_shard_bytes)))  # fmt: skip
        made: list[nccl_rma.RmaComm] = []
        found: dict[str, tuple] = {}
        if c.device.type == "cuda" and failure is not _NOT_NCCL:
            steps = steps or SetupSteps(install_seq, options.install_timeout_s)
            peers = list(group_global_ranks(c.group))
            scope = f"onesided{k}/{zlib.crc32(repr(peers).encode()):08x}"
            soft = _SoftSteps(steps, scope, peers, c.device)
            # every rank's reason not to (a node with another NCCL, say) and rank 0's ids
            ids, failure = _agree_to_try(soft, failure, c.group.rank() == 0, len(sides))
        if failure is None:
            for (side, nbytes), uid in zip(sides, ids):
                pair, failure = _one_sided_side(soft, c, uid, nbytes, made)
                if failure is not None:
                    break
                found[side] = pair
        if failure is not None:
            for comm in made:
                comm.abort()
            if choice == "nccl_one_sided":
                raise ValueError(
                    f"[tide] cross_node_transport = 'nccl_one_sided' cannot run for {c.fqn}: "
                    f"{failure}; use 'auto' (falls back to send/recv) or 'p2p'"
                )
            decisions.append(f"{c.fqn}: cross-node p2p (auto: {failure})")
            continue
        ctx.rma_comms.extend(made)
        name = c.group.group_name
        result = out[key] = _OneSided()
        if "TIDE-AG" in found:
            result.ag = OneSidedAllGather(*found["TIDE-AG"], options.pacing, name)
        if "TIDE-RS phase 2" in found:
            result.rs = OneSidedCrossNode(*found["TIDE-RS phase 2"], layout.num_nodes,
                                          options.rs_inflight, rs_shard_bytes, name)  # fmt: skip
        windows = ", ".join(f"{side} window {pair[1].nbytes} B" for side, pair in found.items())
        stays = "" if want_ag else (
            f"; TIDE-AG across nodes stays send/recv ({layout.local_world_size} ranks per "
            "node: its staging is no NCCL window)"
        )  # fmt: skip
        decisions.append(
            f"{c.fqn}: cross-node nccl_one_sided ({'auto: ' if choice == 'auto' else ''}NCCL "
            f"{nccl_rma.version_text(nccl_rma.nccl_version())} with host RMA; {windows}{stays})"
        )
    return out


def _mark_groups(
    cands: list[_Candidate],
    options: TideOptions,
    ag_slots: dict,
    rs_slots: dict,
    one_sided: dict[tuple, _OneSided],
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
        sided = one_sided.get(key, _OneSided())
        transport: AllGatherTransport
        if key not in p2p_by_key and c.kind != "copy_engine":
            p2p_by_key[key] = P2PTransport(
                "nccl_p2p" if c.device.type == "cuda" else "gloo", c.device
            )
        if c.kind == "copy_engine":
            transport = CopyEngineTransport(ag_slots[key])
        elif sided.ag is not None:
            transport = sided.ag
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
        shared = c.kind == "copy_engine" and options.slot_reuse
        rs_transport: ReduceScatterTransport = (
            CopyEngineTransport(rs_slots[key]) if key in rs_slots
            else p2p_by_key[key] if c.kind != "copy_engine"
            else transport
        )  # fmt: skip
        buffers = buffers_by_key.setdefault(
            key, RSBuffers(options.rs_inflight, WIRE_DTYPES[options.rs_wire_dtype])
        )
        if sided.rs is not None and not buffers.partials:
            # the partial ring lives in the registered window: puts read it in place
            buffers.partials = sided.rs.send_slots(sided.rs.region_bytes // 4)
            buffers.partial_free = [None] * len(buffers.partials)
            buffers.partials_fixed = True
            if buffers.wire_dtype != torch.float32:  # partials rounded for the wire: put too
                buffers.send = sided.rs.wire_slot(buffers.wire_dtype)
        layout = c.plan.layout
        cross_node: CrossNodeTransport | None = sided.rs
        if layout.num_nodes > 1 and cross_node is None:
            if key not in p2p_cross_by_key:
                p2p_cross_by_key[key] = P2PCrossNode(c.device)
            cross_node = p2p_cross_by_key[key]
        # Several FSDP roots have one reduce-scatter stream each; staging shared by
        # the groups of a process group is only safe on one stream: TIDE's.
        on_tide_stream = shared or (multi_root and c.device.type == "cuda")
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
            if sided.rs is not None
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
            _decide(cands, options, infos)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        gathered = _agree(
            groups, "planning", {"rank": me, "error": error, "kinds": [c.kind for c in cands]}
        )
        _settle_transports(cands, gathered)
        # Local work that can fail alone (plans, symmetric buffers) before any rendezvous.
        error, taken, pending = None, [], {}
        try:
            taken = _build_plans(cands, decisions, fsdp_internals.param_fqns(model), options.pacing)
            pending = _allocate_slots(taken, options)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        _agree(groups, "allocation", {"rank": me, "error": error})
        error = None
        try:
            ag_slots, rs_slots = _connect_slots(pending, options, ctx, decisions, install_seq)
            one_sided = _connect_one_sided(taken, options, ctx, decisions, install_seq)
            _mark_groups(taken, options, ag_slots, rs_slots, one_sided, ctx, decisions)
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
        torch.cuda.synchronize(comm.device)
    _drop(ctx, abort_rma=False)
    if ctx.forward_hook is not None:
        ctx.forward_hook.remove()
    delattr(model, _MODEL_ATTR)
    if ctx.groups:
        fsdp_patch.release()
