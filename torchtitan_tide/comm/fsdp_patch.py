"""The dispatching wrappers: the only place FSDP2's collectives are sent to TIDE.

Why rebinding names: ``_fsdp_param_group`` imports ``foreach_all_gather``,
``foreach_all_gather_copy_out`` and ``foreach_reduce`` by name, so
FSDPParamGroup.unshard / wait_for_unshard / post_backward call whatever those
module globals are. The public hooks (``set_custom_all_gather``,
``set_custom_reduce_scatter``) only see FSDP's flat buffers and cannot remove
the copy-in, copy-out or ``chunk_cat``. We rebind the three globals to
dispatching wrappers (every read of FSDP2 internals is in ``fsdp_internals``):

- a group marked by :func:`mark` (``param_group._tide_ag_state``) in the
  sharded state and called with the group the plan was built for goes to
  TIDE-AG; every other call (unmarked groups, other models, the post-forward
  mesh of ``reshard_after_forward=int``, a custom comm set after install) goes
  to the original function;
- a reduce of a group marked ``param_group._tide_rs_state`` goes to TIDE-RS
  (``reduce_scatter.try_reduce``, one call), which runs it or logs, once per
  group and reason, why it takes FSDP2's path (its dtypes; here found: a custom
  reduce-scatter set after install, another reduce-scatter process group);
- the wrappers are installed once (refcounted per model, :func:`acquire` /
  :func:`release`) and the originals restored when the last model is removed.
  If something else rebinds those names after TIDE, TIDE is bypassed: the first
  forward of a TIDE model says so (:func:`check_not_bypassed`).

``unshard``/``wait_for_unshard``/``reshard``/``post_backward`` are untouched,
so prefetching, resharding and FSDP's stream/event protocol stay FSDP2's. Two methods are
wrapped as well:

- ``FSDPParam.free_unsharded_param`` (FSDP2's reshard of one parameter), so that a
  parameter whose unsharded storage a transport pointed at its own memory
  (:func:`hold_unsharded`: the windows' in-place all-gather) is handed back to that
  transport first; every other parameter goes straight to FSDP2's method.
- ``FSDPParamGroup.finalize_backward``: FSDP2 drops an all-gather that was issued and never
  waited for (a backward prefetch of a group whose backward does not run: frozen layers,
  a partial forward) without a reshard. After FSDP2's method, a group whose dropped
  all-gather was TIDE's frees its unsharded parameters as a reshard would
  (``free_unsharded_param``, so an in-place range goes back to its window's arena and the
  storages of the other transports are freed as stock FSDP2 never allocated them).
Which groups are marked, and with what, is decided by ``comm/install.py``.
"""

from __future__ import annotations

import collections
import logging
import weakref

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from . import fsdp_internals
from .all_gather import (
    TideAllGatherResult,
    TideGroupState,
    tide_all_gather,
    tide_all_gather_copy_out,
)
from .fsdp_internals import fsdp_param_groups
from .reduce_scatter import TideRSState, try_reduce
from .transport import clear_global_ranks

__all__ = [
    "acquire", "check_not_bypassed", "drop_unsharded", "fsdp_param_groups", "hold_unsharded",
    "installed_refcount", "mark", "release", "unmark",
]  # fmt: skip

logger = logging.getLogger(__name__)

_GROUP_ATTR = "_tide_ag_state"
_RS_ATTR = "_tide_rs_state"
_originals: dict[str, object] = {}
_refcount = 0
_bypass_warned: set[str] = set()
# id(param_group.fsdp_params) -> weakref(param_group): the wrappers only see
# FSDP's ``fsdp_params`` list, so this finds the group (identity re-checked).
_groups_by_params: dict[int, weakref.ref] = {}
# id(FSDPParam) -> weakref(param_group): foreach_reduce gets a new list of
# the group's parameters that have gradients.
_groups_by_param: dict[int, weakref.ref] = {}
# id(FSDPParam) -> the transport holding its unsharded storage (``release(fsdp_param)``).
_held: dict[int, object] = {}
_FREE = "free_unsharded_param"
_FINALIZE = "finalize_backward"
# All-gathers of TIDE that FSDP2 dropped at the end of a backward and TIDE resharded, per
# group name (tests assert the path ran).
dropped_all_gathers: collections.Counter = collections.Counter()
_semantics_logged = False  # REDUCE_DTYPE_SEMANTICS: once per process


