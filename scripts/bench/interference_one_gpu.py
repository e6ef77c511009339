"""Interference on ONE GPU (``bench_interference.py --one-gpu``): every compute class the
models use beside each engine that moves their communication, both directions.

    python scripts/bench/bench_interference.py --one-gpu --out-dir bench/results [--reps 5]
    python scripts/bench/bench_interference.py --one-gpu --small --out-dir /tmp/i  # tests

Compute classes (bf16, on the compute stream): ``single_wave`` GEMM 1024 x 4096 x 8192,
``large`` GEMM 8192^3, ``grouped_experts`` (one ``torch._grouped_mm`` over 128 experts of
512 rows, K 768, N 2048: Qwen3's expert down-projection as TorchTitan's MoE runs it),
``attention`` (causal flash attention, ``F.scaled_dot_product_attention``, one sequence of
8192 tokens, 64 heads of 128: a Llama-3.1-70B layer's).

Beside them, on a side stream, the engines (``side``), each repeated to about
``--side-ms`` alone:

- ``copy_engine``: a device-to-device ``copy_`` (``cudaMemcpyAsync``: the copy engine, no
  SM). It reads and writes local HBM, twice the local traffic of an NVLink peer copy at
  up to 478 GB/s: an upper bound on a peer copy's HBM contention.
- ``nccl_like_24`` / ``nccl_like_9``: a persistent copy kernel (Triton) on exactly the
  CTAs NCCL's kernels ran in the 2-GPU profiles (24: ``AllGather_RING_LL`` /
  ``ReduceScatter_Sum_f32_RING_LL``; 9: symm_mem's ``ReduceScatter_LD``), 16 warps each,
  every CTA striding over the buffer as NCCL's channels do. It holds as many SMs as NCCL's
  kernel for as long, moving HBM; it does not spin on flags or touch NVLink (one GPU
  cannot run NCCL's ring between two ranks with torch's bundled NCCL).
- ``cast_foreach``: FSDP2's fp32 -> bf16 cast of one Llama-3.1-70B layer's shards at 2
  ranks (``torch._foreach_copy_``, the multi-launch kernel every mode's all-gather runs).
- ``accumulate``: TIDE-RS's accumulate kernel (``comm.base.kernels.accumulate_rows``, its
  default launch) on two bf16 rows of that shard into fp32.
- ``local_copy_ce``: ONE ``cudaMemcpyBatchAsync`` (``comm.transports.copy_engine.batch_copy``:
  source order, location hints, ``PreferOverlapWithCompute``) of a 256 MiB ``uint8`` buffer
  into another on the same GPU: a local HBM-to-HBM copy the driver is asked to run on the
  copy engine (a same-device ``copy_``, the ``copy_engine`` side, is the driver's choice).
- ``local_batch_ce``: the same call with many per-parameter copies: one wave of
  placement, 8 window entries x the 9 shards of a Llama-3.1-70B layer at 64 ranks (72
  copies, 205 MiB), as ``transports/windows/transport.py`` places and packs (Place, PackSlices).

The rows of every side also give its rate (``side_gib_s_alone`` / ``_beside``: bytes
copied per second of its device time), the local copy rate the simulator charges
placement and packing with (``simulator/interference.py``, engine ``ce_local``).

Per (class, side), in each of ``--reps`` pairs: a burst of the class alone, then the same
burst with the side op issued after its first op. Compute: each op that ran wholly inside
the side op's span, against the alone bursts' median at the SAME burst position (the
2x H200 bench compared a short burst's first GEMMs with whole bursts' median: on a
power-capped H200 the first GEMMs run faster); slowdown = sum beside / sum alone - 1.
Side: its device time (events on its stream) beside vs alone. Writes
``<date>_<machine>_<commit>_interference_one_gpu.{json,md,png}``; the simulator reads the
newest (``torchtitan_tide/simulator/interference.py``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import common

COMPUTE = {
    "single_wave": ("gemm", (1024, 4096, 8192)),
    "large": ("gemm", (8192, 8192, 8192)),
    "grouped_experts": ("gemm", (128, 512, 768, 2048)),
    "attention": ("attention", (1, 64, 8192, 128)),
}
SMALL_COMPUTE = {
    "single_wave": ("gemm", (256, 512, 512)),
    "large": ("gemm", (1024, 1024, 1024)),
    "grouped_experts": ("gemm", (4, 64, 128, 128)),
    "attention": ("attention", (1, 4, 512, 64)),
}
SIDES = (
    "copy_engine",
    "nccl_like_24",
    "nccl_like_9",
    "cast_foreach",
    "accumulate",
    "local_copy_ce",
    "local_batch_ce",
)
NCCL_CTAS = {"nccl_like_24": 24, "nccl_like_9": 9}
# One Llama-3.1-70B layer's parameter shapes (dim 8192, 64 / 8 heads of 128, FFN 28672).
LLAMA_LAYER = ((8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192),
               (28672, 8192), (8192, 28672), (8192,), (8192,))  # fmt: skip
COPY_MIB = 256
PLACE_ENTRIES, PLACE_RANKS = 8, 64  # one wave of placement of a Llama-70B layer at 8 x 8
MAX_BURST = 4000
COLUMNS = [
    ("compute", "compute"), ("side", "beside"), ("compute_alone_ms", "compute alone ms"),
    ("compute_beside_ms", "compute beside ms"), ("slowdown_pct", "compute slowdown %"),
    ("samples", "ops counted"), ("side_alone_ms", "side alone ms"),
    ("side_beside_ms", "side beside ms"), ("side_slowdown_pct", "side slowdown %"),
    ("covered", "side inside the burst"), ("error", "error"),
]  # fmt: skip


@dataclass(frozen=True)
class Pair:
    """One (class, side) measurement: per-op times of the alone and beside bursts (ms, by
    burst position; beside: only ops wholly inside the side op's span), the side op's
    device ms alone and beside, and whether it ended inside the burst."""

    alone: list[list[float]]
    beside: list[list[tuple[int, float]]]
    side_alone: list[float]
    side_beside: list[float]
    covered: list[bool]


def summarize(compute: str, side: str, pair: Pair, side_bytes: int = 0) -> dict[str, Any]:
    """A result row: compute at matched burst positions, the side op's device time and
    (``side_bytes``: bytes one measurement of the side op copies) its rate."""
    by_pos = {}
    for burst in pair.alone:
        for pos, ms in enumerate(burst):
            by_pos.setdefault(pos, []).append(ms)
    alone_at = {pos: statistics.median(v) for pos, v in by_pos.items()}
    matched = [(ms, alone_at[pos]) for burst in pair.beside for pos, ms in burst if pos in alone_at]
    beside_sum, alone_sum = sum(m for m, _ in matched), sum(a for _, a in matched)
    side_alone = statistics.median(pair.side_alone) if pair.side_alone else None
    side_beside = statistics.median(pair.side_beside) if pair.side_beside else None
    return {
        "compute": compute, "side": side,
        "compute_alone_ms": alone_sum / len(matched) if matched else None,
        "compute_beside_ms": beside_sum / len(matched) if matched else None,
        "slowdown_pct": 100 * (beside_sum / alone_sum - 1) if alone_sum else None,
        "samples": len(matched), "side_alone_ms": side_alone, "side_beside_ms": side_beside,
        "side_slowdown_pct": 100 * (side_beside / side_alone - 1)
        if side_alone and side_beside else None,
        "side_gib_s_alone": _gib_s(side_bytes, side_alone),
        "side_gib_s_beside": _gib_s(side_bytes, side_beside),
        "covered": all(pair.covered) if pair.covered else None, "error": None,
    }  # fmt: skip


def _gib_s(nbytes: int, ms: float | None) -> float | None:
    return nbytes / 2**30 / (ms / 1e3) if nbytes and ms else None


def burst_length(side_ms: float, compute_ms: float, cover: float = 16.0) -> int:
    """Compute ops so that the burst outlasts the side op ``cover`` times over (the cast
    beside large GEMMs took ~12x its alone time on 2x H200)."""
    if compute_ms <= 0:
        return MAX_BURST
    return max(8, min(MAX_BURST, math.ceil(cover * side_ms / compute_ms) + 2))


# ---------------------------------------------------------------- on the GPU


def _copy_kernel():
    """A persistent copy kernel: program p copies blocks p, p + grid, ... of ``src``."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_persistent(src, dst, numel, BLOCK: tl.constexpr, GRID: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, numel, GRID * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_persistent


def build_compute(kind: str, shape: Sequence[int], device) -> Callable[[], None]:
    """One op of a compute class (bench_interference's GEMMs, or causal attention)."""
    import torch
    import torch.nn.functional as F

    if kind == "gemm":
        import gemms

        return gemms.build_gemm(shape, device, seed=1)
    batch, heads, seq, head_dim = shape
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))  # fmt: skip

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attention


