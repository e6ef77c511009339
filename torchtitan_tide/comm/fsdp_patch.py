"""The ONLY module that touches FSDP2 internals (torch 2.11 - 2.13).

Why rebinding names: ``_fsdp_param_group`` imports ``foreach_all_gather``,
``foreach_all_gather_copy_out`` and ``foreach_reduce`` by name, so
FSDPParamGroup.unshard / wait_for_unshard / post_backward call whatever those
module globals are. The public hooks (``set_custom_all_gather``,
``set_custom_reduce_scatter``) only see FSDP's flat buffers and cannot remove
the copy-in, copy-out or ``chunk_cat``. We rebind the three globals to
dispatching wrappers:

- a group marked by :func:`install` (``param_group._tide_ag_state``) in the
  sharded state and called with the group the plan was built for goes to
  TIDE-AG; every other call (unmarked groups, other models, the post-forward
  mesh of ``reshard_after_forward=int``) goes to the original function;
- a reduce of a group marked ``param_group._tide_rs_state`` on the group's
  reduce-scatter process group goes to TIDE-RS unless its dtypes need FSDP2's
  path (``reduce_scatter.rs_unsupported_reason``: logged once per group);
- the wrappers are installed once (refcounted per model) and the originals
  restored when the last model is removed.

``unshard``/``wait_for_unshard``/``reshard``/``post_backward`` are untouched,
so prefetching, resharding and FSDP's stream/event protocol stay FSDP2's.

Version differences handled here: 2.13 keeps a list ``state._fsdp_param_groups``
(2.11: one ``state._fsdp_param_group``); extra positional/keyword arguments of
``foreach_all_gather`` (e.g. a label suffix) are passed through;
``foreach_reduce`` returns 7 values on 2.13 (with ``post_reduce_stream``) and
6 on 2.11 (``_REDUCE_RETURNS_STREAM``, read from its annotation).
"""

from __future__ import annotations

import inspect
import logging
import socket
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as _fpg
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from . import kernels
from .all_gather import (
    TideAllGatherResult,
    TideGroupState,
    tide_all_gather,
    tide_all_gather_copy_out,
)
from .options import TideOptions, resolve_local_world_size
from .plan import ParamSpec, WorldLayout, build_group_plan
from .reduce_scatter import (
    RSBuffers,
    TideRSState,
    rows_per_round,
    rs_unsupported_reason,
    tide_reduce,
)
from .transport import AllGatherTransport, ReduceScatterTransport
from .transport.copy_engine import CopyEngineTransport, SymmSlots
from .transport.p2p import P2PTransport

__all__ = ["fsdp_param_groups", "install", "installed_refcount", "uninstall"]

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_tide_ag_installed"
_GROUP_ATTR = "_tide_ag_state"
_RS_ATTR = "_tide_rs_state"
_PATCHED_NAMES = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
_originals: dict[str, object] = {}
_refcount = 0
# id(param_group.fsdp_params) -> weakref(param_group): the wrappers only see
# FSDP's ``fsdp_params`` list, so this finds the group (identity re-checked).
_groups_by_params: dict[int, weakref.ref] = {}
# id(FSDPParam) -> weakref(param_group): foreach_reduce gets a new list of
# the group's parameters that have gradients.
_groups_by_param: dict[int, weakref.ref] = {}
_REDUCE_RETURNS_STREAM = "Stream" in str(inspect.signature(_fpg.foreach_reduce).return_annotation)
_REDUCE_SIGNATURE = inspect.signature(_fpg.foreach_reduce)


@dataclass
class _ModelRecord:
    groups: list = field(default_factory=list)  # FSDPParamGroup
    slots: list = field(default_factory=list)  # SymmSlots


# ---------------------------------------------------------------- discovery


def fsdp_param_groups(model: nn.Module) -> list[tuple[str, object]]:
    """``(module fqn, FSDPParamGroup)`` for every FSDP module of ``model``."""
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = state.__dict__.get("_fsdp_param_groups")  # torch >= 2.12
        if groups is None:  # torch 2.11
            g = state.__dict__.get("_fsdp_param_group")
            groups = [g] if g is not None else []
        for g in groups:
            out.append((name or "<root>", g))
    return out


