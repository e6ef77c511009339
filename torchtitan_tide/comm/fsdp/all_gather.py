"""TIDE-AG: all-gather straight into each parameter's unsharded storage.

Replaces, for TIDE groups only, FSDP2's flat buffer + copy-in + collective +
``split_with_sizes_copy`` copy-out. FSDP2's ``unshard``/``wait_for_unshard``
stay in charge; they call :func:`tide_all_gather` (in place of
``foreach_all_gather``) and :func:`tide_all_gather_copy_out` (in place of
``foreach_all_gather_copy_out``) through ``patch``.

Streams and ownership (CUDA):

- All TIDE work runs on one TIDE all-gather stream per device, which first
  waits for the copy-in and all-gather streams FSDP passed in: FSDP already
  ordered those after the optimizer step / reshard events, so reading the
  sharded parameters there is safe. One stream per device also serializes all
  TIDE all-gathers, which the copy-engine slot protocol relies on.
- The unsharded storage (``fsdp_param.all_gather_outputs[0]``) is allocated
  by FSDP's own ``alloc_all_gather_outputs`` on the TIDE stream (unless the transport
  points it at its own memory: ``bind_in_place``, the windows' in-place all-gather, whose
  ``release`` FSDP2's free then calls), written there
  and read/freed by FSDP on the compute stream (the stream current when
  ``unshard`` was called). ``record_stream(compute)`` makes the caching
  allocator wait for the compute stream before reusing the block after FSDP's
  ``reshard`` frees it; the compute stream reads it only after
  ``tide_all_gather_copy_out`` made it wait for the returned event.
- Run-ahead bound: the host may issue at most ``_UNSHARDS_AHEAD`` TIDE
  all-gathers beyond the compute stream's progress (it waits, on the host,
  for the compute stream to reach the point where the all-gather
  ``_UNSHARDS_AHEAD`` calls back was issued, as FSDP1's
  ``limit_all_gathers`` did). Without it the caching allocator cannot reuse
  blocks FSDP freed on the compute stream (their ``record_stream`` events are
  still pending while the host runs ahead) and TIDE's pool grows by several
  layers of unsharded parameters.
- Writes into the storage are hidden from autograd's version counter
  (``torch.autograd._unsafe_preserve_version_counter``), exactly as FSDP's
  copy-out does, or backward fails with "modified by an inplace operation".

The returned :class:`TideAllGatherResult` is an ``AllGatherResult`` (FSDP waits
its event/work in ``_reset_iter_state``/``finalize_backward``) with an empty
``all_gather_output``: there is no flat buffer to keep alive.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult

from ..base import streams, watchdog
from ..plans.plan import GroupPlan
from ..transports import AllGatherTransport

__all__ = [
    "TideAllGatherResult",
    "TideGroupState",
    "set_debug_hooks",
    "tide_all_gather",
    "tide_all_gather_copy_out",
]

logger = logging.getLogger(__name__)


class TideAllGatherResult(AllGatherResult):
    """An ``AllGatherResult`` produced by TIDE-AG (the type marks it for the
    copy-out dispatch). ``all_gather_output`` is an empty tensor; the data is
    already in the parameters' storage once ``all_gather_event`` (CUDA) is
    reached and ``all_gather_work`` (if any) is waited."""

    __slots__ = ()


@dataclass
class TideGroupState:
    """TIDE state of one FSDPParamGroup, made by ``install``, read by ``patch``.

    ``group`` is the process group the plan was built for; a call with another
    group (e.g. the post-forward mesh of ``reshard_after_forward=int``) takes
    FSDP2's own path."""

    plan: GroupPlan
    transport: AllGatherTransport
    group: dist.ProcessGroup
    fqn: str
    # The group's FSDP2 all-gather comm object at install; another one later
    # (set_custom_all_gather) sends the group back to FSDP2's path.
    fsdp_comm: object = None


# Test hooks: called with the list of unsharded storages before the transport
# writes them (e.g. fill with NaN) and after the all-gather completed.
_debug_hooks: dict[str, Callable[[list[torch.Tensor]], None] | None] = {
    "before": None,
    "after": None,
}

_UNSHARDS_AHEAD = 1
# Per device: compute-stream events recorded at each TIDE all-gather's issue.
_issue_marks: dict[torch.device, collections.deque] = {}


def set_debug_hooks(
    before: Callable[[list[torch.Tensor]], None] | None = None,
    after: Callable[[list[torch.Tensor]], None] | None = None,
) -> None:
    """Install (or clear with ``None``) test hooks on the unsharded storages.
    ``after`` runs on the host after the data is complete (it synchronizes the
    TIDE stream on CUDA): for tests only."""
    _debug_hooks["before"], _debug_hooks["after"] = before, after


