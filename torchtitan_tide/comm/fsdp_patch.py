"""The ONLY module that touches FSDP2 internals (torch 2.11 - 2.13).

Why rebinding names: ``_fsdp_param_group`` imports ``foreach_all_gather`` and
``foreach_all_gather_copy_out`` by name, so FSDPParamGroup.unshard /
wait_for_unshard call whatever those module globals are. The public hooks
(``set_custom_all_gather``) only see FSDP's flat buffer and cannot remove the
copy-in/copy-out. We rebind the two globals to dispatching wrappers:

- a group marked by :func:`install` (``param_group._tide_ag_state``) in the
  sharded state and called with the group the plan was built for goes to
  TIDE-AG; every other call (unmarked groups, other models, the post-forward
  mesh of ``reshard_after_forward=int``) goes to the original function;
- the wrappers are installed once (refcounted per model) and the originals
  restored when the last model is removed.

``unshard``/``wait_for_unshard``/``reshard``/``post_backward`` are untouched,
so prefetching, resharding and FSDP's stream/event protocol stay FSDP2's.

Version differences handled here: 2.13 keeps a list ``state._fsdp_param_groups``
(2.11: one ``state._fsdp_param_group``); extra positional/keyword arguments of
``foreach_all_gather`` (e.g. a label suffix) are passed through.
"""

from __future__ import annotations

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

from .all_gather import (
    TideAllGatherResult,
    TideGroupState,
    tide_all_gather,
    tide_all_gather_copy_out,
)
from .options import TideAGOptions, resolve_local_world_size
from .plan import ParamSpec, WorldLayout, build_group_plan
from .transport import AllGatherTransport
from .transport.copy_engine import CopyEngineTransport, SymmSlots
from .transport.p2p import P2PTransport

__all__ = ["fsdp_param_groups", "install", "installed_refcount", "uninstall"]

logger = logging.getLogger(__name__)

_MODEL_ATTR = "_tide_ag_installed"
_GROUP_ATTR = "_tide_ag_state"
_PATCHED_NAMES = ("foreach_all_gather", "foreach_all_gather_copy_out")
_originals: dict[str, object] = {}
_refcount = 0
# id(param_group.fsdp_params) -> weakref(param_group): the wrappers only see
# FSDP's ``fsdp_params`` list, so this finds the group (identity re-checked).
_groups_by_params: dict[int, weakref.ref] = {}


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


def _packed_bytes(param_group) -> int:
    """Bytes of one rank's packed shards of a group in the copy-engine slot
    (the layout CopyEngineTransport.gather packs: 16-byte aligned per param)."""
    total = 0
    for fp in param_group.fsdp_params:
        nbytes = fp._sharded_param_data.numel() * _ag_dtype(fp, param_group.mp_policy).itemsize
        total += (nbytes + 15) // 16 * 16
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
    options: TideAGOptions, layout: WorldLayout, device: torch.device, backend: str
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


_wrappers = {
    "foreach_all_gather": _foreach_all_gather,
    "foreach_all_gather_copy_out": _foreach_all_gather_copy_out,
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


def install(model: nn.Module, options: TideAGOptions) -> None:
    """Mark every FSDP param group of ``model`` for TIDE-AG and install the
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
    # One symmetric slot pair per (process group, device) on the node-local
    # group, sized for the largest group times the node count.
    slots_by_key: dict[tuple[int, torch.device], SymmSlots] = {}
    for key, (layout, pgs) in ce_groups.items():
        group = pgs[0]._all_gather_process_group
        node_group = _node_local_group(group, layout)
        if node_group is None:
            raise ValueError(
                "TIDE-AG copy engine across nodes needs a node-local process group: the FSDP "
                "group is a sub-group and torch.distributed.split_group is unavailable; use "
                "tide option transport='nccl_p2p'"
            )
        slot_bytes = layout.num_nodes * max(_packed_bytes(pg) for pg in pgs)
        slots_by_key[key] = SymmSlots.create(slot_bytes, node_group, key[1])
        record.slots.append(slots_by_key[key])
    for fqn, pg, group, device, plan, kind in pending:
        transport: AllGatherTransport
        if kind == "copy_engine":
            transport = CopyEngineTransport(slots_by_key[(id(group), device)])
        else:
            transport = P2PTransport(
                "nccl_p2p" if device.type == "cuda" else "gloo", options.pacing
            )
        setattr(pg, _GROUP_ATTR, TideGroupState(plan, transport, group, fqn))
        _groups_by_params[id(pg.fsdp_params)] = weakref.ref(pg)
        record.groups.append(pg)
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
        if hasattr(pg, _GROUP_ATTR):
            delattr(pg, _GROUP_ATTR)
        _groups_by_params.pop(id(pg.fsdp_params), None)
    record.slots.clear()  # symmetric buffers are freed with their last reference
    delattr(model, _MODEL_ATTR)
    if record.groups:
        _release_wrappers()
