"""TIDE-RS cross-node wire dtype: error of the reduced gradient, and bytes on the wire (CPU).

    python scripts/bench/rs_wire_error.py --out-dir bench/results [--trials 2]

One Llama-like layer (``harness.llama_layer(512, 1536, 8, 2, 64)``, 2.89M elements:
attention with GQA, SwiGLU FFN, norms) is one FSDP group (fp32 master parameters,
bf16 param dtype) on gloo ranks laid out as ``N x L`` (nodes x ranks per node,
emulated with ``[tide] local_world_size``): 2x2, 2x4, 4x2. Every rank puts fresh
random bf16 gradients (:data:`DISTRIBUTIONS`) on the unsharded parameters and FSDP's
own ``post_backward`` reduces them with each of :data:`MODES`:

- ``fsdp2_fp32``: stock FSDP2, ``reduce_dtype`` fp32 (bf16 gradients cast to fp32,
  reduce-scatter summed in fp32; gloo: forced SUM, divided after, as the tests run it).
- ``fsdp2_bf16``: stock FSDP2, ``reduce_dtype`` bf16 (= param dtype: FSDP2 sums in
  bf16, every addition of the reduce-scatter rounded to bf16, then casts to fp32).
- ``tide_fp32_wire`` / ``tide_bf16_wire``: TIDE-RS, ``[tide] rs_wire_dtype``
  float32 / bfloat16 (node-local sum in fp32; across nodes each node's fp32 partial
  as it is, or rounded once to bf16; the owner adds in fp32).

Reference: the float64 mean of all ranks' gradients (a float64 all-reduce of bf16
values: exact here). Errors, per parameter, worst parameter reported (max over
parameters and trials):

- ``rms_rel`` = ||x - ref||_2 / ||ref||_2 over the parameter (all shards);
- ``max_rel`` = max |x - ref| / max |ref|;
- ``max_err_mag`` = max over elements of |x - ref| / m, m = mean over ranks of
  |gradient| (the magnitude the rounding bounds are stated in: TIDE bf16 wire
  <= 2^-8 = 3.9e-3 plus fp32 terms; fp32 paths ~ W x 2^-24).

Bytes on the cross-node wire per rank per reduce (TIDE-RS phase 2), from the plan:
``(N - 1) x shard numel x itemsize``, checked against the transport's counter
(``RSBuffers.sent_bytes``); also the formula for full-size Llama-3.1-70B layers.
Outputs ``<date>_cpu_<commit>_rs_wire_error.{json,md,png}`` (``common.result_stem``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import harness

LAYER = harness.LayerSpec(
    "llama_512",
    "Llama-like layer (dim 512, FFN 1536, GQA 8/2)",
    harness.llama_layer(512, 1536, 8, 2, 64),
)
LAYOUTS = ((2, 2), (2, 4), (4, 2))  # (nodes N, ranks per node L)
MODES = ("fsdp2_fp32", "fsdp2_bf16", "tide_fp32_wire", "tide_bf16_wire")
DISTRIBUTIONS = {
    "iid_normal": "independent N(0, s_p^2) per rank (pure noise: the mean cancels)",
    "shared_signal": "s_p (shared N(0,1) + own N(0,1)) per rank: a common gradient plus noise",
    "row_scaled": "independent N(0,1) x a per-row scale exp(2 z), z ~ N(0,1) shared",
    "heavy_tailed": "independent Student-t (2 degrees of freedom) x s_p",
}
# Per-parameter scale s_p: Llama-like spread of gradient magnitudes across a layer
# (illustrative; relative errors do not depend on it: bf16 has fp32's exponent range).
SCALES = {
    "attention_wq": 2e-5, "attention_wk": 2e-5, "attention_wv": 1e-4, "attention_wo": 1e-4,
    "feed_forward_w1": 3e-4, "feed_forward_w2": 1e-3, "feed_forward_w3": 3e-4,
    "attention_norm": 1e-2, "ffn_norm": 1e-2,
}  # fmt: skip
EPS_BF16, EPS_FP32 = 2.0**-8, 2.0**-24  # unit roundoffs, round to nearest


def make_grad(distribution: str, shape: tuple[int, ...], scale: float, seed: int, rank: int):
    """bf16 gradient of rank ``rank``: ``seed`` draws what ranks share, ``seed + rank + 1``
    what is their own (reproducible)."""
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1 + rank)
    if distribution == "iid_normal":
        g = torch.randn(shape, generator=own)
    elif distribution == "shared_signal":
        g = torch.randn(shape, generator=shared) + torch.randn(shape, generator=own)
    elif distribution == "row_scaled":
        rows = torch.exp(2 * torch.randn(shape[0], generator=shared))
        g = torch.randn(shape, generator=own) * rows.view(-1, *([1] * (len(shape) - 1)))
    elif distribution == "heavy_tailed":
        z, a, b = (torch.randn(shape, generator=own) for _ in range(3))
        g = z / torch.sqrt((a * a + b * b) / 2)  # Student-t, 2 degrees of freedom
    else:
        raise ValueError(f"unknown distribution {distribution!r}; one of {list(DISTRIBUTIONS)}")
    return (g * scale).to(torch.bfloat16)


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of ``full`` as FSDP2 shards dim 0 (``torch.chunk``)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def _build(mode: str, lws: int, device: torch.device):
    from torchtitan_tide import comm

    def tide(wire: str):
        return lambda m: comm.apply(m, "tide", local_world_size=lws, rs_wire_dtype=wire)

    before, reduce_dtype = {
        "fsdp2_fp32": (None, torch.float32),
        "fsdp2_bf16": (None, torch.bfloat16),
        "tide_fp32_wire": (tide("float32"), torch.float32),
        "tide_bf16_wire": (tide("bfloat16"), torch.float32),
    }[mode]
    return harness.build_fsdp_layer(LAYER, device, before, reduce_dtype)


def _layout_worker(
    rank: int, world: int, lws: int, trials: int, out: dict, device_type: str = "cpu"
) -> None:
    """All modes and distributions of one layout; rank 0 writes ``out[layout]`` and the
    TIDE-AG transport its groups ran (``cuda``: every rank on GPU 0, NCCL windows)."""
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    tide_rs.set_poison(float("nan"))  # every TIDE-RS buffer poisoned before it is written
    nodes = world // lws
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    models = {mode: _build(mode, lws, device) for mode in MODES}
    states = {m: g._tide_rs_state for m, (_, g) in models.items() if hasattr(g, "_tide_rs_state")}
    shard_numel = sum(fp._sharded_param_data.numel() for fp in models["fsdp2_fp32"][1].fsdp_params)
    # stats[(distribution, mode)][param] = worst (rms_rel, max_rel, max_err_mag)
    stats: dict[tuple[str, str], dict[str, list[float]]] = {}
    sent: dict[str, list[int]] = {m: [] for m in states}
    for d_index, distribution in enumerate(DISTRIBUTIONS):
        for trial in range(trials):
            seed = 10_000 * d_index + 100 * trial
            names = [harness.param_name(fp) for fp in models["fsdp2_fp32"][1].fsdp_params]
            grads = {
                name: make_grad(distribution, LAYER.params[name], SCALES[name], seed + 17 * i,
                                rank).to(device)
                for i, name in enumerate(names)
            }  # fmt: skip
            ref, mag = {}, {}
            for name, g in grads.items():
                total, absolute = g.double(), g.double().abs()
                dist.all_reduce(total)
                dist.all_reduce(absolute)
                ref[name] = _shard(total / world, rank, world)
                mag[name] = _shard(absolute / world, rank, world)
            for mode, (model, group) in models.items():
                before = states[mode].buffers.sent_bytes if mode in states else 0
                model.unshard()
                for fp in group.fsdp_params:
                    fp.unsharded_param.grad = grads[harness.param_name(fp)].clone()
                harness.reduce_scatter(group)
                if mode in states:
                    sent[mode].append(states[mode].buffers.sent_bytes - before)
                worst = stats.setdefault((distribution, mode), {})
                for fp in group.fsdp_params:
                    name = harness.param_name(fp)
                    local = fp.sharded_param.grad.to_local().double()
                    if torch.isnan(local).any():
                        raise RuntimeError(f"{mode} {name}: NaN left in the reduced gradient")
                    err = (local - ref[name]).abs()
                    parts = torch.tensor(
                        [(err * err).sum(), (ref[name] ** 2).sum()], dtype=torch.float64,
                        device=device,
                    )
                    peaks = torch.tensor(
                        [err.max() if err.numel() else 0.0,
                         ref[name].abs().max() if err.numel() else 0.0,
                         (err / mag[name]).nan_to_num(0.0).max() if err.numel() else 0.0],
                        dtype=torch.float64, device=device,
                    )  # fmt: skip
                    dist.all_reduce(parts)
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
                    now = [
                        math.sqrt(parts[0] / parts[1]),
                        float(peaks[0] / peaks[1]),
                        float(peaks[2]),
                    ]
                    old = worst.get(name, [0.0, 0.0, 0.0])
                    worst[name] = [max(a, b) for a, b in zip(old, now)]
                model.zero_grad(set_to_none=True)
    for mode, values in sent.items():  # the counter against the plan
        itemsize = 2 if mode == "tide_bf16_wire" else 4
        expected = (nodes - 1) * shard_numel * itemsize
        if any(v != expected for v in values):
            raise RuntimeError(f"{mode}: wire counter {values} != plan {expected} per reduce")
        if states[mode].calls != len(values):
            raise RuntimeError(f"{mode}: TIDE-RS ran {states[mode].calls} of {len(values)} reduces")
    tide_rs.set_poison(None)
    numels = {name: math.prod(shape) for name, shape in LAYER.params.items()}
    transport = states["tide_bf16_wire"].transport
    if rank == 0:
        out[f"{nodes}x{lws}"] = {
            "nodes": nodes,
            "local": lws,
            "world": world,
            "tide_transport": type(transport).__name__,
            "tide_phase2": getattr(states["tide_bf16_wire"].cross_node, "name", None),
            "shard_numel": shard_numel,
            "wire_bytes_counted": {m: v[0] for m, v in sent.items()},
            "errors": {
                f"{d}|{m}": {
                    "rms_rel": max(v[0] for v in per.values()),
                    "rms_rel_layer": sum(v[0] * numels[n] for n, v in per.items())
                    / sum(numels[n] for n in per),
                    "max_rel": max(v[1] for v in per.values()),
                    "max_err_mag": max(v[2] for v in per.values()),
                    "worst_param": max(per, key=lambda n: per[n][0]),
                }
                for (d, m), per in stats.items()
            },
        }


def wire_bytes(layer_numel_rows: dict[str, tuple[int, ...]], nodes: int, local: int) -> dict:
    """Cross-node bytes per rank per reduce of one layer (plan): ``(N - 1) x shard x itemsize``,
    shard = the padded per-rank shard (FSDP2: ceil(dim 0 / W) rows)."""
    from torchtitan_tide.comm.plans.memory_plan import GroupShape, group_shard_numel

    world = nodes * local
    shard = group_shard_numel(GroupShape("layer", tuple(layer_numel_rows.values())), world)
    return {
        "shard_numel": shard,
        "fp32_bytes": (nodes - 1) * shard * 4,
        "bf16_bytes": (nodes - 1) * shard * 2,
    }


def _tables(results: dict) -> list[dict]:
    error_rows = []
    for layout, res in results["layouts"].items():
        for key, e in res["errors"].items():
            distribution, mode = key.split("|")
            row = {"layout": layout, "distribution": distribution, "mode": mode, **e}
            for key in ("rms_rel", "rms_rel_layer", "max_rel", "max_err_mag"):
                row[key] = f"{e[key]:.2e}"
            error_rows.append(row)
    bytes_rows = []
    for layout, res in results["layouts"].items():
        plan = wire_bytes(LAYER.params, res["nodes"], res["local"])
        counted = res["wire_bytes_counted"]
        bytes_rows.append({
            "layer": LAYER.name, "layout": layout, "shard_numel": plan["shard_numel"],
            "fp32_mib": plan["fp32_bytes"] / 2**20, "bf16_mib": plan["bf16_bytes"] / 2**20,
            "counter_checked": counted == {"tide_fp32_wire": plan["fp32_bytes"],
                                           "tide_bf16_wire": plan["bf16_bytes"]},
        })  # fmt: skip
    full = harness.FULL_LAYERS["llama70b"]
    for nodes, local in ((2, 8), (4, 8), (8, 8)):
        plan = wire_bytes(full.params, nodes, local)
        bytes_rows.append({
            "layer": "llama70b (formula)", "layout": f"{nodes}x{local}",
            "shard_numel": plan["shard_numel"], "fp32_mib": plan["fp32_bytes"] / 2**20,
            "bf16_mib": plan["bf16_bytes"] / 2**20, "counter_checked": None,
        })  # fmt: skip
    return [
        {
            "title": "Error of the reduced gradient vs the float64 mean",
            "columns": [
                ["layout", "N x L"],
                ["distribution", "gradients"],
                ["mode", "mode"],
                ["rms_rel_layer", "RMS rel (layer)"],
                ["rms_rel", "RMS rel (worst)"],
                ["max_rel", "max abs rel (worst)"],
                ["max_err_mag", "max err / magnitude"],
                ["worst_param", "worst (RMS)"],
            ],
            "rows": error_rows,
        },
        {
            "title": "TIDE-RS cross-node bytes per rank per reduce (one layer)",
            "columns": [
                ["layer", "layer"],
                ["layout", "N x L"],
                ["shard_numel", "shard numel"],
                ["fp32_mib", "fp32 wire MiB"],
                ["bf16_mib", "bf16 wire MiB"],
                ["counter_checked", "counter = plan"],
            ],
            "rows": bytes_rows,
        },
    ]


def _charts(results: dict) -> list[common.BarChart]:
    charts = []
    for distribution in DISTRIBUTIONS:
        labels, values = [], []
        for layout, res in results["layouts"].items():
            for mode in MODES:
                e = res["errors"].get(f"{distribution}|{mode}")
                labels.append(f"{layout} {mode}")
                rms = e["rms_rel_layer"] if e else 0.0
                values.append(-math.log10(rms) if rms > 0 else None)
        charts.append(
            common.BarChart(distribution, labels, values, "-log10 RMS rel error (layer): digits")
        )
    return charts


def _notes(results: dict) -> str:
    lines = [
        "",
        (
            f"Layer: {LAYER.label}, {LAYER.numel():,} elements, bf16 gradients, "
            f"{results['config']['trials']} trials per distribution, fresh gradients per trial."
        ),
        "Distributions: " + "; ".join(f"`{k}`: {v}" for k, v in DISTRIBUTIONS.items()) + ".",
        (
            "Errors (module docstring): `RMS rel (layer)` = the parameters' RMS rel errors "
            "averaged weighted by size; the others: worst parameter over parameters and trials; "
            "`max err / magnitude` is in units of the mean |gradient| over ranks (TIDE bf16 "
            "wire bound 2^-8 = 3.9e-3)."
        ),
        (
            "Bytes: `(N - 1) x shard numel x itemsize` per rank per reduce (TIDE-RS phase 2); "
            "`counter = plan`: the transport's counter matched the plan on every reduce. "
            "Stock FSDP2's reduce-scatter is not split into node-local and cross-node bytes."
        ),
        f"Wall time: {results.get('wall_s')} s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_out_dir(parser)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: gloo ranks; cuda: every rank on GPU 0 as ONE NCCL node "
        "(NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30: TIDE on NCCL windows)",
    )  # fmt: skip
    parser.add_argument("--layouts", default="",
                        help="NxL layouts, comma-separated (default: 2x2,2x4,4x2 on CPU, "
                        "2x2,2x4 on the GPU)")  # fmt: skip
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    import torchtitan_tide.comm  # noqa: F401 - imported once, inherited by the forked ranks

    cuda = args.device == "cuda"
    layouts = ((2, 2), (2, 4)) if cuda else LAYOUTS
    if args.layouts:
        layouts = tuple(tuple(int(x) for x in item.split("x")) for item in args.layouts.split(","))
    meta = common.metadata(world_size=max(n * l for n, l in layouts),
                           **({} if cuda else {"machine": "cpu"}))  # fmt: skip
    stem = common.result_stem(args.out_dir, "rs_wire_error", meta)
    manager = mp.Manager()
    out = manager.dict()
    t0 = time.perf_counter()
    for nodes, local in layouts:
        lt0 = time.perf_counter()
        if cuda:
            harness.spawn(_layout_worker, nodes * local, "cuda:0",
                          (local, args.trials, out, "cuda"),
                          (("NCCL_MULTI_RANK_GPU_ENABLE", "1"),))  # fmt: skip
        else:
            harness.spawn(_layout_worker, nodes * local, "cpu", (local, args.trials, out),
                          start_method="fork")  # fmt: skip
        print(f"{nodes}x{local}: {time.perf_counter() - lt0:.1f} s", flush=True)
    results: dict[str, Any] = {
        "kind": "rs_wire_error",
        "metadata": meta,
        "config": {
            "layer": LAYER.name,
            "layer_numel": LAYER.numel(),
            "trials": args.trials,
            "layouts": [f"{n}x{l}" for n, l in layouts],
            "device": "one GPU, ranks as one NCCL node" if cuda else "cpu (gloo)",
            "modes": list(MODES),
            "distributions": DISTRIBUTIONS,
            "scales": SCALES,
        },
        "layouts": {k: out[k] for k in (f"{n}x{l}" for n, l in layouts)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    results["tables"] = _tables(results)
    text = common.write_result(
        stem, results, "TIDE-RS cross-node wire dtype: gradient error and bytes "
        + ("(one GPU, N x L as one NCCL node, NCCL windows)" if cuda else "(CPU, gloo)"),
        notes=_notes(results), charts=_charts(results),
    )  # fmt: skip
    common.announce_results(stem, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
