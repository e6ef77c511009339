"""TIDE-RS accumulate kernel: bandwidth against CTA count (one GPU).

    python scripts/bench/bench_accumulate.py --out-dir bench/results [--numel 427819008]

Sums 2 bf16 rows into an fp32 output (TIDE-RS phase 1 on one node of 2, the
Llama-3.1-70B layer's shard by default) with ``kernels.accumulate_rows`` at
several ``num_ctas`` (persistent) and short-lived launch shapes (block, warps,
cache hints), with full-grid torch ops and an fp32 device-to-device copy of the
same byte count (the bandwidth floor) for reference. Fresh random rows; output
poisoned before each checked run; exactness against the fp32 sum checked once
per variant. Timing: CUDA events after warm-up, median of ``--iters``, two rounds.
Bandwidth counts bytes read + written (2 x 2 B + 4 B per element). SM-weighted
time = time x min(1, CTAs / SM count): the SM share the kernel takes from
concurrent compute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

CTAS = (2, 8, 32, 64)
# Short-lived launch shapes (num_ctas=0): (elements per program, warps); each with
# and without the streaming cache hints. At least 8 bf16 (16 B) per thread.
SHORT_SHAPES = ((4096, 4), (4096, 8), (4096, 16), (8192, 4), (8192, 8), (8192, 16),
                (16384, 8), (16384, 16), (32768, 16), (32768, 32))  # fmt: skip


def _time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return common.median(times)


def _variants() -> dict[str, dict | None]:
    """name -> accumulate_rows launch keywords (None: a reference, not the kernel)."""
    from torchtitan_tide.comm import kernels

    variants: dict[str, dict | None] = {}
    default_shape = (kernels._BLOCK, kernels._NUM_WARPS, kernels._STREAMING)
    for ctas in CTAS:
        variants[f"persistent_{ctas}_ctas"] = {"num_ctas": ctas}
    for block, warps in SHORT_SHAPES:
        for streaming in (False, True):
            default = (block, warps, streaming) == default_shape
            name = f"short_b{block}_w{warps}{'_stream' if streaming else ''}"
            variants[name + (" (default)" if default else "")] = {
                "num_ctas": 0, "block": block, "num_warps": warps, "streaming": streaming,
            }  # fmt: skip
    variants["torch_full_grid"] = None
    variants["memcpy_fp32_same_bytes"] = None
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--numel", type=int, default=427_819_008)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    from torchtitan_tide.comm import kernels

    device = torch.device("cuda", 0)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    rows = torch.randn(2, args.numel, device=device, dtype=torch.bfloat16)
    out = torch.full((args.numel,), float("nan"), device=device)
    ref = rows[0].float() + rows[1].float()
    copy_src = torch.randn(args.numel, device=device)  # memcpy reference: 8 B per element too
    nbytes = args.numel * (2 * 2 + 4)
    variants = _variants()

    def run(name: str) -> None:
        launch = variants[name]
        if name == "torch_full_grid":  # full grid torch ops, same fp32 math: 2 kernels
            out.copy_(rows[0])
            out.add_(rows[1])
        elif name == "memcpy_fp32_same_bytes":
            out.copy_(copy_src)
        else:
            kernels.accumulate_rows(rows, out, accumulate=False, divisor=1.0, **launch)

    results: dict[str, list[float]] = {name: [] for name in variants}
    errors: dict[str, str] = {}
    for _round in range(2):
        for name, times in results.items():
            try:
                out.fill_(float("nan"))
                run(name)
                torch.cuda.synchronize()
                expected = copy_src if name == "memcpy_fp32_same_bytes" else ref
                if _round == 0 and not torch.equal(out, expected):
                    wrong = int((out != expected).sum())
                    errors[name] = f"{wrong} of {args.numel} elements differ from the fp32 sum"
                run(name)
                times.append(_time(lambda n=name: run(n), args.iters))
            except Exception as e:  # noqa: BLE001 - record and go on
                errors[name] = common.short_error(f"{type(e).__name__}: {e}")
    memcpy_ms = common.min_or_none(results["memcpy_fp32_same_bytes"])
    rows_out = []
    for name, times in results.items():
        best = common.min_or_none(times)
        launch = variants[name] or {}
        ctas = launch.get("num_ctas") or sm_count
        rows_out.append(
            {
                "variant": name,
                "ctas": ctas,
                "round_ms": times,
                "best_ms": best,
                "gib_s": nbytes / 2**30 / (best / 1e3) if best else None,
                "of_memcpy": memcpy_ms / best if best and memcpy_ms else None,
                "sm_weighted_ms": best * min(1.0, ctas / sm_count) if best else None,
                "error": errors.get(name),
            }
        )
    meta = common.metadata(1)
    stem = common.result_stem(args.out_dir, "accumulate", meta)
    columns = [
        ["variant", "variant"], ["ctas", "CTAs"], ["best_ms", "ms (best round median)"],
        ["gib_s", "GiB/s (read+write)"], ["of_memcpy", "memcpy ms / ms"],
        ["sm_weighted_ms", "SM-weighted ms"], ["error", "error"],
    ]  # fmt: skip
    results_json = {
        "kind": "accumulate",
        "metadata": meta,
        "args": vars(args),
        "sm_count": sm_count,
        "tables": [{"title": "TIDE-RS accumulate, 2 bf16 rows -> fp32", "columns": columns,
                    "rows": rows_out}],
    }  # fmt: skip
    chart = common.BarChart(
        title="accumulate GiB/s by CTAs",
        labels=[r["variant"] for r in rows_out],
        values=[r["gib_s"] or 0.0 for r in rows_out],
        ylabel="GiB/s",
    )
    print(common.write_result(stem, results_json, "TIDE-RS accumulate kernel", charts=[chart]))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
