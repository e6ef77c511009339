"""Where one profiled training step's time goes, from its torch-profiler chrome trace.

:func:`step_breakdown` splits the step window (the last ``ProfilerStep#N`` range of
the trace) on the *compute stream* (the device stream with the most non-NCCL kernel
time) into five parts that sum to the window:

- ``compute_ms``: the compute stream is busy (kernels, and copies/memsets on it) with
  forward/backward work;
- ``optimizer_ms``: it is busy with work launched by the grad-norm clip or the
  optimizer step (host range from the first ``aten::_foreach_norm`` to the end of the
  last ``Optimizer.step#...`` range);
- the idle time, gap by gap. A gap ends with the row that starts next on the compute
  stream; the part of the gap before that row's launch call returned on the host is
  ``host_bound_ms`` (nothing was queued: the GPU waited for the host); the rest is a
  wait with work queued. The wait is ``exposed_comm_ms`` when a row on another stream
  (NCCL kernel, copy-engine copy, TIDE accumulate kernel, ...) ends inside it: the
  compute stream resumed after a collective finished. Otherwise it is ``other_idle_ms``
  (launch latency, waits on non-collective events). The tail after the last compute row
  is host-bound; a row whose launch is not in the trace counts as queued.

``exposed_comm_ms`` is also split by position: ``exposed_first_ms`` (before the first
compute row: the step's first all-gather), ``exposed_last_ms`` (after the last
forward/backward row: the last reduce-scatters and the clip's all-reduce) and
``exposed_between_ms``. ``comm_busy_ms`` is the time any other stream is busy and
``comm_hidden_ms`` the part of it under compute-stream work. docs/design/2026-12-01-compute-floor.md
explains the categories. A pure function over trace events: no torch, no files.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchtitan_tide.simulator.engine import intersect_length, merge

__all__ = ["intersect_length", "length", "mean_breakdown", "merge", "step_breakdown"]

STEP_RANGE_PREFIX = "ProfilerStep#"
OPTIMIZER_RANGE_PREFIX = "Optimizer.step#"
CLIP_START_OP = "aten::_foreach_norm"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("user_annotation", "cpu_op")
PARTS = ("compute_ms", "optimizer_ms", "exposed_comm_ms", "host_bound_ms", "other_idle_ms")

Interval = tuple[float, float]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(start: float, end: float, window: Interval) -> Interval:
    return max(start, window[0]), min(end, window[1])


def _span(e: Mapping[str, Any]) -> Interval:
    ts = float(e.get("ts", 0.0))
    return ts, ts + float(e.get("dur", 0.0))


def _stream(row: Mapping[str, Any]) -> tuple[Any, Any]:
    args = row.get("args") or {}
    return row.get("pid"), args.get("stream", row.get("tid"))


def _correlation(e: Mapping[str, Any]) -> int | None:
    corr = (e.get("args") or {}).get("correlation")
    return int(corr) if corr is not None else None


def step_window(events: Sequence[Mapping[str, Any]]) -> tuple[Interval, str]:
    """(window, source): the last ``ProfilerStep#N`` host range, else the span of all
    device rows (source ``"device span"``). Raises ``ValueError`` on a trace with neither."""
    steps = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in HOST_CATEGORIES
        and str(e.get("name", "")).startswith(STEP_RANGE_PREFIX)
    ]
    if steps:
        last = max(steps, key=lambda e: float(e.get("ts", 0.0)))
        return _span(last), str(last["name"])
    rows = [_span(e) for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if not rows:
        raise ValueError("trace has no ProfilerStep range and no device rows")
    return (min(a for a, _ in rows), max(b for _, b in rows)), "device span"


def compute_stream(rows: Sequence[Mapping[str, Any]], window: Interval) -> tuple[Any, Any]:
    """The stream with the most non-NCCL kernel time inside ``window``."""
    busy: dict[tuple[Any, Any], float] = {}
    for row in rows:
        if row.get("cat") != "kernel" or "nccl" in str(row.get("name", "")).lower():
            continue
        a, b = _clip(*_span(row), window)
        busy[_stream(row)] = busy.get(_stream(row), 0.0) + max(0.0, b - a)
    if not busy:
        raise ValueError("no compute kernel inside the step window")
    return max(busy, key=lambda k: busy[k])


def optimizer_phase(events: Sequence[Mapping[str, Any]], window: Interval) -> Interval | None:
    """Host interval of the grad-norm clip and optimizer step inside ``window``: from the
    first ``aten::_foreach_norm`` (or, without one, the first ``Optimizer.step#``
    range) to the end of the last ``Optimizer.step#`` range; None without one."""
    steps, norms = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CATEGORIES:
            continue
        a, b = _span(e)
        if not window[0] <= a < window[1]:
            continue
        name = str(e.get("name", ""))
        if name.startswith(OPTIMIZER_RANGE_PREFIX):
            steps.append((a, b))
        elif name == CLIP_START_OP:
            norms.append(a)
    if not steps:
        return None
    end = max(b for _, b in steps)
    start = min([a for a in norms if a < end] or [min(a for a, _ in steps)])
    return start, end


