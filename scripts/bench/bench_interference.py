"""GEMM slowdown beside each comm mode's all-gather and reduce-scatter (issue 5, "The suite").

    python scripts/bench/bench_interference.py --out-dir bench/results [--reps 6]
        [--modes fsdp2,symm_mem,tide]
    python scripts/bench/bench_interference.py --small --out-dir /tmp/i   # tiny layer (tests)
    python scripts/bench/bench_interference.py --one-gpu --out-dir bench/results [--reps 5]

``--one-gpu``: every compute class the models use (GEMMs, the grouped expert GEMM,
attention) beside each engine, on ONE GPU (``interference_one_gpu.py``: a copy-engine
copy, a copy kernel on NCCL's CTA counts, FSDP2's cast, TIDE-RS's accumulate). The rest
of this docstring is the 2-GPU mode.

GEMMs (bf16, on the compute stream): ``single_wave`` = A[M=1024, K=4096] @ B[K=4096,
N=8192] and ``large`` = 8192 x 8192 x 8192 (``torch.matmul`` into a preallocated output);
``grouped_experts`` = one ``torch._grouped_mm`` over 128 experts of 512 rows, K=768,
N=2048 (Qwen3-30B-A3B's expert down-projection at 8192 tokens x top 8, as TorchTitan's
MoE runs it: every expert in one launch).
Collectives: one Llama-3.1-70B layer as one FSDP group (fp32 master, bf16 params, fp32
reduce), per mode (``fsdp2``; ``symm_mem`` in its own spawn with ``NCCL_CTA_POLICY=2``;
``tide`` = TIDE-AG + TIDE-RS), issued as in training:

- AG as forward prefetching does (FORWARD state: copy-in and collective on FSDP's
  all-gather streams; the copy-out waits on the compute stream after the GEMMs);
- RS as the post-backward hook does (FSDP2: chunk_cat on the compute stream, the
  collective on FSDP's reduce-scatter stream);

a burst of GEMMs is queued on the compute stream right after the collective is issued
(burst length from a warm-up: about 1.5x the collective's duration). A GEMM counts as
"beside" when it ends before the collective's end event (FSDP's all-gather event /
post-reduce event, marked with a timing event on a side stream). Alone: the same bursts
without a collective. Per round: median of the GEMM times; reported: the two rounds
(interleaved over the modes of a spawn) and their median; slowdown = beside / alone - 1.
Also the collective's own time with and without the GEMM burst.

Results (rank 0): ``<out-dir>/<date>_<machine>_<commit>_interference.{json,md,png}``,
JSON rewritten after every (mode, round); the Markdown is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_collectives
import common
import harness  # on import: NVLink multicast off (docs/design/2026-11-29-h200-facts.md)
from gemms import build_gemm

# name -> (M, K, N); a grouped GEMM: (experts, M per expert, K, N)
GEMMS: dict[str, tuple[int, ...]] = {
    "single_wave": (1024, 4096, 8192),
    "large": (8192, 8192, 8192),
    "grouped_experts": (128, 512, 768, 2048),
}
SMALL_GEMMS: dict[str, tuple[int, ...]] = {
    "single_wave": (256, 512, 512),
    "large": (1024,) * 3,
    "grouped_experts": (4, 64, 128, 128),
}
MODES = ("fsdp2", "symm_mem", "tide")
OPS = ("ag", "rs")
ROUNDS = 2
WARMUP = 2
MIN_BURST, MAX_BURST = 3, 256
LAYER = "llama70b"

COLUMNS = [
    ("gemm", "GEMM (M, K, N)"),
    ("op", "beside"),
    ("mode", "mode"),
    ("alone_ms", "alone ms"),
    ("r1_ms", "r1 beside ms"),
    ("r2_ms", "r2 beside ms"),
    ("beside_ms", "beside ms"),
    ("slowdown_pct", "slowdown %"),
    ("samples", "GEMMs counted"),
    ("coll_alone_ms", "collective alone ms"),
    ("coll_beside_ms", "collective beside GEMMs ms"),
    ("error", "error"),
]


@dataclass(frozen=True)
class BenchConfig:
    """What one spawn measures (``modes``: the modes of that spawn)."""

    reps: int
    modes: tuple[str, ...]
    small: bool
    stem: str


def gemm_label(name: str, shape: Sequence[int]) -> str:
    """``single_wave (1024, 4096, 8192)``; a grouped GEMM ``grouped_experts (128 x 512,
    768, 2048)`` (experts x rows per expert, K, N)."""
    if len(shape) == 4:
        return f"{name} ({shape[0]} x {shape[1]}, {shape[2]}, {shape[3]})"
    return f"{name} ({shape[0]}, {shape[1]}, {shape[2]})"


def overlapped(intervals: Sequence[tuple[float, float]], coll_end_ms: float) -> list[float]:
    """Durations of the GEMMs (``(start, end)`` ms from a common origin) that ended
    before the collective did."""
    return [end - start for start, end in intervals if end <= coll_end_ms]


def burst_length(coll_ms: float, gemm_ms: float) -> int:
    """GEMMs to queue so that the burst outlasts a collective of ``coll_ms``."""
    if gemm_ms <= 0:
        return MAX_BURST
    return max(MIN_BURST, min(MAX_BURST, math.ceil(1.5 * coll_ms / gemm_ms) + 2))


# ---------------------------------------------------------------- measurement


@dataclass
class Burst:
    """Timing events of one burst; read them with :meth:`times` after a sync."""

    origin: torch.cuda.Event
    coll_end: torch.cuda.Event | None
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]]

    def times(self) -> tuple[float | None, list[tuple[float, float]]]:
        """(collective end ms or None, [(GEMM start, GEMM end) ms]) from the origin."""
        coll = self.origin.elapsed_time(self.coll_end) if self.coll_end is not None else None
        return coll, [
            (self.origin.elapsed_time(s), self.origin.elapsed_time(e)) for s, e in self.marks
        ]


def run_burst(
    gemm: Callable[[], None] | None,
    n: int,
    device: torch.device,
    issue: Callable[[], torch.Event | None] | None = None,
) -> Burst:
    """Barrier and sync, then ``issue()`` (a collective; returns its end event) and
    ``n`` GEMMs on the compute stream, each between timing events. The caller
    finishes the collective and synchronizes before reading the times."""
    dist.barrier()
    harness.sync(device)
    side = torch.cuda.Stream(device=device)
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    side.wait_event(origin)
    coll_end = harness.timing_event_after(issue(), side) if issue is not None else None
    marks = []
    for _ in range(n if gemm is not None else 0):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm()
        stop.record()
        marks.append((start, stop))
    return Burst(origin, coll_end, marks)


def gemm_alone(gemm: Callable[[], None], device: torch.device, n: int, reps: int) -> list[float]:
    """GEMM times of ``reps`` bursts of ``n`` without a collective."""
    times: list[float] = []
    for _ in range(reps):
        burst = run_burst(gemm, n, device)
        harness.sync(device)
        times += [end - start for start, end in burst.times()[1]]
    return times


def beside_collective(
    op: str,
    model,
    group,
    gemm: Callable[[], None] | None,
    n: int,
    device: torch.device,
    rank: int,
    step: int,
) -> tuple[float, list[float]]:
    """One collective ``op`` with ``n`` GEMMs queued beside it: (collective ms,
    durations of the GEMMs that ended before it). Leaves the model resharded."""
    if op == "ag":

        def issue() -> torch.Event | None:
            return harness.issue_all_gather(group)

        def finish() -> None:
            harness.finish_all_gather(group)
            harness.sync(device)
            model.reshard()

    else:
        model.unshard()
        harness.set_random_grads(group, harness.grad_seed(rank, step))

        def issue() -> torch.Event | None:
            group.post_backward()
            return harness.post_reduce_event(group)

        def finish() -> None:
            group.finalize_backward()
            harness.release_post_backward_state(group)
            harness.sync(device)
            model.zero_grad(set_to_none=True)

    burst = run_burst(gemm, n, device, issue)
    finish()
    coll_ms, intervals = burst.times()
    return coll_ms, overlapped(intervals, coll_ms)


def measure_mode(
    mode: str,
    gemms: dict[str, Callable[[], None]],
    alone: dict[str, float],
    device,
    reps: int,
    small: bool,
) -> dict[str, Any]:
    """Every (op, GEMM) beside ``mode``'s collectives on a fresh model, plus the
    collectives alone. Raises on failure (the caller records it)."""
    from torchtitan_tide import comm

    rank = dist.get_rank()
    spec = (harness.SMALL_LAYERS if small else harness.FULL_LAYERS)[LAYER]
    mode_spec = bench_collectives.MODES[mode]
    built: dict[str, Any] = {}

    def apply_mode(module) -> None:
        built["model"] = module
        comm.apply(module, mode_spec.comm_mode, **mode_spec.options)
        built["applied"] = True

    out: dict[str, Any] = {}
    try:
        model, group = harness.build_fsdp_layer(spec, device, before_init=apply_mode)
        step = 0
        for op in OPS:
            coll_alone = []
            for _ in range(WARMUP + reps):
                step += 1
                coll_alone.append(
                    beside_collective(op, model, group, None, 0, device, rank, step)[0]
                )
            coll_ms = common.median(coll_alone[WARMUP:])
            out[op] = {"coll_alone_ms": coll_ms, "gemms": {}}
            for name, gemm in gemms.items():
                n = burst_length(coll_ms, alone[name])
                samples, colls = [], []
                for i in range(WARMUP + reps):
                    step += 1
                    c, t = beside_collective(op, model, group, gemm, n, device, rank, step)
                    if i >= WARMUP:
                        samples += t
                        colls.append(c)
                out[op]["gemms"][name] = {
                    "burst": n,
                    "samples": len(samples),
                    "median_ms": common.median(samples) if samples else None,
                    "coll_beside_ms": common.median(colls),
                    "times_ms": [round(t, 4) for t in samples],
                }
    finally:
        if built.get("applied"):
            comm.remove(built["model"])
        built.clear()
    return out


def _worker(rank: int, world: int, cfg: BenchConfig) -> None:
    device = torch.device("cuda", rank)
    shapes = SMALL_GEMMS if cfg.small else GEMMS
    gemms = {
        name: build_gemm(shape, device, seed=i) for i, (name, shape) in enumerate(shapes.items())
    }
    results = json.loads(Path(cfg.stem + ".json").read_text()) if rank == 0 else {}
    for rnd in range(1, ROUNDS + 1):
        alone = {}
        for name, gemm in gemms.items():
            gemm_alone(gemm, device, 8, WARMUP)  # warm-up (cuBLAS heuristics, clocks)
            alone[name] = common.median(gemm_alone(gemm, device, 16, 4))
        for mode in cfg.modes:
            t0, err, res = time.perf_counter(), None, {}
            try:
                res = measure_mode(mode, gemms, alone, device, cfg.reps, cfg.small)
            except Exception as e:  # noqa: BLE001 - recorded; the next mode runs
                res = harness.error_info(e)
                err = res["error"]
                print(f"[rank {rank}] {mode} round {rnd} FAILED: {err}", flush=True)
            gc.collect()  # the model's FSDP state holds reference cycles
            torch.cuda.empty_cache()
            agreed = harness.agree_errors(err)
            if agreed and err is None:
                res = {"error": f"failed on another rank: {agreed}"}
            if rank != 0:
                continue
            res.update(round=rnd, alone_ms=alone, wall_s=round(time.perf_counter() - t0, 2))
            results.setdefault("modes", {}).setdefault(mode, []).append(res)
            print(f"{mode} round {rnd}: {common.short_error(res.get('error')) or 'ok'}", flush=True)
            harness.save_quietly(write_outputs, results)


# ---------------------------------------------------------------- summary


def table_rows(results: dict) -> list[dict[str, Any]]:
    """One row per (GEMM, op, mode): alone / beside medians and slowdown."""
    shapes = results["config"].get("gemms_mkn") or (
        SMALL_GEMMS if results["config"]["small"] else GEMMS
    )  # the shapes this result was measured with (gemms_mkn: (M, K, N) or (E, M, K, N))
    by_mode = results.get("modes", {})
    modes = [m for m in common.MODE_ORDER if m in by_mode] + sorted(
        m for m in by_mode if m not in common.MODE_ORDER
    )
    rows = []
    for name, mkn in shapes.items():
        for op in OPS:
            for mode in modes:
                rounds = by_mode[mode]
                ok = [r for r in rounds if "error" not in r]
                per_round = [((r.get(op) or {}).get("gemms") or {}).get(name, {}) for r in rounds]
                meds = [g.get("median_ms") for g in per_round]
                beside = [m for m in meds if m is not None]
                alone = [r["alone_ms"][name] for r in ok if name in r.get("alone_ms", {})]
                row: dict[str, Any] = {
                    "gemm": gemm_label(name, mkn),
                    "op": op,
                    "mode": mode,
                    "alone_ms": common.median(alone) if alone else None,
                    "r1_ms": meds[0] if meds else None,
                    "r2_ms": meds[1] if len(meds) > 1 else None,
                    "beside_ms": common.median(beside) if beside else None,
                    "samples": sum(g.get("samples", 0) for g in per_round),
                    "coll_alone_ms": _median_at(ok, op, "coll_alone_ms"),
                    "coll_beside_ms": _median_at(ok, op, "gemms", name, "coll_beside_ms"),
                    "error": "; ".join(
                        f"r{r.get('round')}: {common.short_error(r['error'])}"
                        for r in rounds
                        if "error" in r
                    )
                    or None,
                }
                a, b = row["alone_ms"], row["beside_ms"]
                row["slowdown_pct"] = 100 * (b / a - 1) if (a and b) else None
                rows.append(row)
    return rows


def _median_at(rounds: Sequence[dict], *keys: str) -> float | None:
    """Median over ``rounds`` of ``round[k0][k1]...`` where present."""
    vals = []
    for r in rounds:
        for key in keys:
            r = r.get(key) if isinstance(r, dict) else None
        if isinstance(r, (int, float)):
            vals.append(float(r))
    return common.median(vals) if vals else None


def headline(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Slowdown % of each GEMM beside each collective, by mode."""
    out = []
    for gemm in dict.fromkeys(r["gemm"] for r in rows):
        for op in OPS:
            sub = [r for r in rows if r["gemm"] == gemm and r["op"] == op]
            values = {r["mode"]: r.get("slowdown_pct") for r in sub}
            if any(v is not None for v in values.values()):
                label = "all-gather" if op == "ag" else "reduce-scatter"
                out.append(
                    common.headline_row(
                        f"interference {gemm.split(' ')[0]}",
                        f"GEMM slowdown % beside {label}",
                        values,
                    )
                )
    return out


