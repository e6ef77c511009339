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
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

CTAS = (2, 8, 32, 64)
# Short-lived launch shapes (num_ctas=0): (elements per program, warps, cache hints).
# At least 8 bf16 (16 B) per thread. Measured at ffbcca5: 4096..16384 elements with
# 4..16 warps all within 1% (0.84-0.85 ms for the 70B shard); 32768 slower.
SHORT_SHAPES = ((4096, 16, False), (8192, 16, False), (8192, 16, True), (16384, 16, False),
                (16384, 16, True), (32768, 32, False))  # fmt: skip
DIVISOR = 2.0  # 2 ranks: what TIDE-RS divides by on the 2-GPU machine


@dataclasses.dataclass(frozen=True)
class Variant:
    """One timed case: ``launch`` = accumulate_rows keywords, or None for a reference
    (``torch_full_grid``, ``memcpy_fp32_same_bytes``)."""

    launch: dict | None
    divisor: float = DIVISOR
    accumulate: bool = False  # also read the previous fp32 output (+4 B per element)
    symmetric_rows: bool = False  # rows in a symmetric-memory buffer, as TIDE-RS stages them


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


def _variants() -> dict[str, Variant]:
    from torchtitan_tide.comm.base import kernels

    variants: dict[str, Variant] = {}
    for ctas in CTAS:
        variants[f"persistent_{ctas}_ctas"] = Variant({"num_ctas": ctas})
    default_shape = (kernels._BLOCK, kernels._NUM_WARPS, kernels._STREAMING)
    for block, warps, streaming in SHORT_SHAPES:
        name = f"short_b{block}_w{warps}{'_stream' if streaming else ''}"
        if (block, warps, streaming) == default_shape:
            name += " (default)"
        variants[name] = Variant(
            {"num_ctas": 0, "block": block, "num_warps": warps, "streaming": streaming}
        )
    # The default launch in TIDE-RS's other situations: no division, a division that
    # is not a power of two (div_rn), accumulation into .grad, rows in symmetric memory.
    variants["default, divisor 1"] = Variant({}, divisor=1.0)
    variants["default, divisor 3 (div_rn)"] = Variant({}, divisor=3.0)
    variants["default, accumulate into out"] = Variant({}, accumulate=True)
    variants["default, rows in symmetric memory"] = Variant({}, symmetric_rows=True)
    variants["torch_full_grid"] = Variant(None)
    variants["memcpy_fp32_same_bytes"] = Variant(None)
    return variants


def _symmetric_rows(rows: torch.Tensor) -> torch.Tensor:
    """A copy of ``rows`` in a rendezvoused symmetric-memory buffer (1-rank group),
    allocated as TIDE-RS's copy-engine slots are (``symm_mem.empty``)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    buffer = symm_mem.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
    buffer.copy_(rows)
    return buffer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_out_dir(parser)
    parser.add_argument("--numel", type=int, default=427_819_008)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    from torchtitan_tide.comm.base import kernels

    device = torch.device("cuda", 0)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    rows = torch.randn(2, args.numel, device=device, dtype=torch.bfloat16)
    out = torch.full((args.numel,), float("nan"), device=device)
    prev = torch.randn(args.numel, device=device)  # the .grad an accumulation adds to
    copy_src = torch.randn(args.numel, device=device)  # memcpy reference: 8 B per element too
    variants = _variants()
    errors: dict[str, str] = {}
    symm_rows = None
    try:
        symm_rows = _symmetric_rows(rows)
    except Exception as e:  # noqa: BLE001 - recorded on that variant
        errors["default, rows in symmetric memory"] = common.short_error(f"{type(e).__name__}: {e}")

    def run(name: str, checked: bool = False) -> None:
        """One run; ``checked``: from a known ``out`` (timed runs of the accumulate
        variant keep adding into whatever ``out`` holds: same traffic)."""
        variant = variants[name]
        if name == "torch_full_grid":  # full grid torch ops, same fp32 math: 3 kernels
            out.copy_(rows[0])
            out.add_(rows[1])
            out.div_(variant.divisor)
        elif name == "memcpy_fp32_same_bytes":
            out.copy_(copy_src)
        else:
            if variant.accumulate and checked:
                out.copy_(prev)
            kernels.accumulate_rows(
                symm_rows if variant.symmetric_rows else rows,
                out,
                accumulate=variant.accumulate,
                divisor=variant.divisor,
                **variant.launch,
            )

    def expected(name: str) -> torch.Tensor:
        variant = variants[name]
        if name == "memcpy_fp32_same_bytes":
            return copy_src
        total = prev.clone() if variant.accumulate else torch.zeros_like(out)
        total += rows[0]
        total += rows[1]
        return total.div_(variant.divisor)

    results: dict[str, list[float]] = {name: [] for name in variants}
    for _round in range(2):
        for name, times in results.items():
            if variants[name].symmetric_rows and symm_rows is None:
                continue  # the allocation failed: its error is recorded
            try:
                out.fill_(float("nan"))
                run(name, checked=True)
                torch.cuda.synchronize()
                if _round == 0:
                    want = expected(name)
                    # torch divides by a CUDA scalar through its reciprocal: exact for
                    # powers of two, within one rounding for 3.
                    exact = variants[name].divisor in (1.0, 2.0)
                    ok = (
                        torch.equal(out, want)
                        if exact
                        else torch.allclose(out, want, rtol=2**-23, atol=0.0)
                    )
                    if not ok:
                        wrong = int((out != want).sum())
                        errors[name] = f"{wrong} of {args.numel} elements differ from the fp32 sum"
                    del want
                run(name)
                times.append(_time(lambda n=name: run(n), args.iters))
            except Exception as e:  # noqa: BLE001 - record and go on
                errors[name] = common.short_error(f"{type(e).__name__}: {e}")
    copy_ms = common.min_or_none(results["memcpy_fp32_same_bytes"])
    rows_out = []
    for name, times in results.items():
        variant = variants[name]
        best = common.min_or_none(times)
        ctas = (variant.launch or {}).get("num_ctas") or sm_count
        nbytes = args.numel * (2 * 2 + 4 + (4 if variant.accumulate else 0))
        rows_out.append(
            {
                "variant": name,
                "ctas": ctas,
                "divisor": variant.divisor,
                "round_ms": times,
                "best_ms": best,
                "gib_s": nbytes / 2**30 / (best / 1e3) if best else None,
                "of_memcpy": copy_ms / best if best and copy_ms else None,
                "sm_weighted_ms": best * min(1.0, ctas / sm_count) if best else None,
                "error": errors.get(name),
            }
        )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    meta = common.metadata(1)
    stem = common.result_stem(args.out_dir, "accumulate", meta)
    columns = [
        ["variant", "variant"], ["ctas", "CTAs"], ["best_ms", "ms (best round median)"],
        ["divisor", "divisor"], ["gib_s", "GiB/s (read+write)"], ["of_memcpy", "memcpy ms / ms"],
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
