"""``comm.apply(mode="tide")``: which FSDP groups TIDE takes, with what, agreed by all ranks.

:func:`install` is collective over each FSDP process group of the groups TIDE may take,
and atomic: local selection first (no collective), then one ``all_gather_object`` of every
rank's :class:`~..plans.topology.RankInfo` per process group, local planning, an agreement
(every rank's error and transport proposal), the collective set-up (node-local groups,
symmetric slots), and a second agreement. A failure on any rank raises on every rank of
its groups with that rank's message, and frees what was set up. Nothing collective runs
when no group can use TIDE. The state of one model (slots, node-local groups, the bypass
hook) is owned by its :class:`TideContext`, dropped by :func:`uninstall`; the groups
are marked for the wrappers with ``fsdp_patch.mark``. This module keeps the order and the
agreements; the local decisions are ``install_groups.py``, the collective set-up
``install_setup.py``. Decisions: docs/design/2026-12-01-cluster-layouts.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..base import kernels
from ..base.ranks import clear_global_ranks
from ..options import TideOptions
from ..plans import topology
from ..transports import AllGatherTransport, CrossNodeTransport, ReduceScatterTransport
from ..transports.copy_engine import CopyEngineTransport
from ..transports.p2p import P2PCrossNode, P2PTransport
from ..transports.windows.ring import OneSidedCrossNode
from ..transports.windows.transport import WindowTransport
from . import internals as fsdp_internals
from . import patch as fsdp_patch
from .all_gather import TideGroupState
from .install_groups import (
    Candidate,
    build_plans,
    choose_transports,
    log_transports,
    resolve_layouts,
    select_candidates,
    settle_transports,
)
from .install_setup import (
    TideContext,
    allocate_slots,
    connect_slots,
    connect_windows,
    probe_windows,
)
from .internals import fsdp_param_groups
from .reduce_scatter import WIRE_DTYPES, RSBuffers, TideRSState, wire_label

__all__ = [
    "TideConfigError", "TideContext", "TideInstallError", "context", "install", "uninstall",
]  # fmt: skip

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_tide_ag_installed"
_installs = itertools.count()  # names install's set-up keys in the store (setup_steps)


class TideInstallError(RuntimeError):
    """comm.apply(mode='tide') failed on some rank; raised on every rank of its groups
    (as ``TideConfigError``, a ``ValueError``, when every failure was a bad option)."""


class TideConfigError(TideInstallError, ValueError):
    pass


@contextlib.contextmanager
def _control_plane():
    """Install's own collectives run outside any dispatch mode or functorch
    transform the caller may be in (they are control plane, not model math)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisableFuncTorch():
        yield


def _distinct_groups(cands: list[Candidate]) -> list[tuple[dist.ProcessGroup, torch.device]]:
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


def _mark_groups(
    cands: list[Candidate],
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
    cands = select_candidates(model, decisions)
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
            resolve_layouts(cands, options, infos)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = _error_text(e)
        _agree(groups, "layout", {"rank": me, "error": error})
        # Whether NCCL windows can run, per process group (collective, bounded, soft).
        error, probes, steps = None, {}, None
        try:
            probes, steps = probe_windows(cands, options, decisions, install_seq)
            choose_transports(cands, options, probes)
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
        settle_transports(cands, gathered)
        # Windows (collective, soft: a failure falls back under auto), then the local work
        # that can fail alone (plans, symmetric buffers) before any rendezvous.
        error, taken, pending, windows, rings = None, [], {}, {}, {}
        fqns = fsdp_internals.param_fqns(model)
        try:
            taken = build_plans(cands, decisions, fqns, options.pacing)
            windows, rings = connect_windows(taken, options, probes, steps, ctx, decisions, fqns)
            log_transports(taken, decisions)
            pending = allocate_slots(taken, options)
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
            ag_slots, rs_slots = connect_slots(pending, options, ctx, decisions, install_seq)
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
