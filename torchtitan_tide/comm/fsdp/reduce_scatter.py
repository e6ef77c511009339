"""TIDE-RS: per-parameter bf16 gradients reduced into fp32 shards, in two phases.

Replaces, for TIDE groups only, FSDP2's ``foreach_reduce`` (``chunk_cat`` of
every gradient into a flat full-group fp32 buffer, then one NCCL
reduce-scatter); ``patch`` dispatches to :func:`try_reduce`, which
decides whether TIDE-RS can take the reduce (or logs, once per reason, why
FSDP2's path takes it) and runs :func:`tide_reduce`. This module decides and
orders; it sends nothing to a peer and sums nothing received: per round the
node-local transport (``reduce_rows``), per other node the cross-node transport
(``reduce_partial``), each summing what it received into the output with
``kernels``. None of them calls back into this module. What stays here is local:
rounding a partial to the wire dtype, zeroing padding, the HSDP partial sum and
the hand-off to FSDP.

Phase 1, node-local (``plan.rs_schedule``): every rank pushes its slices of
its gradients, read where autograd left them, into local peers' staging rows
(copy engine: one ``cudaMemcpyBatchAsync`` per round into symmetric memory;
or send/recv), then the transport sums the rows it received in fp32 with a
few-CTA kernel (``kernels.accumulate_beside``). bf16 moves, fp32 accumulates.

Phase 2, cross-node (more than one node): each fp32 partial goes to the rank
of the same local index on its node through the cross-node transport
(``transports.p2p.P2PCrossNode``: NCCL send/recv, gloo on CPU; or
``transports.windows.ring.OneSidedCrossNode``: NCCL puts), the received partial is
added into the output (in fp32). On the wire the
partial is fp32, or with ``[tide] rs_wire_dtype = "bfloat16"`` rounded once to
bf16 (:func:`round_to_wire`: half the bytes, one bf16 rounding per partial;
docs/design/2026-12-02-rs-wire.md). It runs on its own stream:
phase 1 of the next chunk or FSDP group never waits for it, only for a free
buffer of the ``rs_inflight`` ring.

Streams and ownership (CUDA):

- ``comm``: the stream of phase 1 (TIDE's all-gather stream when the slots are
  shared with TIDE-AG, so both follow one slot protocol; else FSDP's
  reduce-scatter stream). It first waits for the compute stream (the
  gradients are ready when FSDP calls us). Gradients are read on it, so each
  gets ``record_stream(comm)`` before FSDP drops its references.
- ``cross``: one stream per device for phase 2 (``streams``; the one-sided
  transport's puts and waits run beside it on their own). The output is
  allocated on ``comm`` and ``record_stream(cross)``-ed when phase 2 writes it.
- The output (``[sum of padded shard numels]`` fp32, FSDP's reduce-output
  layout) becomes the sharded gradients (views) exactly as in FSDP2, on the
  stream of the last write (``post_reduce_stream``), which records the
  post-reduce event FSDP waits before the optimizer.
- The partial ring and the wire send buffer are owned by :class:`RSBuffers`,
  staging rows and receive buffers by the transports (one per process group and
  device); all live until ``comm.remove``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..base import kernels, streams
from ..base.poison import poisoned as _poisoned
from ..base.poison import set_poison
from ..options import RS_WIRE_DTYPES
from ..plans.plan import RSChunk, RSPlan, WorldLayout, build_rs_plan
from ..transports import CrossNodeTransport, ReduceScatterTransport
from . import internals as fsdp_internals
from .internals import ReduceDtypes

__all__ = [
    "WIRE_DTYPES",
    "GradientSetMismatch",
    "RSBuffers",
    "TideRSState",
    "TideReduceResult",
    "check_gradient_sets",
    "round_to_wire",
    "rows_per_round",
    "rs_numerics_note",
    "rs_unsupported_reason",
    "set_poison",
    "tide_reduce",
    "try_reduce",
    "wire_label",
]

logger = logging.getLogger(__name__)

# ``[tide] rs_wire_dtype`` -> the dtype of TIDE-RS's cross-node partials on the wire.
WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in RS_WIRE_DTYPES}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass
class RSBuffers:
    """Phase-2 buffers of one process group on one device (grown to the largest
    group on first use): a ring of ``inflight`` fp32 partials, each with the
    event after which phase 2 no longer reads it; (wire dtype other than fp32)
    one send buffer in ``wire_dtype``. The receive buffer is the cross-node
    transport's.

    One send buffer suffices: phase 2 runs in order on one stream (``cross``; the
    host on CPU), and waits for each send on it before the accumulate, so the
    next rounding into ``send`` comes after the previous transfer finished with it."""

    inflight: int
    wire_dtype: torch.dtype = torch.float32
    partials: list[torch.Tensor] = field(default_factory=list)
    partial_free: list[torch.Event | None] = field(default_factory=list)
    send: torch.Tensor | None = None
    next_partial: int = 0
    sent_bytes: int = 0  # phase-2 bytes this rank posted to other nodes (benchmarks read it)
    # the ring is a set of views of a registered window (one-sided): never reallocated
    partials_fixed: bool = False

    def take_partial(self, numel: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """The next ring slot and an fp32 view of ``numel`` elements; on CUDA the
        current stream waits until phase 2 released that slot."""
        if not self.partials or self.partials[0].numel() < numel:
            if self.partials_fixed:
                raise RuntimeError(
                    f"TIDE-RS: a partial of {numel} elements exceeds the one-sided window's "
                    f"send slots ({self.partials[0].numel()}), sized at install for the "
                    "largest FSDP group; set [tide] cross_node_transport = 'p2p'"
                )
            # Phase 2 may still be sending from the old buffers (on another stream):
            # the stream that reallocates waits for it before the memory is reused.
            for event in self.partial_free:
                if event is not None:
                    torch.cuda.current_stream(device).wait_event(event)
            self.partials = [
                torch.empty(numel, dtype=torch.float32, device=device) for _ in range(self.inflight)
            ]
            self.partial_free = [None] * self.inflight
        k = self.next_partial
        self.next_partial = (k + 1) % self.inflight
        if (event := self.partial_free[k]) is not None:
            torch.cuda.current_stream(device).wait_event(event)
            self.partial_free[k] = None
        return k, _poisoned(self.partials[k].narrow(0, 0, numel))

    def take_send(self, numel: int, device: torch.device) -> torch.Tensor:
        """A ``wire_dtype`` view of ``numel`` elements to round a partial into (phase 2's stream)."""
        if self.send is None or self.send.numel() < numel:
            self.send = torch.empty(numel, dtype=self.wire_dtype, device=device)
        return _poisoned(self.send.narrow(0, 0, numel))


def round_to_wire(partial: torch.Tensor, buffers: RSBuffers) -> torch.Tensor:
    """The phase-2 tensor to send for the fp32 ``partial``: ``partial`` itself
    when the wire dtype is fp32, else ``partial`` rounded once (to nearest even,
    as ``Tensor.copy_`` casts) into the send buffer of ``buffers`` (its wire
    dtype), which stays valid until the next call. fp32 gradients are rounded
    alike: the option sets the wire, whatever the gradients' dtype. Runs on the
    current stream (phase 2's)."""
    if buffers.wire_dtype == partial.dtype:
        return partial
    return buffers.take_send(partial.numel(), partial.device).copy_(partial)


@dataclass
class TideRSState:
    """TIDE-RS state of one FSDPParamGroup, made by ``install``, read by ``patch``.

    ``transport`` implements ``reduce_rows`` (copy engine or point-to-point);
    ``cross_node`` the cross-node phase (more than one node; None on one node);
    ``use_tide_stream``: phase 1 runs on TIDE's all-gather stream (slots shared
    with TIDE-AG) instead of FSDP's reduce-scatter stream; ``param_fqns``: the
    FQNs of the group's parameters, in ``fsdp_params`` order (error messages)."""

    layout: WorldLayout
    rank: int
    group: dist.ProcessGroup
    fqn: str
    transport: ReduceScatterTransport
    buffers: RSBuffers
    rows: int
    ctas: int
    use_tide_stream: bool
    # The group's FSDP2 reduce-scatter comm object at install (see TideGroupState).
    fsdp_comm: object = None
    # Phase 2 (``transports.p2p.P2PCrossNode`` or ``transports.windows.ring.OneSidedCrossNode``,
    # shared by the process group's FSDP groups); None on one node.
    cross_node: CrossNodeTransport | None = None
    param_fqns: tuple[str, ...] = ()
    calls: int = 0
    stock_reasons: set[str] = field(default_factory=set)
    # HSDP: the pending partial sum of microbatches without all-reduce is TIDE-RS's.
    partial_from_tide: bool = False
    # The RS plan, built on the first reduce of each shape and reused (pure functions
    # of layout, rank, rows and the gradients' numels; host time on every backward).
    plans: dict[tuple, RSPlan] = field(default_factory=dict)

    def plan_for(self, numels: tuple[int, ...], shard_numels: tuple[int, ...], rows: int) -> RSPlan:
        """The :class:`RSPlan` of one reduce (``plan.build_rs_plan``, cached per shape)."""
        key = (numels, shard_numels, rows)
        if (cached := self.plans.get(key)) is None:
            cached = self.plans[key] = build_rs_plan(
                self.layout, self.rank, rows, list(numels), list(shard_numels)
            )
        return cached


class TideReduceResult(NamedTuple):
    """What FSDP's ``post_backward`` expects from ``foreach_reduce`` (torch
    2.11 returns all but ``post_reduce_stream``; ``patch`` adapts)."""

    reduce_scatter_input: torch.Tensor  # empty: there is no flat input buffer
    reduce_scatter_event: torch.Event | None  # phase 1 done: gradients read
    post_reduce_stream: torch.Stream
    post_reduce_event: torch.Event | None
    all_reduce_input: torch.Tensor | None
    all_reduce_event: torch.Event | None
    partial_reduce_output: torch.Tensor | None


class GradientSetMismatch(RuntimeError):
    """The ranks of an FSDP group reduce different parameter sets (per-rank branches)."""


def check_gradient_sets(state: TideRSState, param_group, fsdp_params: list) -> None:
    """Every rank of the group reduces the same parameters, or raise naming them.

    FSDP2 reduces only the parameters that have a gradient on this rank (unless
    ``set_reduce_scatter_unused_params(True)``); ranks that took different branches
    then reduce different sets, on which stock FSDP2 mixes gradients across
    parameters and TIDE-RS would fail in its transport. One ``all_gather`` of a byte
    per parameter over the group: on every reduce of a CPU group (synchronous
    anyway), and on the first reduce of a CUDA group only (it waits for the device:
    a rank-dependent branch taken from the first step is caught; a later change is
    not, as in stock FSDP2). Collective: every rank of the group calls it alike.

    Raises:
        GradientSetMismatch: naming, per rank, the parameters (FQNs) it has no
            gradient for, and the FSDP2 setting that makes the sets equal.
    """
    members = param_group.fsdp_params
    device = members[0].sharded_param.device
    if state.group.size() == 1 or (state.calls > 0 and device.type == "cuda"):
        return
    present = {id(fp) for fp in fsdp_params}
    mine = torch.tensor([id(fp) in present for fp in members], dtype=torch.uint8, device=device)
    masks = [torch.empty_like(mine) for _ in range(state.group.size())]
    dist.all_gather(masks, mine, group=state.group)
    masks = [m.tolist() for m in masks]
    if all(m == masks[0] for m in masks):
        return
    fqns = state.param_fqns or tuple(f"parameter {i}" for i in range(len(members)))
    missing = {
        rank: [fqn for fqn, has in zip(fqns, m) if not has]
        for rank, m in enumerate(masks)
        if not all(m)
    }
    lines = "; ".join(f"group rank {r} has no gradient for {names}" for r, names in missing.items())
    raise GradientSetMismatch(
        f"TIDE-RS {state.fqn}: the ranks of this FSDP group reduce different parameters "
        f"({lines}), as when ranks take different branches of the model. Stock FSDP2 would "
        "mix gradients across parameters here. Call set_reduce_scatter_unused_params(True) "
        "on the FSDP module (every rank then reduces every parameter, zeros where unused), "
        "or make every rank use the same parameters."
    )


def rs_unsupported_reason(
    grads: list[torch.Tensor],
    dtypes: ReduceDtypes,
    all_reduce_group: dist.ProcessGroup | None = None,
    all_reduce_hook: object = None,
) -> str | None:
    """Why this reduce must take FSDP2's own path, or None. TIDE-RS moves bf16
    or fp32 gradients, each in its own dtype (torch 2.15 hands over both in one group:
    :func:`dtype_runs`), and accumulates in fp32, so FSDP2's reduce dtype
    (``dtypes``, as the running torch defines it: :func:`internals.reduce_dtypes`)
    must be fp32, or the gradients' own dtype with fp32 sharded gradients (then TIDE-RS's
    fp32 sum is more accurate than FSDP2's: :func:`rs_numerics_note`). HSDP runs TIDE-RS on
    the shard group and FSDP2's all-reduce across replicas (``all_reduce_group`` is
    accepted); a user all-reduce hook keeps FSDP2's path."""
    del all_reduce_group
    if all_reduce_hook is not None:
        return "a user all-reduce hook is set: FSDP2's path"
    grad_dtypes = {g.dtype for g in grads}
    if other := sorted(str(d) for d in grad_dtypes - {torch.bfloat16, torch.float32}):
        return f"gradient dtype {', '.join(other)} (TIDE-RS moves bf16 or fp32)"
    if len(grad_dtypes) > 1 and dtypes.reduce is None:  # FSDP2 <= 2.14 refuses these too
        return f"mixed gradient dtypes {sorted(str(d) for d in grad_dtypes)} and no reduce dtype"
    effective = dtypes.reduce or next(iter(grad_dtypes))
    if effective != torch.float32 and (
        grad_dtypes != {effective} or any(o != torch.float32 for o in dtypes.outputs)
    ):
        return f"reduce dtype {effective} (TIDE-RS accumulates and outputs fp32)"
    return None


def rs_numerics_note(grads: list[torch.Tensor], dtypes: ReduceDtypes) -> str | None:
    """What TIDE-RS does differently from FSDP2's numerics for this reduce, or None.

    Where FSDP2's reduce dtype is bf16 with bf16 gradients and fp32 sharded gradients,
    FSDP2 sums in bf16 and casts the bf16 sum to fp32. torch 2.11-2.14 resolve to that
    when ``reduce_dtype`` is unset or equal to ``param_dtype``; 2.15 only when
    ``reduce_dtype=torch.bfloat16`` (unset follows the fp32 ``grad_dtype``). TIDE-RS moves
    the same bf16 gradients but always accumulates in fp32 and keeps the fp32 sum: closer
    to the exact sum, not bitwise FSDP2's (docs/design/2026-12-01-cluster-layouts.md)."""
    bf16_grads = bool(grads) and grads[0].dtype == torch.bfloat16
    if bf16_grads and (dtypes.reduce or torch.bfloat16) == torch.bfloat16:
        why = (
            "MixedPrecisionPolicy reduce_dtype=bf16"
            if fsdp_internals.PER_PARAM_GRAD_DTYPE
            else "MixedPrecisionPolicy reduce_dtype unset or equal to param_dtype"
        )
        return (
            f"reduce dtype resolves to bf16 ({why}): FSDP2 would sum in bf16; TIDE-RS moves "
            "bf16 and sums in fp32 into the fp32 gradient (more accurate; [tide] "
            "reduce_scatter = 'fsdp2' keeps FSDP2's bf16 sum)"
        )
    return None


def wire_label(wire_dtype: torch.dtype) -> str:
    """How logs name phase 2's wire dtype, after its transport: "wire bf16"."""
    return f"wire {_SHORT.get(wire_dtype, str(wire_dtype))}"


def dtype_runs(grads: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of consecutive gradients of one dtype, in order: one range
    for a group of one gradient dtype. torch 2.15 leaves each gradient in the dtype autograd
    computes it in (FSDP2 defers the upcast to ``grad_dtype``), so one FSDP group may hand
    over bf16 gradients (matmul weights) beside fp32 ones (norm weights computed in fp32,
    TP-replicated parameters FSDP2 keeps in fp32); TIDE-RS moves each run in its dtype into
    its contiguous range of the output, where FSDP2 casts both to fp32
    (docs/design/2026-12-07-torch-versions.md)."""
    runs: list[tuple[int, int]] = []
    for i, g in enumerate(grads):
        if runs and grads[runs[-1][0]].dtype == g.dtype:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def rows_per_round(state: TideRSState, shard_numel: int, itemsize: int) -> int:
    """Source rows per round for a reduce of ``shard_numel`` elements of
    ``itemsize`` bytes: ``state.rows``, fewer when the transport's staging slot
    cannot hold them (e.g. fp32 gradients accumulated without sync in slots
    sized for bf16: one row per round instead of two); 0 = does not fit."""
    capacity = getattr(state.transport, "staging_capacity", None)
    rows = min(state.rows, state.layout.local_world_size)
    if capacity is None or shard_numel == 0:
        return rows
    return min(rows, capacity // (shard_numel * itemsize))


def stock_reason(
    state: TideRSState, fsdp_params: list, unsharded_grads: list[torch.Tensor], call: dict,
    dispatch_reason: str | None = None,
) -> tuple[str | None, tuple[int, ...]]:
    """``(why this reduce must take FSDP2's path or None, TIDE-RS rows per round of each
    dtype run (:func:`dtype_runs`))``
    for FSDP2's ``foreach_reduce`` arguments ``call``; ``dispatch_reason``: the
    dispatcher's reason (a custom reduce-scatter set after ``comm.apply``, another
    reduce-scatter process group), checked first.

    Raises:
        RuntimeError: FSDP2's path would mix the two paths' partial sums of HSDP
            microbatches without all-reduce (TIDE's are divided already, FSDP2's
            are not: a silent scale error).
    """
    reason, rows = dispatch_reason, ()
    if reason is None:
        reason = rs_unsupported_reason(
            unsharded_grads, fsdp_internals.reduce_dtypes(call, fsdp_params),
            call["all_reduce_group"], call["all_reduce_hook"],
        )  # fmt: skip
    for start, stop in dtype_runs(unsharded_grads) if reason is None else ():
        shard_numel = sum(fp._sharded_param_data.numel() for fp in fsdp_params[start:stop])
        dtype = unsharded_grads[start].dtype
        rows += (rows_per_round(state, shard_numel, dtype.itemsize),)
        if rows[-1] == 0:
            reason = (
                f"{shard_numel} x {dtype} gradients per shard do not fit "
                "one staging row of the copy-engine slots"
            )
            break
    pending = call.get("partial_reduce_output") is not None
    if reason is not None and pending and state.partial_from_tide:
        raise RuntimeError(
            f"TIDE-RS {state.fqn}: this reduce must take FSDP2's path ({reason}) while a "
            "partial sum of microbatches without all-reduce from TIDE-RS is pending; the two "
            "paths scale partial sums differently. Change custom comms only right after an "
            "optimizer step."
        )
    if reason is None and pending and not state.partial_from_tide:
        reason = "a partial sum of microbatches from FSDP2's path is pending (HSDP)"
    return reason, rows


def _say_stock_once(state: TideRSState, reason: str) -> None:
    """Log, once per group and reason, that a reduce of a TIDE-RS group takes FSDP2's path."""
    if reason not in state.stock_reasons:
        state.stock_reasons.add(reason)
        logger.warning("TIDE-RS %s: FSDP2 reduce-scatter for this reduce: %s", state.fqn, reason)


def try_reduce(
    state: TideRSState,
    param_group,
    fsdp_params: list,
    unsharded_grads: list[torch.Tensor],
    call: dict,
    dispatch_reason: str | None = None,
) -> TideReduceResult | None:
    """One FSDP2 ``foreach_reduce`` of a TIDE-RS group (``call``: its bound
    arguments, defaults applied; ``dispatch_reason``: the dispatcher's reason for
    FSDP2's path, or None): reduced by :func:`tide_reduce`, or None when it must
    take FSDP2's path (:func:`stock_reason`, logged once per reason by
    :func:`_say_stock_once`; nothing was reduced then, the caller runs FSDP2's).
    Collective on the TIDE path (:func:`check_gradient_sets`)."""
    reason, rows = stock_reason(state, fsdp_params, unsharded_grads, call, dispatch_reason)
    if reason is not None:
        _say_stock_once(state, reason)
        return None
    check_gradient_sets(state, param_group, fsdp_params)
    dtypes = fsdp_internals.reduce_dtypes(call, fsdp_params)
    if state.calls == 0 and (note := rs_numerics_note(unsharded_grads, dtypes)):
        logger.info("TIDE-RS %s: %s", state.fqn, note)
    result = tide_reduce(
        state, fsdp_params, unsharded_grads, call["reduce_scatter_stream"],
        dtypes.outputs, call["device"], call["gradient_divide_factor"],
        rows=rows,
        all_reduce_group=call["all_reduce_group"],
        all_reduce_stream=call["all_reduce_stream"],
        all_reduce_grads=call["all_reduce_grads"],
        partial_reduce_output=call["partial_reduce_output"],
    )  # fmt: skip
    state.partial_from_tide = result.partial_reduce_output is not None
    return result


def _stream_ctx(stream: torch.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _divide_factor(
    group: dist.ProcessGroup,
    gradient_divide_factor: float | None,
    all_reduce_group: dist.ProcessGroup | None = None,
) -> float:
    """FSDP2's total division: ``gradient_divide_factor`` if set, else the data
    parallel size (reduce-scatter group x all-reduce group under HSDP). FSDP2
    reaches the same total through AVG / PREMUL_SUM / pre- and post-division,
    depending on backend; TIDE divides once, in its last addition, and the HSDP
    all-reduce then sums."""
    if gradient_divide_factor is not None:
        return float(gradient_divide_factor)
    replicas = all_reduce_group.size() if all_reduce_group is not None else 1
    return float(group.size() * replicas)


def _cross_node_step(
    state: TideRSState,
    partial: torch.Tensor,
    partial_slot: int,
    chunk: RSChunk,
    out: torch.Tensor,
    divisor: float,
    cross: torch.Stream | None,
) -> None:
    """Phase 2 for ``chunk`` (another node's): send ``partial`` (fp32) to its owner
    in the wire dtype (:func:`round_to_wire`) through the cross-node transport, add
    the partial received for this rank (wire dtype) into ``out`` in fp32 (divided by
    ``divisor`` when it is the last addition); the peers are the plan's
    (``chunk.cross_peers``). CUDA: on ``cross``, after phase 1 of this chunk."""
    layout = state.layout
    assert chunk.cross_peers is not None and state.cross_node is not None, (
        "the own node's chunk (or a one-node layout) has no cross-node step"
    )
    send_peer, recv_peer = chunk.cross_peers
    step = (chunk.chunk_node - layout.node_of(state.rank)) % layout.num_nodes
    if cross is not None:
        cross.wait_stream(torch.cuda.current_stream(out.device))
    with _stream_ctx(cross):
        send = round_to_wire(partial, state.buffers)
        state.cross_node.reduce_partial(
            send, send_peer, recv_peer, step, state.group, out, divisor=divisor,
            num_ctas=state.ctas,
        )  # fmt: skip
        state.buffers.sent_bytes += send.numel() * send.element_size()
        if cross is not None:
            partial.record_stream(cross)  # allocated on the phase-1 stream
            state.buffers.partial_free[partial_slot] = cross.record_event()


def _dtypes_text(grads: list[torch.Tensor], runs: list) -> str | None:
    """The gradients' dtype as the first-reduce line prints it: one dtype by name, runs of
    several (torch 2.15: fp32 norm gradients beside bf16 ones) with their shard elements."""
    dtypes = {grads[a].dtype for a, _, _, _ in runs}
    if len(dtypes) <= 1:
        return str(dtypes.pop()) if dtypes else None
    return " + ".join(f"{grads[a].dtype} ({p.shard_numel})" for a, _, _, p in runs)


@torch.no_grad()
def tide_reduce(
    state: TideRSState,
    fsdp_params: list,
    unsharded_grads: list[torch.Tensor],
    reduce_scatter_stream: torch.Stream,
    output_dtypes: tuple[torch.dtype | None, ...],
    device: torch.device,
    gradient_divide_factor: float | None,
    rows: tuple[int, ...],
    all_reduce_group: dist.ProcessGroup | None = None,
    all_reduce_stream: torch.Stream | None = None,
    all_reduce_grads: bool = True,
    partial_reduce_output: torch.Tensor | None = None,
) -> TideReduceResult:
    """Reduce-scatter one FSDP group's gradients with TIDE-RS and hand the fp32
    shards to FSDP exactly as ``foreach_reduce`` does (new ``.grad`` or
    accumulation into it, post-accumulate hooks), each cast to its parameter's
    ``output_dtypes`` entry (``ReduceDtypes.outputs``; None or fp32: no cast).
    ``unsharded_grads`` is cleared (references dropped) as FSDP expects. The caller checked
    ``rs_unsupported_reason`` and chose ``rows`` (>= 1) with :func:`rows_per_round`, one
    entry per dtype run (:func:`dtype_runs`): each run is planned and moved in its own
    dtype into its contiguous range of the output (FSDP's reduce-output layout).

    HSDP (``all_reduce_group``): the TIDE-RS shard is all-reduced (SUM, the
    division already done) across replicas on FSDP's ``all_reduce_stream``, as
    FSDP2 does after its reduce-scatter; with ``all_reduce_grads=False`` (a
    microbatch without sync) the shard is added into ``partial_reduce_output``
    and returned there, and the next synced reduce adds it before the all-reduce."""
    layout, rank = state.layout, state.rank
    num_nodes, node = layout.num_nodes, layout.node_of(rank)
    grads = [
        g.reshape(-1) if g.is_contiguous() else g.contiguous().view(-1) for g in unsharded_grads
    ]
    runs: list[tuple[int, int, int, RSPlan]] = []  # start, stop, output offset, plan
    shard_numel = 0
    for (start, stop), run_rows in zip(dtype_runs(grads), rows, strict=True):
        plan = state.plan_for(
            tuple(g.numel() for g in grads[start:stop]),
            tuple(fp._sharded_param_data.numel() for fp in fsdp_params[start:stop]),
            run_rows,
        )
        runs.append((start, stop, shard_numel, plan))
        shard_numel += plan.shard_numel
    final_divisor = _divide_factor(state.group, gradient_divide_factor, all_reduce_group)
    cuda = device.type == "cuda"
    if cuda:
        comm = streams.stream("tide", device) if state.use_tide_stream else reduce_scatter_stream
        comm.wait_stream(torch.cuda.current_stream(device))
        for g in grads:  # views of autograd's gradients (or contiguous copies of them)
            g.record_stream(comm)
        cross = streams.stream("tide_rs_cross", device) if num_nodes > 1 else None
    else:
        comm = cross = None
    unsharded_grads.clear()
    if state.calls == 0:
        logger.info(
            "TIDE-RS %s: first reduce, %d params, %d elements per shard, %s gradients, "
            "%s, accumulate: %s%s",
            state.fqn, len(grads), shard_numel,
            _dtypes_text(grads, runs),
            layout.shape, kernels.triton_status() if cuda else "torch",
            "" if num_nodes == 1 else
            f", cross-node {state.cross_node.name if state.cross_node else None}, "
            f"{wire_label(state.buffers.wire_dtype)}",
        )  # fmt: skip
    state.calls += 1

    with _stream_ctx(comm):
        out = _poisoned(torch.empty(shard_numel, dtype=torch.float32, device=device))
        if state.cross_node is not None:  # once per reduce, whatever its dtype runs
            state.cross_node.begin_reduce()
        for start, stop, offset, plan in runs:
            run_out, run_grads = out.narrow(0, offset, plan.shard_numel), grads[start:stop]
            for chunk in plan.chunks:
                own = chunk.cross_peers is None
                slot = -1
                if own:
                    target = run_out
                else:
                    slot, target = state.buffers.take_partial(plan.shard_numel, device)
                for rnd, pushes in zip(chunk.rounds, chunk.pushes):
                    divisor = final_divisor if (own and num_nodes == 1 and rnd.last) else 1.0
                    state.transport.reduce_rows(
                        layout, rank, rnd, pushes, run_grads, plan.segments, state.group,
                        target, divisor=divisor, num_ctas=state.ctas,
                    )  # fmt: skip
                if chunk.cross_peers is not None:
                    is_last = chunk.chunk_node == (node + num_nodes - 1) % num_nodes
                    _cross_node_step(
                        state, target, slot, chunk, run_out, final_divisor if is_last else 1.0,
                        cross,
                    )  # fmt: skip
        reduce_scatter_event = _record(comm, reduce_scatter_stream)
    del grads  # the gradients' memory returns to the allocator after phase 1 (record_stream)
    # (segment, its offset in ``out``), in ``fsdp_params`` order
    segments = [(seg, offset + seg.out_offset) for _, _, offset, p in runs for seg in p.segments]
    post_stream = cross if cross is not None else comm
    if cross is not None:
        out.record_stream(cross)
    fsdp_stream = post_stream if post_stream is not None else reduce_scatter_stream
    all_reduce_input = all_reduce_event = None
    with _stream_ctx(post_stream):
        # Padding elements of this rank's shard (never read by FSDP's views) are
        # zero, as in FSDP2's reduce-scatter input.
        for seg, offset in segments:
            valid = seg.valid(rank)
            if valid < seg.shard_numel:
                out.narrow(0, offset + valid, seg.shard_numel - valid).zero_()
        if all_reduce_group is not None:
            if not all_reduce_grads:  # microbatch without sync: keep the partial sum
                if partial_reduce_output is not None:
                    partial_reduce_output += out
                else:
                    partial_reduce_output = out
                return TideReduceResult(
                    streams.empty_on(device), reduce_scatter_event, fsdp_stream,
                    _record(post_stream, fsdp_stream), None, None, partial_reduce_output,
                )  # fmt: skip
            if partial_reduce_output is not None:
                out += partial_reduce_output
    if all_reduce_group is not None:
        if cuda:
            assert all_reduce_stream is not None
            all_reduce_stream.wait_stream(fsdp_stream)
            out.record_stream(all_reduce_stream)
            post_stream = fsdp_stream = all_reduce_stream
        with _stream_ctx(post_stream):
            dist.all_reduce(out, group=all_reduce_group)  # SUM: divided above
            # FSDP holds these across layers so the block outlives the all-reduce.
            all_reduce_input, all_reduce_event = out, _record(post_stream, fsdp_stream)
    with _stream_ctx(post_stream):
        casts = [None if d in (None, torch.float32) else d for d in output_dtypes]
        one_cast = len(set(casts)) == 1 and casts[0] is not None  # one kernel, then views
        grad_out = out.to(casts[0]) if one_cast else out
        for (_, offset), fsdp_param, cast in zip(segments, fsdp_params, casts, strict=True):
            new_sharded_grad = torch.as_strided(
                grad_out,
                size=fsdp_param.sharded_size,
                stride=fsdp_param.contiguous_sharded_stride,
                storage_offset=offset,
            )
            if cast is not None and not one_cast:
                new_sharded_grad = new_sharded_grad.to(cast)
            sharded_param = fsdp_param.sharded_param
            if sharded_param.grad is not None:
                sharded_param.grad._local_tensor += new_sharded_grad
            else:
                sharded_param.grad = fsdp_param.to_sharded_dtensor(new_sharded_grad)
            for hook in (getattr(sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                hook(sharded_param)
        post_reduce_event = _record(post_stream, fsdp_stream)
    return TideReduceResult(
        streams.empty_on(device),
        reduce_scatter_event,
        fsdp_stream,
        post_reduce_event,
        all_reduce_input,
        all_reduce_event,
        None,
    )


def _record(stream: torch.Stream | None, fsdp_stream: torch.Stream) -> torch.Event:
    """An event on ``stream`` (CUDA); on CPU FSDP's own stream object's event,
    exactly what FSDP2's ``foreach_reduce`` returns there."""
    return (stream if stream is not None else fsdp_stream).record_event()
