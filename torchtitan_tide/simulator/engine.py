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
- ``device`` (the GPU an op runs on, a local rank): every rate above is per device, a
  GPU's ops slow and are slowed by that GPU's ops only, and a link belongs to one device
  (``nic@3``: local rank 3's NIC; :func:`on_device` names rank ``d``'s streams, ops and
  links). A step of several ranks of a node has one compute stream per rank; the figures
  of :func:`summarize` are one rank's (:func:`device_spans`, :func:`slowest_device`).
- ``sm_share`` (ops of kind ``sm``: kernels of the comm library on their own stream, e.g.
  TIDE-RS's accumulate): while one runs, every op on the compute stream progresses at
  ``1 - share`` of its rate (share 1: compute pauses). The kernel itself runs at its
  own (measured, alone) duration, so the SM time is conserved.

The time an op on the compute stream loses is SM-ms taken from compute; the time a
communication op loses is comm time added by compute. :func:`simulate` advances from
event to event (an op starts or ends) and returns each op's start and end.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

COMPUTE = "compute"  # the compute stream's name
# op kinds off the compute stream (exposure): the generic ones, and the engines of
# ``interference.ENGINES`` the step model uses
COMM_KINDS = ("ag", "rs", "net", "net0", "sm", "nccl", "nccl_symk", "ce", "ce_local", "nic",
              "sm_ag", "sm_rs")  # fmt: skip
SM = "sm"  # kind of an SM-holding kernel off the compute stream (a share of the SMs)
SM_KERNEL_KINDS = ("sm", "sm_ag", "sm_rs")  # comm-library kernels on SMs
DEVICE_SEP = "@"  # a stream, op or link of local rank d > 0: ``name@d`` (:func:`on_device`)
_EPS = 1e-9


class SimulationError(ValueError):
    """The ops cannot run: unknown dependency, a cycle, or a negative duration."""


def on_device(name: str, device: int) -> str:
    """The name of a stream, op or link of local rank ``device`` (``name`` itself on rank
    0: a step of one rank keeps its names)."""
    return name if device == 0 else f"{name}{DEVICE_SEP}{device}"


def base_name(name: str) -> str:
    """``name`` without its rank suffix (:func:`on_device`)."""
    return name.split(DEVICE_SEP, 1)[0]


def is_compute(stream: str) -> bool:
    """Whether ``stream`` is a rank's compute stream (:data:`COMPUTE` on any rank)."""
    return base_name(stream) == COMPUTE


@dataclass(frozen=True)
class Op:
    """One kernel class on one stream.

    ``kind``: ``compute`` / ``layout`` / ``optimizer`` / ``host`` (on the compute
    stream) or a kind of :data:`COMM_KINDS`; ``slowdown``: the fraction it slows by
    beside a running op of each kind; ``sm_share`` (kind ``sm`` only): the share of the
    SMs it holds while it runs (0..1); ``link`` / ``flow`` / ``priority``: the shared link
    it moves its bytes over (module docstring); ``device``: the GPU (local rank) it runs
    on: it slows and is slowed by that GPU's ops only, and its link is that GPU's."""

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
    device: int = 0


@dataclass(frozen=True)
class Span:
    """Where an op ran: ``start_ms``/``end_ms``; ``lost_ms`` = time added by interference."""

    op: Op
    start_ms: float
    end_ms: float

    @property
    def lost_ms(self) -> float:
        return max(0.0, self.end_ms - self.start_ms - self.op.duration_ms)


def _check(ops: Sequence[Op]) -> dict[str, int]:
    """Index of every op by name, after the checks of :func:`simulate`."""
    index: dict[str, int] = {}
    link_device: dict[str, int] = {}
    for i, op in enumerate(ops):
        if op.name in index:
            raise SimulationError(f"two ops named {op.name!r}")
        if op.duration_ms < 0:
            raise SimulationError(f"op {op.name!r} has a negative duration {op.duration_ms}")
        if not 0.0 <= op.sm_share <= 1.0 or (op.sm_share and op.kind != SM):
            raise SimulationError(
                f"op {op.name!r}: sm_share {op.sm_share} must be in [0, 1], on kind {SM!r} only"
            )
        if op.kind == SM and is_compute(op.stream):
            raise SimulationError(f"op {op.name!r}: kind {SM!r} runs beside compute, not on it")
        if op.link and link_device.setdefault(op.link, op.device) != op.device:
            raise SimulationError(f"op {op.name!r}: link {op.link!r} belongs to device "
                                  f"{link_device[op.link]}, not {op.device}")  # fmt: skip
        index[op.name] = i
    for op in ops:
        for dep in (*op.after, *op.issued_with):
            if dep not in index:
                raise SimulationError(f"op {op.name!r} depends on unknown op {dep!r}")
    return index


def _runs(ops: Sequence[Op], index: dict[str, int]) -> tuple[list[Op], list[list[int]]]:
    """``ops`` as units: runs of consecutive ops of one stream that progress alike (same
    kind, link, flow, priority, device, slowdown, SM share), wait for nothing but the run's
    first op's dependencies, and that no other op waits for but the last (nor waits to
    start but the first), merged into one op of their summed duration. A run ends and
    starts as its ops would, op after op at the same rates; :func:`simulate` gives each op
    its own span back. Returns the units and each unit's ops."""
    refs = [0] * len(ops)  # how many ops wait for an op to end or start
    started_by = [False] * len(ops)
    for op in ops:
        for d in set(op.after):
            refs[index[d]] += 1
        for d in set(op.issued_with):
            refs[index[d]] += 1
            started_by[index[d]] = True
    last_of: dict[str, int] = {}  # stream -> its last unit
    units: list[Op] = []
    parts: list[list[int]] = []
    for i, op in enumerate(ops):
        u = last_of.get(op.stream)
        if u is not None and _extends(ops, parts[u], i, refs, started_by):
            parts[u].append(i)
            continue
        last_of[op.stream] = len(units)
        units.append(op)
        parts.append([i])
    for u, members in enumerate(parts):
        if len(members) > 1:
            first, last = ops[members[0]], ops[members[-1]]
            total = sum(ops[i].duration_ms for i in members)
            units[u] = replace(first, name=last.name, duration_ms=total)
    return units, parts


def _extends(ops: Sequence[Op], members: list[int], i: int, refs: list[int],
             started_by: list[bool]) -> bool:  # fmt: skip
    """Whether op ``i`` extends the run ``members`` of its stream (:func:`_runs`)."""
    prev, first, op = ops[members[-1]], ops[members[0]], ops[i]
    if op.duration_ms <= _EPS or prev.duration_ms <= _EPS or op.issued_with or started_by[i]:
        return False
    if (op.kind, op.link, op.flow, op.priority, op.device, op.sm_share) != (
        first.kind, first.link, first.flow, first.priority, first.device, first.sm_share
    ) or op.slowdown != first.slowdown:  # fmt: skip
        return False
    waits_prev = prev.name in op.after
    if refs[members[-1]] != int(waits_prev):  # another op waits for the run's middle
        return False
    return all(d == prev.name or d in first.after for d in op.after)


def simulate(ops: Sequence[Op]) -> list[Span]:
    """Run ``ops`` (see the module docstring); spans in the order of ``ops``.

    Event driven: an op becomes ready when it heads its stream and its dependencies are
    met (counted, each once); the rates of a device's running ops are recomputed when an
    op of that device starts or ends, and each running op's projected end sits in a heap.
    Consecutive ops of a stream that progress alike run as one unit (:func:`_runs`)."""
    index = _check(ops)
    units, parts = _runs(ops, index)
    unit_of = [0] * len(ops)
    for u, members in enumerate(parts):
        for i in members:
            unit_of[i] = u
    n = len(units)
    streams: dict[str, list[int]] = {}
    for u, op in enumerate(units):
        streams.setdefault(op.stream, []).append(u)
    stream_id = {name: k for k, name in enumerate(streams)}
    queues = list(streams.values())
    sid = [stream_id[op.stream] for op in units]
    pos = [0] * n
    for queue in queues:
        for p, u in enumerate(queue):
            pos[u] = p
    heads = [0] * len(queues)
    deps = [0] * n
    on_start: list[list[int]] = [[] for _ in range(n)]
    on_end: list[list[int]] = [[] for _ in range(n)]
    for u, op in enumerate(units):
        after = {unit_of[index[d]] for d in op.after}
        issued = {unit_of[index[d]] for d in op.issued_with}
        deps[u] = len(after) + len(issued)
        for d in after:
            on_end[d].append(u)
        for d in issued:
            on_start[d].append(u)
    started: list[float | None] = [None] * n
    ended: list[float | None] = [None] * n
    # ends of a unit's ops but its last, as work done (ms at rate 1) and as time
    bounds = [_bounds(ops, members) if len(members) > 1 else [] for members in parts]
    info = [_Rates.of(op) for op in units]
    part_ends: list[list[float]] = [[] for _ in range(n)]
    ready: list[tuple[int, int]] = []  # (stream id, unit): started in stream order
    running: dict[int, dict[int, None]] = {}  # device -> running units in start order
    state = _State(n)
    dirty: set[int] = set()
    now, done = 0.0, 0

    def push_if_ready(u: int) -> None:
        if deps[u] == 0 and pos[u] == heads[sid[u]] and started[u] is None:
            heapq.heappush(ready, (sid[u], u))

    def finish(u: int) -> None:
        nonlocal done
        ended[u] = now
        done += 1
        s = sid[u]
        heads[s] += 1
        if heads[s] < len(queues[s]):
            push_if_ready(queues[s][heads[s]])
        for j in on_end[u]:
            deps[j] -= 1
            push_if_ready(j)

    for queue in queues:
        push_if_ready(queue[0])
    while done < n:
        while ready:  # start every stream head that may start now
            _, u = heapq.heappop(ready)
            if started[u] is not None:
                continue
            started[u] = now
            for j in on_start[u]:
                deps[j] -= 1
                push_if_ready(j)
            op = units[u]
            if op.duration_ms <= _EPS:  # an event: it ends as it starts
                finish(u)
            else:
                running.setdefault(op.device, {})[u] = None
                state.begin(u, op.duration_ms, now)
                dirty.add(op.device)
        for device in dirty:
            _rerate(info, list(running.get(device, ())), now, state, bounds, part_ends)
        dirty.clear()
        ends = state.ends
        while ends and (state.version[ends[0][2]] != ends[0][1] or ended[ends[0][2]] is not None):
            heapq.heappop(ends)
        if not ends:
            if done == n:
                break
            blocked = [units[q[heads[k]]].name for k, q in enumerate(queues) if heads[k] < len(q)]
            raise SimulationError(f"ops wait on each other (a cycle or bad order): {blocked}")
        now = max(now, ends[0][0])
        while ends and ends[0][0] <= now + _EPS:
            _, ver, u = heapq.heappop(ends)
            if ver != state.version[u] or ended[u] is not None:
                continue
            device = units[u].device
            del running[device][u]
            dirty.add(device)
            state.settle(u, now, bounds[u], part_ends[u])
            finish(u)
    spans: list[Span | None] = [None] * len(ops)
    for u, members in enumerate(parts):
        at = started[u]
        ends_u = [*part_ends[u], ended[u]]
        for i, end_ms in zip(members, ends_u):
            spans[i] = Span(ops[i], at, max(at, end_ms))
            at = spans[i].end_ms
    return spans


def _bounds(ops: Sequence[Op], members: list[int]) -> list[float]:
    """Work done (ms at rate 1) at the end of each op of a unit but its last."""
    out, total = [], 0.0
    for i in members[:-1]:
        total += ops[i].duration_ms
        out.append(total)
    return out


class _State:
    """Progress of the running units: work left at the last rate change, its time, the
    rate, a version per rate change, and the heap of projected ends."""

    def __init__(self, n: int) -> None:
        self.rem, self.t_upd = [0.0] * n, [0.0] * n
        self.rate, self.version = [-1.0] * n, [0] * n
        self.total = [0.0] * n
        self.ends: list[tuple[float, int, int]] = []  # (projected end, version, unit)

    def begin(self, u: int, duration: float, now: float) -> None:
        self.rem[u], self.total[u], self.t_upd[u], self.rate[u] = duration, duration, now, -1.0

    def settle(self, u: int, now: float, bounds: list[float], part_ends: list[float]) -> None:
        """Work left at ``now`` at the current rate; the ends of the unit's ops crossed."""
        rate = self.rate[u]
        if rate <= 0:
            self.t_upd[u] = now
            return
        done0 = self.total[u] - self.rem[u]
        self.rem[u] -= (now - self.t_upd[u]) * rate
        done1 = self.total[u] - self.rem[u]
        while len(part_ends) < len(bounds) and bounds[len(part_ends)] <= done1 + _EPS:
            part_ends.append(self.t_upd[u] + max(0.0, bounds[len(part_ends)] - done0) / rate)
        self.t_upd[u] = now

    def set_rate(self, u: int, rate: float, now: float) -> None:
        self.rate[u] = rate
        self.version[u] += 1
        if rate > 0:
            heapq.heappush(self.ends, (now + max(self.rem[u], 0.0) / rate, self.version[u], u))


@dataclass(frozen=True)
class _Rates:
    """What an op's rate depends on (:func:`_rerate`): its link and flow on it, priority,
    kind, the positive fractions it slows by, whether it is on a compute stream, its SM
    share."""

    link: str
    flow: str
    priority: int
    kind: str
    slow: tuple[tuple[str, float], ...]
    compute: bool
    sm_share: float

    @classmethod
    def of(cls, op: Op) -> _Rates:
        slow = tuple((k, f) for k, f in op.slowdown.items() if f > 0 and k != op.kind)
        return cls(op.link, op.flow or op.stream, op.priority, op.kind, slow,
                   is_compute(op.stream), op.sm_share)  # fmt: skip


def _rerate(info: Sequence[_Rates], running: list[int], now: float, state: _State,
            bounds: list[list[float]], part_ends: list[list[float]]) -> None:  # fmt: skip
    """New rates of one device's running units (in start order): per link, the first unit
    of each flow among the flows of the highest priority splits it equally, the others wait
    (0) and slow nothing; each unit progresses at ``share / (1 + the fractions of the kinds
    beside it)``, on a compute stream times ``1 -`` the largest SM share held (the engines'
    fractions add up; an ``sm`` unit always progresses). A unit whose rate changed has its
    work left settled at ``now`` and its projected end pushed."""
    heads: dict[str, dict[str, int]] = {}
    held = 0.0
    for u in running:
        r = info[u]
        held = max(held, r.sm_share)
        if r.link:
            heads.setdefault(r.link, {}).setdefault(r.flow, u)
    share: dict[int, float] = {}
    for flows in heads.values():
        top = max(info[u].priority for u in flows.values())
        first = [u for u in flows.values() if info[u].priority == top]
        for u in first:
            share[u] = 1.0 / len(first)
    kinds = {info[u].kind for u in running if not info[u].link or u in share}
    for u in running:
        r = info[u]
        new = share.get(u, 0.0) if r.link else 1.0
        if new > 0:
            new /= 1.0 + sum(f for k, f in r.slow if k in kinds)
            if r.compute:
                new *= 1.0 - held
        if new == state.rate[u]:
            continue
        state.settle(u, now, bounds[u], part_ends[u])
        state.set_rate(u, new, now)


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


def idle_and_comm(spans: Sequence[Span], beside: Sequence[Span] = ()) -> tuple[list, list]:
    """(compute-stream idle intervals up to the step's end, merged communication
    intervals): where they meet, communication is exposed. ``beside``: the spans of the
    other ranks simulated, whose communication a rank may wait for (a peer's forwards)."""
    step = max((s.end_ms for s in spans), default=0.0)
    busy = merge((s.start_ms, s.end_ms) for s in spans if is_compute(s.op.stream))
    idle, cursor = [], 0.0
    for a, b in [*busy, (step, step)]:
        if a > cursor:
            idle.append((cursor, a))
        cursor = max(cursor, b)
    comm = merge((s.start_ms, s.end_ms) for s in (*spans, *beside) if s.op.kind in COMM_KINDS)
    return idle, comm


def device_spans(spans: Sequence[Span], device: int) -> list[Span]:
    """The spans of local rank ``device``: its compute stream and its communication."""
    return [s for s in spans if s.op.device == device]


def other_spans(spans: Sequence[Span], device: int) -> list[Span]:
    """The spans of every simulated local rank but ``device``."""
    return [s for s in spans if s.op.device != device]


def slowest_device(spans: Sequence[Span]) -> int:
    """The local rank whose compute stream ends last (the one that sets the step); of
    those that end together (they wait for each other's signals), the one whose compute
    lost the most time beside communication; then the lowest."""
    last: dict[int, float] = {}
    lost: dict[int, float] = {}
    for s in spans:
        if is_compute(s.op.stream):
            last[s.op.device] = max(last.get(s.op.device, 0.0), s.end_ms)
            lost[s.op.device] = lost.get(s.op.device, 0.0) + s.lost_ms
    return min(last, key=lambda d: (-round(last[d], 6), -lost[d], d)) if last else 0


def summarize(spans: Sequence[Span], beside: Sequence[Span] = ()) -> dict[str, float]:
    """Step figures of a simulated step: ``step_ms``; ``exposed_ms`` (the compute stream
    idle while communication or a comm kernel runs), split into ``exposed_first_ms``
    (before the first compute op), ``exposed_last_ms`` (after the last compute op before
    the optimizer) and ``exposed_between_ms``; ``comm_busy_ms``; ``sm_ms_taken``
    (compute-stream time lost to interference and to SM-holding kernels);
    ``sm_kernel_ms`` (busy ms of the comm library's SM kernels, :data:`SM_KERNEL_KINDS`;
    ``accumulate_ms``: of kind ``sm_rs``, TIDE-RS's); ``comm_slowed_ms`` (time added to
    communication ops by what ran beside them); and busy ms per compute-stream kind
    (``compute_ms``, ``layout_ms``, ``optimizer_ms``, ``host_ms``). ``spans``: one rank's
    (:func:`device_spans`); ``beside``: the other ranks' (exposure only)."""
    step = max((s.end_ms for s in spans), default=0.0)
    on_compute = [s for s in spans if is_compute(s.op.stream)]
    idle, comm = idle_and_comm(spans, beside)
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
        "comm_slowed_ms": sum(s.lost_ms for s in spans if not is_compute(s.op.stream)),
    }
    out["exposed_between_ms"] = out["exposed_ms"] - out["exposed_first_ms"] - out["exposed_last_ms"]
    for kind in ("compute", "layout", "optimizer", "host"):
        out[f"{kind}_ms"] = sum(s.end_ms - s.start_ms for s in on_compute if s.op.kind == kind)
    return out