@torch.no_grad()
def tide_all_gather(
    state: TideGroupState,
    fsdp_params: list,
    group: dist.ProcessGroup,
    all_gather_copy_in_stream: torch.Stream,
    all_gather_stream: torch.Stream,
    device: torch.device,
) -> TideAllGatherResult:
    """All-gather every parameter of one FSDP group into its unsharded storage.

    ``fsdp_params`` are all in ``ShardedState.SHARDED`` (the caller checks).
    Returns with all transport work enqueued on the TIDE stream (CUDA) or done
    (CPU backends wait inside the transport)."""
    plan = state.plan
    world = plan.layout.world_size
    if device.type == "cuda":
        compute_stream = torch.cuda.current_stream(device)
        marks = _issue_marks.setdefault(device, collections.deque())
        marks.append(compute_stream.record_event())
        while len(marks) > _UNSHARDS_AHEAD:  # bound the host's run-ahead (see module doc)
            watchdog.wait_event(marks.popleft(), "TIDE-AG run-ahead bound (compute stream)",
                                group.group_name, watchdog.group_ranks(group))  # fmt: skip
        stream = streams.stream("tide", device)
        stream.wait_stream(all_gather_copy_in_stream)
        if all_gather_stream is not all_gather_copy_in_stream:
            stream.wait_stream(all_gather_stream)
        stream_ctx = torch.cuda.stream(stream)
    else:
        compute_stream, stream = None, None  # CPU: no stream ordering
        stream_ctx = contextlib.nullcontext()
    with stream_ctx:
        inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        for fsdp_param, p in zip(fsdp_params, plan.params):
            inp = fsdp_param._sharded_param_data
            # FSDP's own all-gather dtype rule (param_dtype is None = no cast).
            dtype = fsdp_param.param_dtype if fsdp_param.param_dtype is not None else inp.dtype
            inputs.append(inp)
            fsdp_param.init_all_gather_outputs([p.shard_numel], [dtype], world, device)
            outputs.append(fsdp_param.all_gather_outputs[0])
        # In place (windows across nodes, any N x L): the storages now point into the window.
        bind = getattr(state.transport, "bind_in_place", None)
        in_place = bind is not None and bind(plan, fsdp_params, outputs, state.fqn)
        try:
            work = _write_shards(state, fsdp_params, inputs, outputs, group, compute_stream,
                                 in_place)  # fmt: skip
        except BaseException:
            if in_place:  # the next all-gather must not run this one's bound plan
                state.transport.cancel_pending()
            raise
        event = stream.record_event() if compute_stream is not None else None
        if (hook := _debug_hooks["after"]) is not None:
            if work is not None:
                work.wait()
                work = None
            if event is not None:
                event.synchronize()
            hook(outputs)
    return TideAllGatherResult(streams.empty_on(device), event, work, [], [], [])


def _write_shards(
    state: TideGroupState,
    fsdp_params: list,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    group: dist.ProcessGroup,
    compute_stream: torch.Stream | None,
    in_place: bool,
) -> dist.Work | None:
    """Allocate the unsharded storages (unless bound ``in_place``), write the own shards and
    run the transport, on the stream current here (TIDE's); returns its work, if any."""
    plan, rank = state.plan, state.plan.rank
    if not in_place:
        for fsdp_param, out in zip(fsdp_params, outputs):
            fsdp_param.alloc_all_gather_outputs()
            if compute_stream is not None:
                # Allocated on the TIDE stream, freed by FSDP on the compute stream.
                out.record_stream(compute_stream)
    guarded = tuple(o for o in outputs if not o.is_inference())
    preserve = (
        torch.autograd._unsafe_preserve_version_counter(guarded)
        if guarded
        else contextlib.nullcontext()
    )
    with preserve:
        if (hook := _debug_hooks["before"]) is not None:
            # In place, peers may already have put into the storages: only the own
            # shards are poisoned here (the transport poisons a range on release).
            hook(outputs if not in_place else [
                o.narrow(0, p.dst_offset(rank), p.shard_numel)
                for o, p in zip(outputs, plan.params)
            ])  # fmt: skip
        # Own shard: one cast-copy per parameter (FSDP's copy-in does the
        # same fp32 -> bf16 cast with the same rounding), unless the
        # transport writes it itself (copy engine: from its packed slot).
        if not getattr(state.transport, "writes_own_shard", False):
            own = [
                o.narrow(0, p.dst_offset(rank), p.shard_numel)
                for o, p in zip(outputs, plan.params)
            ]
            torch._foreach_copy_(own, inputs)
        return state.transport.gather(plan, inputs, outputs, group)


@torch.no_grad()
def tide_all_gather_copy_out(result: TideAllGatherResult) -> None:
    """Make the current (compute) stream wait for a TIDE all-gather. No copy:
    the data is already in the parameters' storage."""
    if result.all_gather_event is not None:
        device = result.all_gather_output.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(result.all_gather_event)
    if isinstance(result.all_gather_work, dist.distributed_c10d.Work):
        result.all_gather_work.wait()