def mark(param_group, ag_state: TideGroupState, rs_state: TideRSState | None) -> None:
    """Send ``param_group``'s all-gathers (and, with ``rs_state``, its reduces) to TIDE."""
    setattr(param_group, _GROUP_ATTR, ag_state)
    _groups_by_params[id(param_group.fsdp_params)] = weakref.ref(param_group)
    if rs_state is not None:
        setattr(param_group, _RS_ATTR, rs_state)
        for fp in param_group.fsdp_params:
            _groups_by_param[id(fp)] = weakref.ref(param_group)


def unmark(param_group) -> None:
    """Undo :func:`mark`: the group takes FSDP2's path again."""
    for attr in (_GROUP_ATTR, _RS_ATTR):
        if hasattr(param_group, attr):
            delattr(param_group, attr)
    _groups_by_params.pop(id(param_group.fsdp_params), None)
    for fp in param_group.fsdp_params:
        _groups_by_param.pop(id(fp), None)


def _tide_state_for(fsdp_params, group) -> TideGroupState | None:
    ref = _groups_by_params.get(id(fsdp_params))
    param_group = ref() if ref is not None else None
    if param_group is None or param_group.fsdp_params is not fsdp_params:
        return None
    state: TideGroupState | None = getattr(param_group, _GROUP_ATTR, None)
    if state is None:
        return None
    if group is not state.group or any(
        fp.sharded_state != ShardedState.SHARDED for fp in fsdp_params
    ):
        _say_other_group_once(param_group, state.fqn)
        return None
    if getattr(param_group, "_all_gather_comm", None) is not state.fsdp_comm:
        _warn_custom_all_gather(param_group, state.fqn)
        return None
    return state


def _say_other_group_once(param_group, fqn: str) -> None:
    """An all-gather of a TIDE group on another process group or from another sharded
    state (the post-forward mesh of ``reshard_after_forward=int``) is FSDP2's, said once."""
    if not getattr(param_group, "_tide_other_group_logged", False):
        param_group._tide_other_group_logged = True
        logger.info(
            "TIDE %s: all-gathers on another process group than the one TIDE-AG was set up "
            "on (e.g. the post-forward mesh of reshard_after_forward=int) take FSDP2's path",
            fqn,
        )


def _warn_custom_all_gather(param_group, fqn: str) -> None:
    """A custom all-gather set on a TIDE group after install wins: FSDP2's path, said
    once (a custom reduce-scatter is one of ``_dispatch_reason``'s logged reasons)."""
    if not getattr(param_group, "_tide_custom_comm_logged", False):
        param_group._tide_custom_comm_logged = True
        logger.warning(
            "TIDE %s: %s set after comm.apply (set_custom_all_gather); FSDP2's path runs "
            "it from now on",
            fqn, fsdp_internals.custom_comm_reason(param_group) or "a custom all-gather",
        )  # fmt: skip


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


def _rs_state_for(fsdp_params) -> tuple[TideRSState, object] | None:
    """``(TIDE-RS state, FSDPParamGroup)`` of a reduce of a TIDE-RS group, else None."""
    if not fsdp_params:
        return None
    ref = _groups_by_param.get(id(fsdp_params[0]))
    param_group = ref() if ref is not None else None
    state: TideRSState | None = getattr(param_group, _RS_ATTR, None)
    if state is None:
        return None
    members = {id(fp) for fp in param_group.fsdp_params}
    if any(id(fp) not in members for fp in fsdp_params):
        return None
    return state, param_group


def _dispatch_reason(state: TideRSState, param_group, reduce_scatter_group) -> str | None:
    """Why a reduce of a TIDE-RS group must take FSDP2's path because of how FSDP2
    calls it (another reduce-scatter process group, a custom reduce-scatter set after
    ``comm.apply``), or None."""
    if reduce_scatter_group is not state.group:
        return (
            "its reduce-scatter process group is no longer the all-gather group TIDE-RS "
            "was set up on (set_separate_reduce_scatter_group or a new mesh after "
            "comm.apply)"
        )
    if getattr(param_group, "_reduce_scatter_comm", None) is state.fsdp_comm:
        return None
    custom = fsdp_internals.custom_comm_reason(param_group) or "a custom reduce-scatter"
    return f"{custom} set after comm.apply (set_custom_reduce_scatter)"


