"""Every read of FSDP2 internals, and every torch-version difference (2.11 - 2.15).

The TIDE stack (``fsdp_patch``, ``install``, ``reduce_scatter``) and the ``symm_mem`` baseline
read FSDP2 only through this module, so a torch upgrade is checked in one place
(docs/design/2026-12-07-torch-versions.md). What is read:

- the param groups of a module: 2.12+ keeps a list ``state._fsdp_param_groups``,
  2.11 one ``state._fsdp_param_group`` (None for a module without parameters);
- a group's mesh: ``mesh_info`` is ``FSDPMeshInfo`` (shard dim), ``HSDPMeshInfo``
  (shard + replicate) or ``DDPMeshInfo`` (``replicate()``: no shard group, and
  ``_all_gather_process_group`` asserts);
- a parameter's sharded data, placement, extensions and offload flag, and the
  all-gather dtype FSDP will use (``FSDPParam.init_dtype_attrs`` rules);
- the mixed-precision policy: the group's ``mp_policy`` on 2.11-2.14, each
  ``FSDPParam``'s (resolved per parameter) on 2.15 (:func:`mp_policy`);
- the group's comm objects (``_all_gather_comm`` / ``_reduce_scatter_comm``: set by
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter``) and, on 2.15, its
  ``_all_gather_output_fn`` / ``_prepare_reduce_scatter_inputs`` hooks;
- ``foreach_reduce``'s signature and return arity (7 values with ``post_reduce_stream``
  on 2.13+, 6 on 2.11); its dtype arguments (:func:`reduce_dtypes`: ``orig_dtype`` and a
  ``reduce_dtype`` that is None when it equals the gradients' dtype on 2.11-2.14; on 2.15
  no ``orig_dtype``, the reduce dtype always set, each sharded gradient cast to its
  parameter's ``sharded_grad_dtype``);
- on 2.15, the per-parameter ``grad_dtype`` policy (:func:`accumulate_dtype`): FSDP2 itself
  defers autograd's upcast during backward, so bf16 gradients reach ``foreach_reduce`` in
  bf16, beside fp32 ones computed in fp32 (``reduce_scatter.dtype_runs``);
- the three names TIDE rebinds in ``_fsdp_param_group`` (it imports them by name, so
  patching ``_fsdp_collectives`` would do nothing).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as _fpg
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

__all__ = [
    "PATCHED_NAMES",
    "PER_PARAM_GRAD_DTYPE",
    "REDUCE_DTYPE_SEMANTICS",
    "REDUCE_HAS_ORIG_DTYPE",
    "REDUCE_RETURNS_STREAM",
    "REDUCE_SIGNATURE",
    "ReduceDtypes",
    "accumulate_dtype",
    "ag_dtype",
    "custom_comm_reason",
    "fsdp_modules_without_groups",
    "fsdp_param_groups",
    "get_patched",
    "group_root_fqns",
    "mp_policy",
    "param_fqn",
    "param_fqns",
    "reduce_dtypes",
    "set_patched",
    "shard_bytes",
    "shard_group",
    "unsharded_bytes",
    "unsupported_param_reason",
]

PATCHED_NAMES = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
REDUCE_SIGNATURE = inspect.signature(_fpg.foreach_reduce)
REDUCE_RETURNS_STREAM = "Stream" in str(REDUCE_SIGNATURE.return_annotation)
# torch <= 2.14: foreach_reduce(..., orig_dtype, reduce_dtype, ...); 2.15: reduce_dtype only.
REDUCE_HAS_ORIG_DTYPE = "orig_dtype" in REDUCE_SIGNATURE.parameters
# torch 2.15: tensors carry a ``grad_dtype`` (AccumulateGrad casts to it) and FSDP2 sets it
# on each unsharded parameter (``FSDPParam.unsharded_grad_dtype``).
PER_PARAM_GRAD_DTYPE = hasattr(FSDPParam, "unsharded_grad_dtype")
REDUCE_DTYPE_SEMANTICS = (
    "FSDP2 reduce dtype (torch 2.15): MixedPrecisionPolicy.reduce_dtype if set, else the "
    "parameter's grad_dtype (its original dtype: fp32 master weights reduce in fp32 even with "
    "param_dtype=bf16); bf16 gradients reach the reduce uncast where FSDP2 defers autograd's "
    "upcast, and each sharded gradient is cast to its parameter's grad_dtype"
    if PER_PARAM_GRAD_DTYPE
    else "FSDP2 reduce dtype (torch <= 2.14): MixedPrecisionPolicy.reduce_dtype, or the "
    "gradients' dtype (param_dtype) when unset or equal to param_dtype; sharded gradients "
    "are cast to the parameters' original dtype"
)


def get_patched(name: str) -> object:
    """The function ``_fsdp_param_group`` calls as ``name`` now."""
    return getattr(_fpg, name)


def set_patched(name: str, fn: object) -> None:
    setattr(_fpg, name, fn)


def _module_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    groups = state.__dict__.get("_fsdp_param_groups")  # torch >= 2.12
    if groups is None:  # torch 2.11
        group = state.__dict__.get("_fsdp_param_group")
        groups = [group] if group is not None else []
    return list(groups)


def fsdp_param_groups(model: nn.Module) -> list[tuple[str, object]]:
    """``(module fqn, FSDPParamGroup)`` for every param group of ``model``'s FSDP
    modules, each group once, in module order (identical on every rank of an SPMD
    program). A group of several modules (``fully_shard([model.norm, model.output])``,
    as TorchTitan shards its last layers) is named ``"norm+output"``."""
    names: dict[int, list[str]] = {}
    groups: dict[int, object] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for g in _module_groups(module):
                names.setdefault(id(g), []).append(name or "<root>")
                groups.setdefault(id(g), g)
    return [("+".join(names[key]), g) for key, g in groups.items()]


def fsdp_modules_without_groups(model: nn.Module) -> int:
    """How many FSDP modules of ``model`` manage no parameters (``fully_shard`` on
    a module whose parameters all belong to inner FSDP modules, or none at all)."""
    return sum(1 for m in model.modules() if isinstance(m, FSDPModule) and not _module_groups(m))


def group_root_fqns(model: nn.Module) -> dict[int, str]:
    """``id(FSDPParamGroup) -> fqn of its FSDP root``: the outermost FSDP module
    around it. FSDP2 makes that module the root at lazy init (its forward runs
    first), and each root has its own comm context and reduce-scatter stream."""
    roots: dict[int, str] = {}
    fsdp_prefixes: list[str] = []  # fqns of the FSDP roots seen so far
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        root = next(
            (p for p in fsdp_prefixes if p == "" or name == p or name.startswith(p + ".")), None
        )
        if root is None:
            root = name
            fsdp_prefixes.append(name)
        for g in _module_groups(module):
            roots[id(g)] = root or "<root>"
    return roots


def shard_group(param_group) -> dist.ProcessGroup | None:
    """The group's shard (all-gather) process group, or None for a replicate-only
    mesh (``replicate()``: nothing is all-gathered)."""
    mesh_info = param_group.mesh_info
    if not isinstance(mesh_info, FSDPMeshInfo):
        return None
    return mesh_info.shard_process_group


def custom_comm_reason(param_group) -> str | None:
    """Why the group's collectives are not FSDP2's defaults (``set_custom_all_gather``
    / ``set_custom_reduce_scatter``, ``set_symm_mem_for_comm``; on 2.15 also a group
    whose copy-out or reduce-scatter input hook is not FSDP2's), or None."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    found = []
    ag = getattr(param_group, "_all_gather_comm", None)
    if ag is not None and type(ag) is not getattr(coll, "DefaultAllGather", type(ag)):
        found.append(f"all-gather comm {type(ag).__name__}")
    rs = getattr(param_group, "_reduce_scatter_comm", None)
    if rs is not None and type(rs) is not getattr(coll, "DefaultReduceScatter", type(rs)):
        found.append(f"reduce-scatter comm {type(rs).__name__}")
    # torch 2.15: per-group copy-out / reduce-scatter input hooks (FSDP2's defaults unless set)
    for attr, default in (
        ("_all_gather_output_fn", "_default_all_gather_output_fn"),
        ("_prepare_reduce_scatter_inputs", "_default_reduce_scatter_input_fn"),
    ):
        fn = getattr(param_group, attr, None)
        if fn is not None and fn is not getattr(coll, default, fn):
            found.append(f"{attr.lstrip('_')} {getattr(fn, '__name__', fn)!r}")
    return " and ".join(found) or None


def mp_policy(fsdp_param, param_group):
    """The ``MixedPrecisionPolicy`` FSDP applies to ``fsdp_param``: its own on torch 2.15
    (resolved per parameter, ``param_dtype_override_fn``), the group's on 2.11-2.14."""
    policy = getattr(fsdp_param, "mp_policy", None)
    return policy if policy is not None else param_group.mp_policy


def ag_dtype(fsdp_param, param_group) -> torch.dtype:
    """The all-gather (unsharded) dtype FSDP will use for this parameter: the
    mixed-precision ``param_dtype`` unless it equals the sharded dtype or the
    parameter is not floating point (FSDPParam.init_dtype_attrs rules; FSDP sets
    ``fsdp_param.param_dtype`` only at lazy init, after apply)."""
    orig = fsdp_param._sharded_param_data.dtype
    param_dtype = mp_policy(fsdp_param, param_group).param_dtype
    if param_dtype is None or param_dtype == orig or not orig.is_floating_point:
        return orig
    return param_dtype


def accumulate_dtype(fsdp_param, param_group) -> torch.dtype:
    """The dtype FSDP2 accumulates this parameter's unsynced gradients in (microbatches
    without reduce), from the policy (before lazy init). torch 2.11-2.14: the reduce
    dtype, or the gradient (all-gather) dtype when it is unset or equal to
    ``param_dtype`` (``to_accumulated_grad_if_needed``). torch 2.15: the reduce dtype
    if set, else the parameter's ``grad_dtype`` (its original dtype unless set; an
    explicit None keeps the gradient's dtype) (``FSDPParam.unsharded_grad_dtype``)."""
    compute = ag_dtype(fsdp_param, param_group)
    policy = mp_policy(fsdp_param, param_group)
    if not PER_PARAM_GRAD_DTYPE:
        if policy.reduce_dtype is None or policy.reduce_dtype == policy.param_dtype:
            return compute
        return policy.reduce_dtype
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    if fsdp_param._has_sharded_grad_dtype_override:
        return fsdp_param.sharded_grad_dtype or compute
    return fsdp_param._sharded_param_data.dtype


class ReduceDtypes(NamedTuple):
    """The dtypes of one ``foreach_reduce`` call as FSDP2 defines them, any torch.

    ``reduce``: the dtype FSDP2 would reduce in; None = the gradients' own dtype
    (torch <= 2.14 passes None when the policy's reduce dtype is unset or equal to
    ``param_dtype``; 2.15 always passes one). ``outputs``: per parameter, the dtype FSDP2
    hands the sharded gradient over in (<= 2.14: the group's original dtype; 2.15: the
    parameter's ``sharded_grad_dtype``); None = the reduce dtype, uncast."""

    reduce: torch.dtype | None
    outputs: tuple[torch.dtype | None, ...]


def reduce_dtypes(call: dict, fsdp_params) -> ReduceDtypes:
    """:class:`ReduceDtypes` of a ``foreach_reduce`` call (``call``: its bound arguments)."""
    if REDUCE_HAS_ORIG_DTYPE:
        return ReduceDtypes(call["reduce_dtype"], (call["orig_dtype"],) * len(fsdp_params))
    return ReduceDtypes(
        call["reduce_dtype"], tuple(fp.sharded_grad_dtype for fp in fsdp_params)
    )


def unsupported_param_reason(fsdp_param) -> str | None:
    """Why TIDE cannot place this parameter (FSDP2 must gather it), or None."""
    if fsdp_param.fsdp_placement.dim != 0:
        return f"Shard({fsdp_param.fsdp_placement.dim}) placement"
    if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
        return "custom fsdp_pre_all_gather extension (e.g. float8 all-gather)"
    if fsdp_param.offload_to_cpu:
        return "CPU offload"
    if getattr(fsdp_param, "keep_unsharded_storage", False):  # torch 2.15
        return "set_keep_unsharded_storage(True)"
    return None


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``id(FSDPParam) -> its parameter's FQN in model``, as FSDP2's ``_init_fqns``
    finds it (which sets ``_param_fqn`` only at lazy init, after ``comm.apply``)."""
    by_param = {
        id(fp.sharded_param): fp for _, g in fsdp_param_groups(model) for fp in g.fsdp_params
    }
    return {
        id(by_param[id(p)]): name for name, p in model.named_parameters() if id(p) in by_param
    }


def param_fqn(fsdp_param, fqns: dict[int, str]) -> str:
    """The FQN of ``fsdp_param`` (``fqns``: :func:`param_fqns`; FSDP2's own once set)."""
    return (
        fqns.get(id(fsdp_param))
        or getattr(fsdp_param, "_param_fqn", None)
        or f"param{tuple(fsdp_param._orig_size)}"
    )


def shard_bytes(param_group, which: str, align: int = 1) -> int:
    """Bytes of one rank's shards of a group, each parameter rounded up to
    ``align`` bytes. ``which="param"``: in the all-gather dtype, which is also
    the dtype of the gradients TIDE-RS reads (FSDP2 computes gradients in
    ``param_dtype``; torch 2.15 keeps them there where it defers autograd's upcast).
    ``"reduce"``: in the dtype FSDP accumulates unsynced gradients in
    (:func:`accumulate_dtype`)."""
    total = 0
    for fp in param_group.fsdp_params:
        if which == "reduce":
            dtype = accumulate_dtype(fp, param_group)
        else:
            dtype = ag_dtype(fp, param_group)
        nbytes = fp._sharded_param_data.numel() * dtype.itemsize
        total += -(-nbytes // align) * align
    return total


def unsharded_bytes(param_group, world_size: int, align: int = 1) -> int:
    """Bytes of a group's unsharded parameters as FSDP2 all-gathers them (every rank's
    padded shard, in the all-gather dtype), each parameter rounded up to ``align`` bytes:
    what the windows' in-place all-gather holds in its arena for the group."""
    total = 0
    for fp in param_group.fsdp_params:
        itemsize = ag_dtype(fp, param_group).itemsize
        nbytes = world_size * fp._sharded_param_data.numel() * itemsize
        total += -(-nbytes // align) * align
    return total