def placement_sizes(small: bool) -> list[int]:
    """Bytes of the copies of one ``local_batch_ce`` unit: every shard (bf16) of a
    Llama-3.1-70B layer at ``PLACE_RANKS`` ranks, for ``PLACE_ENTRIES`` window entries."""
    scale = 64 if small else 1
    shapes = [tuple(max(1, n // scale) for n in s) for s in LLAMA_LAYER]
    shard = [2 * max(1, -(-math.prod(s) // PLACE_RANKS)) for s in shapes]
    return shard * PLACE_ENTRIES


def side_bytes(name: str, small: bool) -> int:
    """Bytes one unit of a copying side op copies (0: not a copy)."""
    if name in ("copy_engine", "local_copy_ce", *NCCL_CTAS):
        return COPY_MIB * 2**20 // (64 if small else 1)
    if name == "local_batch_ce":
        return sum(placement_sizes(small))
    return 0


def _batch_side(device, sizes: list[int]) -> Callable[[], None]:
    """ONE cudaMemcpyBatchAsync of ``sizes`` copies between two buffers of this GPU, on
    the current stream (``copy_engine.batch_copy``, as placement runs it)."""
    import torch

    from torchtitan_tide.comm.transports.copy_engine import batch_copy

    src = torch.randint(0, 255, (sum(sizes),), device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    srcs = [src.data_ptr() + o for o in offsets]
    dsts = [dst.data_ptr() + o for o in offsets]
    index = device.index or 0

    def copy() -> None:
        batch_copy(dsts, srcs, sizes, [index] * len(sizes), index,
                   torch.cuda.current_stream(device))  # fmt: skip

    copy.buffers = (src, dst)  # kept alive with the closure
    return copy


def build_side(name: str, device, small: bool) -> Callable[[], None]:
    """One unit of a side op (module docstring)."""
    import torch

    scale = 64 if small else 1
    if name == "local_copy_ce":
        return _batch_side(device, [side_bytes(name, small)])
    if name == "local_batch_ce":
        return _batch_side(device, placement_sizes(small))
    if name in ("copy_engine", *NCCL_CTAS):
        numel = COPY_MIB * 2**20 // 2 // scale
        src = torch.randn(numel, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        if name == "copy_engine":
            return lambda: dst.copy_(src)
        kernel, ctas = _copy_kernel(), NCCL_CTAS[name]
        return lambda: kernel[(ctas,)](src, dst, numel, BLOCK=4096, GRID=ctas, num_warps=16)
    shapes = [tuple(max(1, n // scale) for n in s) for s in LLAMA_LAYER]
    sizes = [max(1, math.prod(s) // 2) for s in shapes]  # the shards at 2 ranks
    if name == "cast_foreach":
        shards = [torch.randn(n, device=device) for n in sizes]
        dsts = [torch.empty_like(t, dtype=torch.bfloat16) for t in shards]
        return lambda: torch._foreach_copy_(dsts, shards)
    if name == "accumulate":
        from torchtitan_tide.comm.base import kernels

        numel = sum(sizes)
        rows = torch.randn(2, numel, device=device, dtype=torch.bfloat16)
        out = torch.zeros(numel, device=device)
        return lambda: kernels.accumulate_rows(rows, out, accumulate=False, divisor=2.0)
    raise ValueError(f"side op {name!r}: choose from {SIDES}")


def _timed(fn: Callable[[], None], n: int, stream=None):
    import torch

    marks = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        marks.append((start, end))
    return marks


def side_ms(side: Callable[[], None], units: int, device) -> float:
    """Device ms of ``units`` side units on their own stream, nothing beside."""
    import torch

    stream = torch.cuda.Stream(device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(units):
            side()
        end.record(stream)
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def measure(op: Callable[[], None], side: Callable[[], None], units: int, n: int, reps: int,
            device) -> Pair:  # fmt: skip
    """``reps`` pairs of bursts: alone, then with the side op issued after op 1."""
    import torch

    stream = torch.cuda.Stream(device=device)
    pair = Pair([], [], [], [], [])
    for _ in range(reps):
        torch.cuda.synchronize(device)
        marks = _timed(op, n)
        torch.cuda.synchronize(device)
        pair.alone.append([s.elapsed_time(e) for s, e in marks])
        pair.side_alone.append(side_ms(side, units, device))
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        first = _timed(op, 1)
        stream.wait_event(origin)
        with torch.cuda.stream(stream):
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record(stream)
            for _ in range(units):
                side()
            s1.record(stream)
        rest = _timed(op, n - 1)
        torch.cuda.synchronize(device)
        lo, hi = origin.elapsed_time(s0), origin.elapsed_time(s1)
        spans = [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in first + rest]
        pair.beside.append(
            [(pos, b - a) for pos, (a, b) in enumerate(spans) if a >= lo and b <= hi]
        )
        pair.side_beside.append(hi - lo)
        pair.covered.append(hi <= spans[-1][1])
    return pair


def run(args: argparse.Namespace) -> int:
    """Measure every (class, side), write the result files; 0 on success."""
    import torch

    if not torch.cuda.is_available():
        print("--one-gpu needs a CUDA GPU", flush=True)
        return 2
    device = torch.device("cuda", 0)
    meta = common.metadata(1)
    name = "interference_one_gpu_small" if args.small else "interference_one_gpu"
    stem = str(common.result_stem(args.out_dir, name, meta))
    classes = SMALL_COMPUTE if args.small else COMPUTE
    side_target = 1.0 if args.small else args.side_ms
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    sides, units, broken = {}, {}, {}
    for s in SIDES:  # a side that cannot run here (no cuda-bindings) is an error row
        try:
            fn = build_side(s, device, args.small)
            side_ms(fn, 2, device)  # warm-up: Triton compile, cuBLAS / allocator
            sides[s] = fn
            units[s] = max(1, round(side_target / max(1e-3, side_ms(fn, 1, device))))
        except Exception as e:  # noqa: BLE001 - recorded in its rows
            broken[s] = common.short_error(f"{type(e).__name__}: {e}")
    for cls, (kind, shape) in classes.items():
        op = build_compute(kind, shape, device)
        _timed(op, 8)  # warm-up
        marks = _timed(op, 8)
        torch.cuda.synchronize(device)
        alone_ms = statistics.median(start.elapsed_time(end) for start, end in marks)
        rows.append({"compute": cls, "side": "none", "compute_alone_ms": alone_ms,
                     "error": None})  # fmt: skip
        rows += [{"compute": cls, "side": side, "error": why} for side, why in broken.items()]
        for side, fn in sides.items():
            try:
                unit_ms = side_ms(fn, units[side], device)
                n = burst_length(unit_ms, alone_ms)
                pair = measure(op, fn, units[side], n, args.reps, device)
                rows.append(summarize(cls, side, pair, units[side] * side_bytes(side, args.small)))
            except Exception as e:  # noqa: BLE001 - recorded in its row; the next runs
                rows.append({"compute": cls, "side": side, "error": common.short_error(
                    f"{type(e).__name__}: {e}")})  # fmt: skip
            print(f"{cls} beside {side}: {common.short_error(rows[-1].get('error')) or 'ok'}",
                  flush=True)  # fmt: skip
        del op
        torch.cuda.empty_cache()
    results = {
        "kind": "interference_one_gpu", "metadata": meta, "status": "complete",
        "config": {"reps": args.reps, "side_ms": side_target, "units": units, "small": args.small,
                   "compute": {k: [v[0], list(v[1])] for k, v in classes.items()},
                   "sides": list(SIDES), "nccl_ctas": NCCL_CTAS,
                   "side_bytes": {s: side_bytes(s, args.small) for s in SIDES}},
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    return write(results, rows, stem)


def write(results: dict[str, Any], rows: list[dict[str, Any]], stem: str) -> int:
    """The table, headline and files of a one-GPU run (JSON / MD / PNG)."""
    results["tables"] = [{"title": "Compute beside each engine, one GPU", "columns": COLUMNS,
                          "rows": rows}]  # fmt: skip
    results["headline"] = [
        common.headline_row(f"interference {r['compute']} (one GPU)",
                            f"compute slowdown % beside {r['side']}",
                            {"one_gpu": r["slowdown_pct"]})
        for r in rows if r.get("slowdown_pct") is not None
    ]  # fmt: skip
    meta = results["metadata"]
    notes = (
        f"{meta['machine']}, torch {meta['torch']}, CUDA {meta['cuda']}, commit "
        f"{meta['commit']}, {meta['date']}; {results['config']['reps']} burst pairs per row; side "
        "ops repeated to about "
        f"{results['config']['side_ms']} ms. Compute ops wholly inside the side op's span, "
        "against the alone bursts at the same positions; side: its device time beside / "
        "alone. nccl_like_N: a persistent Triton copy kernel on N CTAs (NCCL's ring: 24, "
        "symmetric RS: 9) standing for NCCL's kernels; copy_engine: a device-to-device copy "
        "(local HBM read + write, the driver's choice of engine); local_copy_ce / local_batch_ce: "
        "one cudaMemcpyBatchAsync asked for the copy engine (PreferOverlapWithCompute), one big copy / "
        "one wave of placement copies; side GiB/s: bytes copied per second of its device time. Read "
        "by the simulator (docs/design/2026-12-07-simulator.md).\n"
    )
    charts = [common.BarChart(f"compute slowdown beside {side}",
                              [r["compute"] for r in rows if r["side"] == side],
                              [r.get("slowdown_pct") for r in rows if r["side"] == side], "%")
              for side in SIDES]  # fmt: skip
    markdown = common.write_result(stem, results, "Interference on one GPU", notes, charts)
    common.announce_results(stem, markdown)
    return 0 if all(r.get("error") is None for r in rows) else 1