def step_breakdown(
    events: Iterable[Mapping[str, Any]], stream: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """The breakdown of the module docstring, in ms, for the trace ``events``.

    ``stream`` forces the compute stream (``(pid, stream id)``). Keys: ``step_ms``
    (window length), :data:`PARTS` (summing to ``step_ms``), ``exposed_first_ms``,
    ``exposed_between_ms``, ``exposed_last_ms``, ``comm_busy_ms``, ``comm_hidden_ms``,
    ``window`` (source name), ``compute_stream``, ``gaps`` (idle gaps counted).
    """
    events = [e for e in events if isinstance(e, Mapping)]
    window, source = step_window(events)
    rows = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    stream = stream if stream is not None else compute_stream(rows, window)
    launch_end: dict[int, float] = {}
    launch_start: dict[int, float] = {}
    for e in events:
        corr = _correlation(e)
        if e.get("cat") in LAUNCH_CATEGORIES and corr is not None:
            launch_start[corr], launch_end[corr] = _span(e)
    phase = optimizer_phase(events, window)

    compute_rows, comm_rows = [], []
    for row in rows:
        a, b = _clip(*_span(row), window)
        if b <= a:
            continue
        (compute_rows if _stream(row) == stream else comm_rows).append((a, b, row))
    compute_rows.sort(key=lambda r: (r[0], r[1]))

    def is_optimizer(row: Mapping[str, Any]) -> bool:
        corr = _correlation(row)
        launched = launch_start.get(corr) if corr is not None else None
        return phase is not None and launched is not None and phase[0] <= launched <= phase[1]

    busy = merge((a, b) for a, b, _ in compute_rows)
    optimizer = merge((a, b) for a, b, row in compute_rows if is_optimizer(row))
    comm_busy = merge((a, b) for a, b, _ in comm_rows)
    comm_ends = sorted(b for a, b, _ in comm_rows)

    fwd_bwd = [(a, b) for a, b, row in compute_rows if not is_optimizer(row)]
    first_start = compute_rows[0][0] if compute_rows else window[1]
    opt_start = optimizer[0][0] if optimizer else window[1]
    last_fwd_bwd_end = max((b for a, b in fwd_bwd if a < opt_start), default=window[0])

    out = dict.fromkeys(PARTS, 0.0)
    out.update(exposed_first_ms=0.0, exposed_between_ms=0.0, exposed_last_ms=0.0)
    starts = [a for a, _, _ in compute_rows]
    cursor, gaps = window[0], 0
    for start, end in [*busy, (window[1], window[1])]:
        if start > cursor:  # idle gap [cursor, start)
            gaps += 1
            _classify_gap(
                out, cursor, start, window, compute_rows, starts, launch_end, comm_ends,
                first_start, last_fwd_bwd_end,
            )  # fmt: skip
        cursor = max(cursor, end)
    out["optimizer_ms"] = length(optimizer)
    out["compute_ms"] = length(busy) - out["optimizer_ms"]
    result = {k: v / 1e3 for k, v in out.items()}
    result.update(
        step_ms=(window[1] - window[0]) / 1e3,
        comm_busy_ms=length(comm_busy) / 1e3,
        comm_hidden_ms=intersect_length(comm_busy, busy) / 1e3,
        window=source,
        compute_stream=f"{stream[0]}:{stream[1]}",
        gaps=gaps,
    )
    return result


def _classify_gap(
    out: dict[str, float],
    g0: float,
    g1: float,
    window: Interval,
    compute_rows: Sequence[tuple[float, float, Mapping[str, Any]]],
    starts: Sequence[float],
    launch_end: Mapping[int, float],
    comm_ends: Sequence[float],
    first_start: float,
    last_fwd_bwd_end: float,
) -> None:
    """Add the idle gap ``[g0, g1)`` to ``out``'s host-bound / exposed / other parts."""
    if g1 >= window[1]:  # the tail: nothing queued on the compute stream
        out["host_bound_ms"] += g1 - g0
        return
    closing = compute_rows[bisect.bisect_left(starts, g1)][2]
    corr = _correlation(closing)
    launched = launch_end.get(corr, g0) if corr is not None else g0
    queued_from = min(max(launched, g0), g1)
    out["host_bound_ms"] += queued_from - g0
    wait = g1 - queued_from
    if wait <= 0:
        return
    i = bisect.bisect_right(comm_ends, queued_from)
    if i < len(comm_ends) and comm_ends[i] <= g1:
        out["exposed_comm_ms"] += wait
        if g1 <= first_start:
            out["exposed_first_ms"] += wait
        elif g0 >= last_fwd_bwd_end:
            out["exposed_last_ms"] += wait
        else:
            out["exposed_between_ms"] += wait
    else:
        out["other_idle_ms"] += wait


def mean_breakdown(per_rank: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean over ranks of every numeric figure of :func:`step_breakdown` results."""
    ranks = list(per_rank.values())
    if not ranks:
        return {}
    keys = [k for k, v in ranks[0].items() if isinstance(v, (int, float))]
    return {k: sum(float(r[k]) for r in ranks) / len(ranks) for k in keys}