def write_outputs(results: dict, final: bool) -> str:
    """Table and headline into ``results``, then ``<stem>.json`` / ``.md`` (and
    ``.png`` when ``final``). Returns the Markdown."""
    rows = table_rows(results)
    results["tables"] = [{"title": "GEMM beside collectives", "columns": COLUMNS, "rows": rows}]
    results["headline"] = headline(rows)
    meta, cfg = results["metadata"], results["config"]
    notes = (
        f"{meta['machine']} ({meta['hostname']}), torch {meta['torch']}, NCCL {meta['nccl']}, "
        f"CUDA {meta['cuda']}, commit {meta['commit']}, world {meta['world_size']}, "
        f"{meta['date']}; layer {cfg['layer']}, {cfg['reps']} bursts per (op, GEMM, mode, "
        f"round), status {results['status']}.\n\n"
        "GEMMs bf16 on the compute stream, queued right after the collective is issued as "
        "FSDP issues it in training (AG: forward-prefetch streams; RS: post-backward). A GEMM "
        "counts when it ends before the collective's end event. alone / beside ms: median "
        "GEMM time (beside: median of the two round medians); slowdown = beside / alone - 1. "
        "Collective ms: issue to end event, without / with the GEMM burst. "
        "docs/design/2026-11-29-h200-facts.md reference (2x H200): single-wave 0.18 ms alone, +121% beside NCCL RS, +43% beside a "
        "copy-engine copy; 8192^3 1.40 ms, +15% / +9%.\n"
    )
    charts = []
    if final:
        for op in OPS:
            sub = [r for r in rows if r["op"] == op]
            if sub:
                charts.append(
                    common.BarChart(
                        f"GEMM slowdown beside {'all-gather' if op == 'ag' else 'reduce-scatter'}",
                        [f"{r['gemm'].split(' ')[0]} {r['mode']}" for r in sub],
                        [r.get("slowdown_pct") for r in sub],
                        "%",
                    )
                )
    return common.write_result(
        cfg["stem"], results, "GEMM interference beside FSDP collectives", notes, charts
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_out_dir(ap)
    ap.add_argument("--world", type=int, default=None, help="processes (default: min(2, GPUs))")
    ap.add_argument("--reps", type=int, default=6, help="bursts per (op, GEMM, mode, round)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--small", action="store_true", help="tiny layer and GEMMs (tests)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="every compute class beside each engine on one GPU "
                         "(interference_one_gpu.py)")  # fmt: skip
    ap.add_argument(
        "--side-ms", type=float, default=4.0,
        help="--one-gpu: each side op repeated to about this many ms alone",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.one_gpu:
        import interference_one_gpu

        return interference_one_gpu.run(args)
    modes = tuple(args.modes.split(","))
    if bad := [m for m in modes if m not in bench_collectives.MODES]:
        ap.error(f"unknown modes {bad}; choose from {sorted(bench_collectives.MODES)}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world or min(2, n_gpus)
    if world < 2 or n_gpus < world:
        print(f"needs >= 2 CUDA GPUs and --world <= {n_gpus} (got {world})", file=sys.stderr)
        return 2
    meta = common.metadata(world)
    stem = str(
        common.result_stem(
            args.out_dir, "interference_small" if args.small else "interference", meta
        )
    )
    shapes = SMALL_GEMMS if args.small else GEMMS
    results: dict[str, Any] = {
        "kind": "interference",
        "metadata": meta,
        "config": {
            "reps": args.reps,
            "warmup": WARMUP,
            "rounds": ROUNDS,
            "layer": LAYER,
            "gemms_mkn": {k: list(v) for k, v in shapes.items()},
            "modes": list(modes),
            "small": args.small,
            "stem": stem,
        },
        "status": "partial",
        "launches": [],
        "modes": {},
    }
    return harness.run_benchmark(
        results,
        _worker,
        world,
        "cuda",
        lambda launch: BenchConfig(args.reps, launch.modes, args.small, stem),
        write_outputs,
    )


if __name__ == "__main__":
    sys.exit(main())