def _foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs):
    found = _rs_state_for(fsdp_params)
    if found is not None:
        state, param_group = found
        call = fsdp_internals.REDUCE_SIGNATURE.bind(
            fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs
        )
        call.apply_defaults()
        reason = _dispatch_reason(state, param_group, reduce_scatter_group)
        result = try_reduce(
            state, param_group, fsdp_params, unsharded_grads, call.arguments, reason
        )
        if result is not None:
            if fsdp_internals.REDUCE_RETURNS_STREAM:
                return tuple(result)
            return (result[0], result[1], *result[3:])
    return _originals["foreach_reduce"](
        fsdp_params, unsharded_grads, reduce_scatter_group, *args, **kwargs
    )


def hold_unsharded(fsdp_param, owner) -> None:
    """``owner`` pointed ``fsdp_param``'s unsharded storage at its own memory: FSDP2's next
    free of it calls ``owner.release(fsdp_param)`` first."""
    _held[id(fsdp_param)] = owner


def drop_unsharded(fsdp_param) -> None:
    """Forget :func:`hold_unsharded` (the owner took the storage back itself)."""
    _held.pop(id(fsdp_param), None)


def _free_unsharded_param(self) -> None:
    owner = _held.pop(id(self), None)
    if owner is not None:
        owner.release(self)
    return _originals[_FREE](self)


def _finalize_backward(self) -> None:
    dropped = isinstance(getattr(self, "_all_gather_result", None), TideAllGatherResult)
    _originals[_FINALIZE](self)
    if dropped:  # FSDP2 waited for it (current stream) and forgot it: reshard its storage
        dropped_all_gathers[getattr(self, "_module_fqn", "")] += 1
        logger.debug("TIDE %s: an all-gather FSDP2 dropped at the end of the backward is "
                     "resharded", getattr(self, "_module_fqn", "?"))  # fmt: skip
        for fsdp_param in self.fsdp_params:
            fsdp_param.free_unsharded_param()


_methods = {(FSDPParam, _FREE): _free_unsharded_param,
            (FSDPParamGroup, _FINALIZE): _finalize_backward}  # fmt: skip

_wrappers = {
    "foreach_all_gather": _foreach_all_gather,
    "foreach_all_gather_copy_out": _foreach_all_gather_copy_out,
    "foreach_reduce": _foreach_reduce,
}


def acquire() -> None:
    """Rebind FSDP2's three names to the wrappers (first model) or count one more; the
    first call of the process logs how this torch defines FSDP2's reduce dtype."""
    global _refcount, _semantics_logged
    if not _semantics_logged:
        _semantics_logged = True
        logger.info("TIDE: torch %s: %s", torch.__version__, fsdp_internals.REDUCE_DTYPE_SEMANTICS)
    if _refcount == 0:
        for name in fsdp_internals.PATCHED_NAMES:
            _originals[name] = fsdp_internals.get_patched(name)
            fsdp_internals.set_patched(name, _wrappers[name])
        for (cls, name), wrapper in _methods.items():
            _originals[name] = getattr(cls, name)
            setattr(cls, name, wrapper)
        _bypass_warned.clear()
    _refcount += 1


def release() -> None:
    """One model fewer; the last one restores FSDP2's functions."""
    global _refcount
    _refcount -= 1
    if _refcount == 0:
        for name in fsdp_internals.PATCHED_NAMES:
            if fsdp_internals.get_patched(name) is _wrappers[name]:
                fsdp_internals.set_patched(name, _originals.pop(name))
            else:
                _originals.pop(name)
                logger.warning(
                    "TIDE: FSDP2's %s was rebound by someone else after TIDE; not restoring",
                    name,
                )
        for (cls, name), wrapper in _methods.items():
            original = _originals.pop(name)
            if getattr(cls, name) is wrapper:
                setattr(cls, name, original)
            else:
                logger.warning("TIDE: %s.%s was rebound by someone else after TIDE; "
                               "not restoring", cls.__name__, name)  # fmt: skip
        _held.clear()
        clear_global_ranks()


def installed_refcount() -> int:
    """Number of models with TIDE-AG installed (the wrappers are live iff > 0)."""
    return _refcount


def check_not_bypassed(module: nn.Module, args: object) -> None:
    """Forward pre-hook of a TIDE model: warn once per name if FSDP2's functions
    were rebound by someone else after TIDE (then TIDE is silently bypassed)."""
    for name in fsdp_internals.PATCHED_NAMES:
        if name not in _bypass_warned and fsdp_internals.get_patched(name) is not _wrappers[name]:
            _bypass_warned.add(name)
            logger.warning(
                "TIDE: FSDP2's %s was rebound after comm.apply(mode='tide') by %r; TIDE is "
                "bypassed for it until that is undone",
                name, fsdp_internals.get_patched(name),
            )  # fmt: skip
