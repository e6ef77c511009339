"""Event engine of the step simulator: ops on FIFO streams with dependencies, and
ops slowed by what runs beside them.

Pure Python, no torch. An :class:`Op` runs on one stream; each stream runs its ops one
at a time in the order they were given (CUDA stream semantics; one NCCL communicator
is one stream, so its all-gathers and reduce-scatters serialize). An op starts when its
stream is free, every op in ``after`` has ended (CUDA event waits) and every op in
``issued_with`` has started (the host issues it as that op starts: FSDP2's prefetch).

Rates, both directions of interference, and shared links:

- ``slowdown`` (any op): while ops of kinds in its keys run beside it, the op progresses
  at ``1 / (1 + the sum of their fractions)``: a GEMM beside a reduce-scatter
  (``{"rs": 0.27}``) and a copy at once loses both engines' shares (concurrent engines
  add up; measured one at a time, their sum is the model), a collective beside GEMMs
  (``{"compute": 2.2}``: the all-gather took 3.2x as long).
- ``link`` (a shared link: one NIC per GPU, its NVLink, its HBM for local copies): the
  ops running on one link share it; each ``flow`` (a communicator, or a stream) on it
  progresses FIFO (its earliest-started op only), the flows of the highest ``priority``
  split the link equally, lower ones wait (and, waiting, slow nothing beside them).
  ``duration_ms`` is the op alone on its link.
- ``sm_share`` (ops of kind ``sm``: kernels of the comm library on their own stream, e.g.
  TIDE-RS's accumulate): while one runs, every op on the compute stream progresses at
  ``1 - share`` of its rate (share 1: compute pauses). The kernel itself runs at its
  own (measured, alone) duration, so the SM time is conserved.

The time an op on the compute stream loses is SM-ms taken from compute; the time a
communication op loses is comm time added by compute. :func:`simulate` advances from
event to event (an op starts or ends) and returns each op's start and end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

COMPUTE = "compute"  # the compute stream's name
# op kinds off the compute stream (exposure): the generic ones, and the engines of
# ``interference.ENGINES`` the step model uses
COMM_KINDS = ("ag", "rs", "net", "net0", "sm", "nccl", "nccl_symk", "ce", "ce_local", "nic",
              "sm_ag", "sm_rs")  # fmt: skip
SM = "sm"  # kind of an SM-holding kernel off the compute stream (a share of the SMs)
SM_KERNEL_KINDS = ("sm", "sm_ag", "sm_rs")  # comm-library kernels on SMs
_EPS = 1e-9


class SimulationError(ValueError):
    """The ops cannot run: unknown dependency, a cycle, or a negative duration."""


@dataclass(frozen=True)
class Op:
    """One kernel class on one stream.

    ``kind``: ``compute`` / ``layout`` / ``optimizer`` / ``host`` (on the compute
    stream) or a kind of :data:`COMM_KINDS`; ``slowdown``: the fraction it slows by
    beside a running op of each kind; ``sm_share`` (kind ``sm`` only): the share of the
    SMs it holds while it runs (0..1); ``link`` / ``flow`` / ``priority``: the shared link
    it moves its bytes over (module docstring)."""

    name: str
    stream: str
    duration_ms: float
    kind: str = "compute"
    after: tuple[str, ...] = ()
    issued_with: tuple[str, ...] = ()
    slowdown: Mapping[str, float] = field(default_factory=dict)
    group: str = ""
    sm_share: float = 0.0
    link: str = ""
    flow: str = ""
    priority: int = 0


@dataclass(frozen=True)
class Span:
    """Where an op ran: ``start_ms``/``end_ms``; ``lost_ms`` = time added by interference."""

    op: Op
    start_ms: float
    end_ms: float

    @property
    def lost_ms(self) -> float:
        return max(0.0, self.end_ms - self.start_ms - self.op.duration_ms)


def simulate(ops: Sequence[Op]) -> list[Span]:
    """Run ``ops`` (see the module docstring); spans in the order of ``ops``."""
    by_name = {}
    for op in ops:
        if op.name in by_name:
            raise SimulationError(f"two ops named {op.name!r}")
        if op.duration_ms < 0:
            raise SimulationError(f"op {op.name!r} has a negative duration {op.duration_ms}")
        if not 0.0 <= op.sm_share <= 1.0 or (op.sm_share and op.kind != SM):
            raise SimulationError(
                f"op {op.name!r}: sm_share {op.sm_share} must be in [0, 1], on kind {SM!r} only"
            )
        if op.kind == SM and op.stream == COMPUTE:
            raise SimulationError(f"op {op.name!r}: kind {SM!r} runs beside compute, not on it")
        by_name[op.name] = op
    for op in ops:
        for dep in (*op.after, *op.issued_with):
            if dep not in by_name:
                raise SimulationError(f"op {op.name!r} depends on unknown op {dep!r}")
    queues: dict[str, list[Op]] = {}
    for op in ops:
        queues.setdefault(op.stream, []).append(op)
    heads = dict.fromkeys(queues, 0)
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    remaining: dict[str, float] = {}  # running op -> work left (ms at rate 1)
    now = 0.0
    while len(ended) < len(ops):
        progressed = True
        while progressed:  # start every stream head that may start now
            progressed = False
            for stream, queue in queues.items():
                i = heads[stream]
                if i >= len(queue) or queue[i].name in remaining:
                    continue
                op = queue[i]
                if all(d in ended for d in op.after) and all(d in started for d in op.issued_with):
                    started[op.name] = now
                    progressed = True
                    if op.duration_ms <= _EPS:  # an event: it ends as it starts
                        ended[op.name] = now
                        heads[stream] += 1
                    else:
                        remaining[op.name] = op.duration_ms
        if not remaining:
            if len(ended) == len(ops):
                break
            blocked = [queues[s][heads[s]].name for s in queues if heads[s] < len(queues[s])]
            raise SimulationError(f"ops wait on each other (a cycle or bad order): {blocked}")
        running = [by_name[n] for n in remaining]  # in start order
        shares = _link_shares(running)
        kinds = {op.kind for op, share in zip(running, shares) if share > 0}  # waiting: idle
        held = max((op.sm_share for op in running), default=0.0)
        rates = {op.name: _rate(op, kinds, held) * share for op, share in zip(running, shares)}
        step = min(remaining[n] / rates[n] for n in remaining if rates[n] > 0)
        now += step
        for name in list(remaining):
            remaining[name] -= step * rates[name]
            if remaining[name] <= _EPS:
                del remaining[name]
                ended[name] = now
                heads[by_name[name].stream] += 1
    return [Span(op, started[op.name], ended[op.name]) for op in ops]


def _rate(op: Op, running_kinds: set[str], sm_held: float) -> float:
    """Progress per ms of ``op`` beside ``running_kinds`` (the engines' fractions add up);
    ``sm_held``: the largest SM share of a running ``sm`` op (it pauses the compute
    stream's share). An ``sm`` op always progresses, so some op does."""
    slow = sum(max(0.0, op.slowdown.get(k, 0.0)) for k in running_kinds if k != op.kind)
    rate = 1.0 / (1.0 + slow)
    return rate * (1.0 - sm_held) if op.stream == COMPUTE else rate


def _link_shares(running: Sequence[Op]) -> list[float]:
    """Per running op (in start order), its share of its link: per link, the first op of
    each flow (FIFO per flow) among the flows of the highest priority splits it equally;
    the others wait (0). Ops on no link: 1."""
    heads: dict[str, dict[str, Op]] = {}
    for op in running:
        if op.link:
            heads.setdefault(op.link, {}).setdefault(op.flow or op.stream, op)
    share: dict[int, float] = {}
    for flows in heads.values():
        top = max(op.priority for op in flows.values())
        first = [op for op in flows.values() if op.priority == top]
        for op in first:
            share[id(op)] = 1.0 / len(first)
    return [share.get(id(op), 0.0) if op.link else 1.0 for op in running]


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted union of half-open intervals (empty ones dropped). Also the profiled-step
    breakdown's (scripts/bench/step_breakdown.py)."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def intersect_length(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total overlap of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def idle_and_comm(spans: Sequence[Span]) -> tuple[list, list]:
    """(compute-stream idle intervals up to the step's end, merged communication
    intervals): where they meet, communication is exposed."""
    step = max((s.end_ms for s in spans), default=0.0)
    busy = merge((s.start_ms, s.end_ms) for s in spans if s.op.stream == COMPUTE)
    idle, cursor = [], 0.0
    for a, b in [*busy, (step, step)]:
        if a > cursor:
            idle.append((cursor, a))
        cursor = max(cursor, b)
    comm = merge((s.start_ms, s.end_ms) for s in spans if s.op.kind in COMM_KINDS)
    return idle, comm


def summarize(spans: Sequence[Span]) -> dict[str, float]:
    """Step figures of a simulated step: ``step_ms``; ``exposed_ms`` (the compute stream
    idle while communication or a comm kernel runs), split into ``exposed_first_ms``
    (before the first compute op), ``exposed_last_ms`` (after the last compute op before
    the optimizer) and ``exposed_between_ms``; ``comm_busy_ms``; ``sm_ms_taken``
    (compute-stream time lost to interference and to SM-holding kernels);
    ``sm_kernel_ms`` (busy ms of the comm library's SM kernels, :data:`SM_KERNEL_KINDS`;
    ``accumulate_ms``: of kind ``sm_rs``, TIDE-RS's); ``comm_slowed_ms`` (time added to
    communication ops by what ran beside them); and busy ms per compute-stream kind
    (``compute_ms``, ``layout_ms``, ``optimizer_ms``, ``host_ms``)."""
    step = max((s.end_ms for s in spans), default=0.0)
    on_compute = [s for s in spans if s.op.stream == COMPUTE]
    idle, comm = idle_and_comm(spans)
    work = [s for s in on_compute if s.op.kind == "compute"]
    first = min((s.start_ms for s in work), default=step)
    last = max((s.end_ms for s in work), default=0.0)
    out = {
        "step_ms": step,
        "exposed_ms": intersect_length(idle, comm),
        "exposed_first_ms": intersect_length(
            [(a, min(b, first)) for a, b in idle if a < first], comm
        ),
        "exposed_last_ms": intersect_length([(max(a, last), b) for a, b in idle if b > last], comm),
        "comm_busy_ms": sum(b - a for a, b in comm),
        "sm_ms_taken": sum(s.lost_ms for s in on_compute),
        "sm_kernel_ms": sum(s.op.duration_ms for s in spans if s.op.kind in SM_KERNEL_KINDS),
        "accumulate_ms": sum(s.op.duration_ms for s in spans if s.op.kind == "sm_rs"),
        "comm_slowed_ms": sum(s.lost_ms for s in spans if s.op.stream != COMPUTE),
    }
    out["exposed_between_ms"] = out["exposed_ms"] - out["exposed_first_ms"] - out["exposed_last_ms"]
    for kind in ("compute", "layout", "optimizer", "host"):
        out[f"{kind}_ms"] = sum(s.end_ms - s.start_ms for s in on_compute if s.op.kind == kind)
    return out