def _ag_dtype(fsdp_param, mp_policy) -> torch.dtype:
    """The all-gather (unsharded) dtype FSDP will use for this parameter: the
    group's mixed-precision ``param_dtype`` unless it equals the sharded dtype
    or the parameter is not floating point (FSDPParam.init_dtype_attrs rules;
    FSDP sets ``fsdp_param.param_dtype`` only at lazy init, after apply)."""
    orig = fsdp_param._sharded_param_data.dtype
    param_dtype = mp_policy.param_dtype
    if param_dtype is None or param_dtype == orig or not orig.is_floating_point:
        return orig
    return param_dtype


def _param_spec(fsdp_param, mp_policy) -> ParamSpec:
    reason = None
    if fsdp_param.fsdp_placement.dim != 0:
        reason = f"Shard({fsdp_param.fsdp_placement.dim}) placement"
    elif hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
        reason = "custom fsdp_pre_all_gather extension"
    elif fsdp_param.offload_to_cpu:
        reason = "CPU offload"
    return ParamSpec(
        fqn=getattr(fsdp_param, "_param_fqn", None) or f"param{tuple(fsdp_param._orig_size)}",
        shard_numel=fsdp_param._sharded_param_data.numel(),
        dtype=str(_ag_dtype(fsdp_param, mp_policy)),
        unsupported=reason,
    )


