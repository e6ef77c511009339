"""TIDE-RS accumulate kernel: bandwidth against CTA count (one GPU).

    python scripts/bench/bench_accumulate.py --out-dir bench/results [--numel 427819008]

Sums 2 bf16 rows into an fp32 output (TIDE-RS phase 1 on one node of 2, the
Llama-3.1-70B layer's shard by default) with ``kernels.accumulate_rows`` at
several ``num_ctas``, and with full-grid torch ops for reference. Fresh random
rows; output poisoned once; exactness against the torch path checked once per
variant. Timing: CUDA events after warm-up, median of ``--iters``, two rounds.
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

CTAS = (2, 4, 8, 16, 32, 64)


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
    nbytes = args.numel * (2 * 2 + 4)
    variants = {f"triton_{c}_ctas": c for c in CTAS}

    def run(ctas: int | None) -> None:
        if ctas is None:  # full grid torch ops, same fp32 math: 2 kernels
            out.copy_(rows[0])
            out.add_(rows[1])
        else:
            kernels.accumulate_rows(rows, out, accumulate=False, divisor=1.0, num_ctas=ctas)

    results: dict[str, list[float]] = {name: [] for name in [*variants, "torch_full_grid"]}
    errors: dict[str, str] = {}
    for _round in range(2):
        for name, times in results.items():
            ctas = variants.get(name)
            try:
                run(ctas)
                torch.cuda.synchronize()
                if _round == 0 and not torch.equal(out, ref):
                    errors[name] = "result differs from rows[0].float() + rows[1].float()"
                run(ctas)
                times.append(_time(lambda c=ctas: run(c), args.iters))
            except Exception as e:  # noqa: BLE001 - record and go on
                errors[name] = common.short_error(f"{type(e).__name__}: {e}")
    rows_out = []
    for name, times in results.items():
        best = common.min_or_none(times)
        ctas = variants.get(name, sm_count)
        rows_out.append(
            {
                "variant": name,
                "ctas": ctas,
                "round_ms": times,
                "best_ms": best,
                "gib_s": nbytes / 2**30 / (best / 1e3) if best else None,
                "sm_weighted_ms": best * min(1.0, ctas / sm_count) if best else None,
                "error": errors.get(name),
            }
        )
    meta = common.metadata(1)
    stem = common.result_stem(args.out_dir, "accumulate", meta)
    columns = [
        ["variant", "variant"], ["ctas", "CTAs"], ["best_ms", "ms (best round median)"],
        ["gib_s", "GiB/s (read+write)"], ["sm_weighted_ms", "SM-weighted ms"], ["error", "error"],
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