def _shard_bytes(param_group, which: str, align: int = 1) -> int:
    """Bytes of one rank's shards of a group, each parameter rounded up to
    ``align`` bytes. ``which="param"``: in the all-gather dtype, which is also
    the gradient dtype (FSDP2 computes gradients in ``param_dtype``): the
    copy-engine slot's packed shards (``align=16``, the layout
    ``CopyEngineTransport.gather`` packs) and one TIDE-RS staging row.
    ``"reduce"``: in the reduce dtype, in which FSDP accumulates unsynced
    gradients."""
    total = 0
    for fp in param_group.fsdp_params:
        dtype = _ag_dtype(fp, param_group.mp_policy)
        if which == "reduce":
            dtype = param_group.mp_policy.reduce_dtype or fp._sharded_param_data.dtype
        nbytes = fp._sharded_param_data.numel() * dtype.itemsize
        total += -(-nbytes // align) * align
    return total


def _one_node_p2p_ok(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "not CUDA"
    n = torch.cuda.device_count()
    me = device.index if device.index is not None else torch.cuda.current_device()
    blocked = [d for d in range(n) if d != me and not torch.cuda.can_device_access_peer(me, d)]
    if blocked:
        return False, f"no P2P access from cuda:{me} to {blocked}"
    return True, "CUDA P2P to every local GPU"


def _choose_transport(
    options: TideOptions, layout: WorldLayout, device: torch.device, backend: str
) -> tuple[str, str]:
    """(transport kind "copy_engine" | "p2p", reason). Raises ValueError for a
    forced transport that cannot work here."""
    t = options.transport
    if t == "copy_engine":
        if device.type != "cuda" or ("nccl" not in backend and layout.num_nodes > 1):
            raise ValueError(
                f"tide option transport='copy_engine' needs CUDA parameters (and an NCCL group "
                f"across nodes) (device={device.type}, backend={backend}); "
                "use transport='auto' or 'gloo' on CPU"
            )
        return "copy_engine", "forced by option transport='copy_engine'"
    if t == "nccl_p2p":
        if device.type != "cuda" or "nccl" not in backend:
            raise ValueError(
                f"tide option transport='nccl_p2p' needs CUDA parameters and an NCCL group "
                f"(device={device.type}, backend={backend}); use 'gloo' or 'auto' on CPU"
            )
        return "p2p", "forced by option transport='nccl_p2p'"
    if t == "gloo":
        if device.type != "cpu" or "gloo" not in backend:
            raise ValueError(
                f"tide option transport='gloo' needs CPU parameters and a gloo group "
                f"(device={device.type}, backend={backend}); use 'nccl_p2p' or 'auto' on GPU"
            )
        return "p2p", "forced by option transport='gloo'"
    # auto
    shape = f"{layout.num_nodes} nodes x {layout.local_world_size}"
    if layout.local_world_size == 1:
        return "p2p", f"auto: {shape}: no node-local peers, point-to-point over {backend}"
    ok, why = _one_node_p2p_ok(device)
    if not ok:
        return "p2p", f"auto: {shape} but {why}: point-to-point over {backend}"
    if layout.num_nodes == 1:
        return "copy_engine", f"auto: {shape}, {why}"
    return "copy_engine", f"auto: {shape}, {why}; cross-node phase over {backend} p2p"


_node_groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
_hostnames: dict[int, list[str]] = {}


def _group_hostnames(group: dist.ProcessGroup) -> list[str]:
    """Host name of every rank of ``group`` (collective over ``group`` on first
    use per group; cached)."""
    if id(group) not in _hostnames:
        names: list[str] = [""] * group.size()
        dist.all_gather_object(names, socket.gethostname(), group=group)
        _hostnames[id(group)] = names
    return _hostnames[id(group)]


def _node_local_group(group: dist.ProcessGroup, layout: WorldLayout) -> dist.ProcessGroup | None:
    """The process group of this rank's node within ``group`` (for the
    symmetric-memory rendezvous and barrier). Collective over ``group`` on
    first use per (group, layout); cached. None when it cannot be made."""
    if layout.num_nodes == 1:
        return group
    key = (id(group), layout.local_world_size)
    if key not in _node_groups:
        g = [dist.get_global_rank(group, r) for r in range(group.size())]
        node_lists = [[g[r] for r in layout.node_ranks(m)] for m in range(layout.num_nodes)]
        sub = None
        if group.size() == dist.get_world_size():
            sub, _ = dist.new_subgroups_by_enumeration(node_lists)
        elif hasattr(dist, "split_group") and "nccl" in str(dist.get_backend(group)).lower():
            try:  # needs an eagerly initialized parent (init_process_group(device_id=...))
                sub = dist.split_group(group, split_ranks=node_lists)
            except Exception as e:  # noqa: BLE001
                logger.warning("TIDE-AG: split_group for node-local groups failed: %s", e)
        _node_groups[key] = sub
    return _node_groups[key]


# ---------------------------------------------------------------- wrappers


def _tide_state_for(fsdp_params, group) -> TideGroupState | None:
    ref = _groups_by_params.get(id(fsdp_params))
    param_group = ref() if ref is not None else None
    if param_group is None or param_group.fsdp_params is not fsdp_params:
        return None
    state: TideGroupState | None = getattr(param_group, _GROUP_ATTR, None)
    if state is None or group is not state.group:
        return None
    if any(fp.sharded_state != ShardedState.SHARDED for fp in fsdp_params):
        return None
    return state


def _foreach_all_gather(
    fsdp_params,
    group,
    async_op,
    all_gather_copy_in_stream,
    all_gather_stream,
    device,
    *args,
    **kwargs,
):
    state = _tide_state_for(fsdp_params, group)
    if state is None:
        return _originals["foreach_all_gather"](
            fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
            device, *args, **kwargs,
        )  # fmt: skip
    return tide_all_gather(
        state, fsdp_params, group, all_gather_copy_in_stream, all_gather_stream, device
    )


def _foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
    if isinstance(all_gather_result, TideAllGatherResult):
        return tide_all_gather_copy_out(all_gather_result)
    return _originals["foreach_all_gather_copy_out"](
        all_gather_result, fsdp_params, group, *args, **kwargs
    )


def _rs_state_for(fsdp_params, reduce_scatter_group) -> TideRSState | None:
    if not fsdp_params:
        return None
    ref = _groups_by_param.get(id(fsdp_params[0]))
    param_group = ref() if ref is not None else None
    state: TideRSState | None = getattr(param_group, _RS_ATTR, None)
    if state is None or reduce_scatter_group is not state.group:
        return None
    members = {id(fp) for fp in param_group.fsdp_params}
    if any(id(fp) not in members for fp in fsdp_params):
        return None
    return state


def _foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs):
    state = _rs_state_for(fsdp_params, reduce_scatter_group)
    if state is not None:
        call = _REDUCE_SIGNATURE.bind(
            fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs
        )
        call.apply_defaults()
        a = call.arguments
        reason = rs_unsupported_reason(
            unsharded_grads, a["reduce_dtype"], a["orig_dtype"], a["all_reduce_group"],
            a["all_reduce_hook"],
        )  # fmt: skip
        rows = 0
        if reason is None:
            shard_numel = sum(fp._sharded_param_data.numel() for fp in fsdp_params)
            rows = rows_per_round(state, shard_numel, unsharded_grads[0].element_size())
            if rows == 0:
                reason = (
                    f"{shard_numel} x {unsharded_grads[0].dtype} gradients per shard do not fit "
                    "one staging row of the copy-engine slots"
                )
        if reason is None:
            device = a["device"]
            result = tide_reduce(
                state, fsdp_params, unsharded_grads, a["reduce_scatter_stream"],
                a["orig_dtype"], device, a["gradient_divide_factor"],
                rows=rows,
            )  # fmt: skip
            if _REDUCE_RETURNS_STREAM:
                return tuple(result)
            return (result[0], result[1], *result[3:])
        if reason not in state.stock_reasons:
            state.stock_reasons.add(reason)
            logger.warning(
                "TIDE-RS %s: FSDP2 reduce-scatter for this reduce: %s", state.fqn, reason
            )
    return _originals["foreach_reduce"](
        fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs
    )


_wrappers = {
    "foreach_all_gather": _foreach_all_gather,
    "foreach_all_gather_copy_out": _foreach_all_gather_copy_out,
    "foreach_reduce": _foreach_reduce,
}


def _acquire_wrappers() -> None:
    global _refcount
    if _refcount == 0:
        for name in _PATCHED_NAMES:
            _originals[name] = getattr(_fpg, name)
            setattr(_fpg, name, _wrappers[name])
    _refcount += 1


def _release_wrappers() -> None:
    global _refcount
    _refcount -= 1
    if _refcount == 0:
        for name in _PATCHED_NAMES:
            if getattr(_fpg, name) is _wrappers[name]:
                setattr(_fpg, name, _originals.pop(name))
            else:
                logger.warning(
                    "TIDE: %s._%s was rebound by someone else after TIDE; not restoring",
                    _fpg.__name__, name,
                )  # fmt: skip


def installed_refcount() -> int:
    """Number of models with TIDE-AG installed (the wrappers are live iff > 0)."""
    return _refcount


# ---------------------------------------------------------------- install


def install(model: nn.Module, options: TideOptions) -> None:
    """Mark every FSDP param group of ``model`` for TIDE-AG (and TIDE-RS) and install the
    wrappers. Collective when a group uses the copy engine (symmetric-memory
    rendezvous) and for logging: call on all ranks in the same order."""
    if getattr(model, _MODEL_ATTR, None) is not None:
        raise ValueError(
            "comm.apply(mode='tide') was already called on this model; call remove first"
        )
    named_groups = fsdp_param_groups(model)
    if not named_groups:
        raise ValueError(
            "comm.apply(mode='tide') found no FSDP2 module in the model: shard it with "
            "torch.distributed.fsdp.fully_shard first"
        )
    record = _ModelRecord()
    decisions: list[str] = []
    ce_groups: dict[tuple[int, torch.device], tuple[WorldLayout, list]] = {}
    pending: list[tuple] = []
    for fqn, pg in named_groups:
        group = pg._all_gather_process_group
        world = group.size()
        device = pg.device
        if world == 1:
            decisions.append(f"{fqn}: FSDP2 path (group of 1 rank: FSDP2 skips the all-gather)")
            continue
        if device.type not in ("cuda", "cpu"):
            decisions.append(f"{fqn}: FSDP2 path (device {device.type} not supported)")
            continue
        specs = [_param_spec(fp, pg.mp_policy) for fp in pg.fsdp_params]
        lws, lws_source = resolve_local_world_size(options, _group_hostnames(group))
        layout = WorldLayout(world, lws)
        backend = str(dist.get_backend(group)).lower()
        kind, why = _choose_transport(options, layout, device, backend)
        plan = build_group_plan(specs, layout, group.rank(), pull_local=kind == "copy_engine")
        if not plan.uses_tide:
            decisions.append(f"{fqn}: FSDP2 path ({plan.fallback_reason})")
            continue
        pending.append((fqn, pg, group, device, plan, kind))
        decisions.append(
            f"{fqn}: transport={kind} ({why}); {len(plan.params)} params, "
            f"{layout.num_nodes} nodes x {layout.local_world_size} ({lws_source}), "
            f"dtypes {list(plan.dtypes)}"
        )
        if kind == "copy_engine":
            ce_groups.setdefault((id(group), device), (layout, []))[1].append(pg)
    tide_rs = options.reduce_scatter == "tide"
    # One symmetric slot pair per (process group, device) on the node-local
    # group: TIDE-AG needs the largest group's packed shards times the node
    # count; with Slot-Reuse TIDE-RS stages its rows in the same slots.
    slots_by_key: dict[tuple[int, torch.device], SymmSlots] = {}
    rs_slots_by_key: dict[tuple[int, torch.device], SymmSlots] = {}
    for key, (layout, pgs) in ce_groups.items():
        group = pgs[0]._all_gather_process_group
        node_group = _node_local_group(group, layout)
        if node_group is None:
            raise ValueError(
                "TIDE-AG copy engine across nodes needs a node-local process group: the FSDP "
                "group is a sub-group and torch.distributed.split_group is unavailable; use "
                "tide option transport='nccl_p2p'"
            )
        ag_bytes = layout.num_nodes * max(_shard_bytes(pg, "param", align=16) for pg in pgs)
        # rs_rows rows of gradients, and at least one row of fp32 gradients that
        # FSDP accumulated (in the reduce dtype) over steps without sync.
        rs_bytes = max(
            max(min(options.rs_rows, layout.local_world_size) * _shard_bytes(pg, "param"),
                _shard_bytes(pg, "reduce"))
            for pg in pgs
        )  # fmt: skip
        shared = tide_rs and options.slot_reuse
        slots_by_key[key] = SymmSlots.create(
            max(ag_bytes, rs_bytes) if shared else ag_bytes,
            node_group,
            key[1],
            barrier=options.slot_barrier,
        )
        record.slots.append(slots_by_key[key])
        barrier = slots_by_key[key].barrier_kind
        decisions.append(
            f"copy-engine slots on {key[1]}: 2 x {slots_by_key[key].slot_bytes} B, barrier "
            + ("stream flag write/wait (no SM kernel)" if barrier == "copy_engine" else
               f"kernel (option slot_barrier={options.slot_barrier!r})")
        )  # fmt: skip
        if tide_rs and not shared:
            rs_slots_by_key[key] = SymmSlots.create(
                rs_bytes, node_group, key[1], barrier=options.slot_barrier
            )
            record.slots.append(rs_slots_by_key[key])
    p2p_by_key: dict[tuple[int, torch.device], P2PTransport] = {}
    buffers_by_key: dict[tuple[int, torch.device], RSBuffers] = {}
    for fqn, pg, group, device, plan, kind in pending:
        key = (id(group), device)
        transport: AllGatherTransport
        if kind == "copy_engine":
            transport = CopyEngineTransport(slots_by_key[key])
        else:
            if key not in p2p_by_key:
                p2p_by_key[key] = P2PTransport(
                    "nccl_p2p" if device.type == "cuda" else "gloo", options.pacing
                )
            transport = p2p_by_key[key]
        setattr(pg, _GROUP_ATTR, TideGroupState(plan, transport, group, fqn))
        _groups_by_params[id(pg.fsdp_params)] = weakref.ref(pg)
        record.groups.append(pg)
        if not tide_rs:
            decisions.append(f"{fqn}: reduce-scatter FSDP2 (option reduce_scatter='fsdp2')")
            continue
        if pg._reduce_scatter_process_group is not group:
            decisions.append(f"{fqn}: reduce-scatter FSDP2 (all-gather and RS groups differ)")
            continue
        shared = kind == "copy_engine" and options.slot_reuse
        if kind == "copy_engine" and not shared:
            rs_transport: ReduceScatterTransport = CopyEngineTransport(rs_slots_by_key[key])
        else:
            rs_transport = transport
        layout = plan.layout
        buffers = buffers_by_key.setdefault(key, RSBuffers(inflight=options.rs_inflight))
        setattr(
            pg,
            _RS_ATTR,
            TideRSState(
                layout=layout,
                rank=plan.rank,
                group=group,
                fqn=fqn,
                transport=rs_transport,
                buffers=buffers,
                rows=options.rs_rows,
                ctas=options.rs_ctas,
                use_tide_stream=shared,
            ),
        )
        for fp in pg.fsdp_params:
            _groups_by_param[id(fp)] = weakref.ref(pg)
        cross = (
            f"; cross-node p2p over {str(dist.get_backend(group)).lower()}, "
            f"{options.rs_inflight} partials in flight"
            if layout.num_nodes > 1
            else ""
        )
        accumulate = (
            f"{kernels.triton_status()}, {options.rs_ctas} CTAs"
            if device.type == "cuda"
            else "torch"
        )
        decisions.append(
            f"{fqn}: TIDE-RS node-local {kind}"
            + (" (staging in the TIDE-AG slots: Slot-Reuse)" if shared else "")
            + f", {min(options.rs_rows, layout.local_world_size)} rows per round{cross}; "
            f"accumulate {accumulate}"
        )
    _log_decisions(decisions)
    setattr(model, _MODEL_ATTR, record)
    if record.groups:
        _acquire_wrappers()
    else:
        logger.warning("TIDE-AG: no FSDP group of this model can use TIDE; all take FSDP2's path")


def _log_decisions(decisions: list[str]) -> None:
    """Rank 0 logs its decisions; other ranks log (rank-tagged) only where
    theirs differ from rank 0's."""
    if not dist.is_initialized():
        for d in decisions:
            logger.info("TIDE-AG group %s", d)
        return
    ref = [decisions]
    dist.broadcast_object_list(ref, src=0)
    rank = dist.get_rank()
    if rank == 0:
        for d in decisions:
            logger.info("TIDE-AG group %s", d)
        return
    for i, d in enumerate(decisions):
        if i >= len(ref[0]) or ref[0][i] != d:
            logger.info("TIDE-AG group [rank %d on %s] %s", rank, socket.gethostname(), d)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` for ``model``; FSDP2's stock path is used again.
    Call it on all ranks between steps (never while an all-gather is pending):
    with the copy engine it is collective, since peers may still be pulling
    from this rank's symmetric buffer until everyone synchronizes."""
    record: _ModelRecord | None = getattr(model, _MODEL_ATTR, None)
    if record is None:
        return
    for slots in record.slots:
        device = slots.buffer.device
        torch.cuda.synchronize(device)  # own pulls and packs done
        slots.handle.barrier(channel=0)  # every local peer got here too
        torch.cuda.synchronize(device)
    for pg in record.groups:
        for attr in (_GROUP_ATTR, _RS_ATTR):
            if hasattr(pg, attr):
                delattr(pg, attr)
        _groups_by_params.pop(id(pg.fsdp_params), None)
        for fp in pg.fsdp_params:
            _groups_by_param.pop(id(fp), None)
    record.slots.clear()  # symmetric buffers are freed with their last reference
    delattr(model, _MODEL_ATTR)
    if record.groups:
        _release_wrappers()
