"""The simulator's inputs: every figure it uses, read from committed measurements under
``bench/results`` (each with its source, recorded in the output), and the measured steps
it is validated against.

Inputs (:class:`Inputs`): per-group forward/backward ms, root ms, AdamW and clip ms from
``bench_trace.py`` (``compute``: scaled to the config's tokens, sequence length and
activation checkpointing; without a trace: FLOPs at ``--mfu``); per mode the rate of each
collective's transport alone, from its own profiled device time in ``bench_collectives``
(2x H200: the NCCL kernel, or the copy engine's copies), and the SM kernels beside it
(the fp32 -> bf16 cast every mode runs, symm_mem's divide) per element; FSDP2's layout
copies per element from ``bench_step``'s profiled kernels; interference in both
directions per engine and compute class (``interference``); the TIDE-RS accumulate
kernel's rate from the profiled step (``bench_step``); the device copy rate
(``bench_accumulate``); the per-step trainer time outside fwd+bwd from a profiled step
breakdown (``bench_step``).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.plans.memory_plan import GroupShape
from torchtitan_tide.simulator import interference as itf
from torchtitan_tide.simulator.cluster import GIB
from torchtitan_tide.simulator.compute import (
    GroupCompute,
    Workload,
    attention_flops_share,
    attention_share_of_blocks,
    compute_from_flops,
    compute_from_trace,
    recompute_fraction,
    trace_shares,
    workload_of,
)
from torchtitan_tide.simulator.results import REPO, RESULTS, SimulateError, read_result
from torchtitan_tide.simulator.results import newest as _newest

__all__ = ["REPO", "RESULTS", "GroupCompute", "SimulateError", "Workload", "read_result"]

H200_BF16_FLOPS = 989e12  # dense bf16 peak, the FLOPs fallback's denominator
H200_SMS = 132
SINGLE_WAVE, LARGE, GROUPED = itf.SINGLE_WAVE, itf.LARGE, itf.GROUPED
MODES = ("fsdp2", "symm_mem", "tide", "tide_ag")

# The committed measurements the defaults read (bench/results). Keys: the model (the
# TOML's [model] name); values: the benchmark's own names.
TRACE_CONFIG = {
    "llama3_tide": "h200x2_llama70b_4layers",
    "qwen3_tide": "h200x2_qwen3_30b_a3b_4layers",
    "wan22": "h200x2_wan22_a14b_20layers",
}
COLLECTIVE_LAYER = {"llama3_tide": "llama70b", "qwen3_tide": "qwen3_30b_a3b", "wan22": "wan22_a14b"}
COLLECTIVES_FILE, INTERFERENCE_FILE = itf.COLLECTIVES_FILE, itf.INTERFERENCE_FILE
ACCUMULATE_FILE = "2026-11-30_nvidia-h200-x-2_8a9ccda_accumulate.json"
# The device-to-device copy rate (placement and packing copies): one H200, 065b07c.
COPY_RATE = ("2026-12-03_nvidia-h200-x-1_065b07c_accumulate.json", "memcpy_fp32_same_bytes")
CROSS_NODE_FILE = "2026-12-03_nvidia-h200-x-1_d533948_cross_node_one_node.json"
# The profiled TIDE step whose accumulate kernels are the in-situ rate: Llama-3.1-70B
# width, 4 layers, 2x H200, copy-engine slot barrier (the default): row "tide".
ACCUMULATE_STEP = ("2026-11-30_nvidia-h200-x-2_c0114dd_step_h200x2_llama70b_4layers.json", "tide")
# Measured 2x H200 steps: (file, row mode). tide_ag: the earliest "tide" rows ran TIDE-AG
# with FSDP2's reduce-scatter (TIDE-RS came later).
MEASURED_STEPS = {
    "h200x2_llama70b_4layers": {
        "fsdp2": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_llama70b_4layers.json", "fsdp2"),
        "symm_mem": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_llama70b_4layers.json", "symm_mem"),
        "tide": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_llama70b_4layers.json", "tide"),
        "tide_ag": ("2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_llama70b_4layers.json", "tide"),
    },
    "h200x2_qwen3_30b_a3b_4layers": {
        "fsdp2": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_qwen3_30b_a3b_4layers.json", "fsdp2"),
        "symm_mem": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_qwen3_30b_a3b_4layers.json", "symm_mem"),
        "tide": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_qwen3_30b_a3b_4layers.json", "tide"),
        "tide_ag": ("2026-11-30_nvidia-h200-x-2_c64beae_step_h200x2_qwen3_30b_a3b_4layers.json", "tide"),
    },
    "h200x2_wan22_a14b_20layers": {
        "fsdp2": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_wan22_a14b_20layers.json", "fsdp2"),
        "symm_mem": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_wan22_a14b_20layers.json", "symm_mem"),
        "tide": ("2026-11-30_nvidia-h200-x-2_8a9ccda_step_h200x2_wan22_a14b_20layers.json", "tide"),
        "tide_ag": ("2026-11-30_nvidia-h200-x-2_c64beae_step_h200x2_wan22_a14b_20layers.json", "tide"),
    },
}  # fmt: skip
# The one-GPU trainer step recorded before its result files were committed (issue 21:
# bench_step at world 1 on one H200, commit 8d17df0, profiled step breakdown,
# log_freq 1). A committed world-1 bench_step result of the config replaces it.
WORLD1_RECORDED = {
    "h200x2_llama70b_4layers": {"step_ms": 483.2, "compute_ms": 399.9, "optimizer_ms": 66.4,
                                "host_ms": 14.9 + 2.0, "step_ms_log_freq_10": 471.8},
    "h200x2_qwen3_30b_a3b_4layers": {"step_ms": 199.8, "compute_ms": 134.6,
                                     "optimizer_ms": 35.7, "host_ms": 26.9 + 2.6,
                                     "step_ms_log_freq_10": 173.7},
}  # fmt: skip
WORLD1_RECORDED_SOURCE = (
    "issue 21: bench_step at world 1 on one H200 (8d17df0), profiled step breakdown "
    "(docs/design/2026-12-01-simulator.md)"
)


@dataclass(frozen=True)
class Inputs:
    """Everything but the groups and the cluster; ``sources`` says where each came from.

    ``transport_gibps[mode][ag|rs]``: the rate of each collective's transport alone (no
    layout copy, no cast), from its profiled device time at W = 2: ``S b`` bytes per rank
    (AG bf16, stock RS fp32, TIDE-RS bf16 rows). ``sm_ns[mode]``: ns per shard element of
    the SM kernels beside the transport: ``cast`` (fp32 -> bf16 of the own shard, every
    mode's all-gather), ``divide`` (symm_mem's reduce-scatter). ``layout_ns[mode]``: per
    element, ``copy_out`` (unsharded, per all-gather), ``chunk_cat`` (unsharded, per
    reduce-scatter), ``copy_in`` (shard, per all-gather). ``engines[engine]``: (f, g),
    compute's slowdown beside the engine and the engine's beside compute, mixed over the
    model's compute classes (``class_weights``; :mod:`interference`; ``figures``: the
    per-class table). ``accumulate_gibps``: TIDE-RS accumulate kernel bytes (read +
    write) per second; ``copy_gibps``: bytes copied per second by a local HBM-to-HBM copy
    on the copy engine (``interference.local_copy_rate``: measured, or the most
    pessimistic figure, named so in ``sources["copy"]``).
    ``host_ms``: per-step trainer time outside fwd+bwd and the optimizer.
    ``in_step_level``: :func:`in_step_compute`'s level when it was measured but not
    applied (a one-GPU step's; :func:`with_compute_level` applies one)."""

    compute: Mapping[str, GroupCompute]
    root_fwd_ms: float
    root_bwd_ms: float
    optimizer_ms_per_shard_elem: float
    host_ms: float
    transport_gibps: Mapping[str, Mapping[str, float]]
    layout_ns: Mapping[str, Mapping[str, float]]
    shape_class: str
    engines: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    sm_ns: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    class_weights: Mapping[str, float] = field(default_factory=dict)
    accumulate_gibps: float = 0.0
    copy_gibps: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict)
    in_step_level: float | None = None
    figures: tuple[dict[str, Any], ...] = ()


def with_compute_level(inputs: Inputs, level: float) -> Inputs:
    """``inputs`` with every group's and the root's ms times ``level``."""
    compute = {
        k: GroupCompute(level * c.fwd_ms, level * c.bwd_ms) for k, c in inputs.compute.items()
    }
    return replace(
        inputs,
        compute=compute,
        root_fwd_ms=level * inputs.root_fwd_ms,
        root_bwd_ms=level * inputs.root_bwd_ms,
    )


def without_comm_slowdown(inputs: Inputs) -> Inputs:
    """``inputs`` with no engine slowed by compute (g = 0): the report's bracket."""
    engines = {e: (f, 0.0) for e, (f, _) in inputs.engines.items()}
    return replace(inputs, engines=engines)


def newest_trace(results_dir: Path, config: str) -> Path | None:
    """The newest ``*_trace_<config>.json`` (``bench_trace.py``) under ``results_dir``."""
    return _newest(sorted(results_dir.glob(f"*_trace_{config}.json")))


def _kernel_ms(profile: Mapping[str, Any], part: str) -> float:
    return sum(k["ms"] for k in profile.get("kernels") or [] if part in k["name"])


CAST_KERNEL = "CopyFunctor<c10::BFloat16, float"  # FSDP2's foreach fp32 -> bf16 cast
DIVIDE_KERNEL = "MulFunctor"  # symm_mem's division after its force-sum reduce-scatter


@functools.lru_cache(maxsize=8)
def transport_rates(results_dir: Path, layer: str) -> tuple[dict, dict, str]:
    """(``transport_gibps``, ``sm_ns``, source) of ``layer`` (one FSDP group) at W = 2,
    each from its own profiled device time in ``bench_collectives`` (round 1, per step):
    fsdp2 all-gather / reduce-scatter: NCCL's ring kernels; symm_mem: the copy engine's
    copies (zero-CTA all-gather) and NCCL's symmetric kernel plus its divide; tide: the
    copy engine's copies (TIDE-RS: bf16 rows, its accumulate kernel is an op of its own).
    Bytes ``S b`` per rank (``S`` = half the layer). The cast of every mode's all-gather
    and symm_mem's divide: ns per shard element. Layout copies are not in these figures
    (``layout_costs``), nor the host time of the ``unshard`` / ``post_backward`` call."""
    coll = read_result(results_dir, COLLECTIVES_FILE)
    numel = coll["config"]["layer_numel"].get(layer)
    if not numel or layer not in coll["variants"]:
        raise SimulateError(f"{COLLECTIVES_FILE}: no layer {layer!r}")
    shard = numel / 2
    profiles = {
        mode: {op: v["rounds"][0]["profile"][op] for op in ("ag", "rs")}
        for mode, v in coll["variants"][layer].items()
    }

    def rate(nbytes: float, ms: float) -> float:
        return nbytes / GIB / (ms / 1e3)

    fsdp2, symm, tide = profiles["fsdp2"], profiles["symm_mem"], profiles["tide"]
    divide = _kernel_ms(symm["rs"], DIVIDE_KERNEL)
    rates = {
        "fsdp2": {"ag": rate(2 * shard, fsdp2["ag"]["nccl_kernel_ms"]),
                  "rs": rate(4 * shard, fsdp2["rs"]["nccl_kernel_ms"])},
        "symm_mem": {"ag": rate(2 * shard, symm["ag"]["memcpy_ms"]),
                     "rs": rate(4 * shard, symm["rs"]["nccl_kernel_ms"])},
        "tide": {"ag": rate(2 * shard, tide["ag"]["memcpy_ms"]),
                 "rs": rate(2 * shard, tide["rs"]["memcpy_ms"])},
    }  # fmt: skip
    rates["tide_ag"] = {"ag": rates["tide"]["ag"], "rs": rates["fsdp2"]["rs"]}
    sm = {mode: {"cast": 1e6 * _kernel_ms(profiles[mode]["ag"], CAST_KERNEL) / shard,
                 "divide": 1e6 * divide / shard if mode == "symm_mem" else 0.0}
          for mode in ("fsdp2", "symm_mem", "tide")}  # fmt: skip
    sm["tide_ag"] = sm["tide"]
    text = (
        f"{COLLECTIVES_FILE}, layer {layer} (W = 2, profiled device time): fsdp2 NCCL ring "
        f"AG {fsdp2['ag']['nccl_kernel_ms']:.2f} / RS {fsdp2['rs']['nccl_kernel_ms']:.2f} ms; "
        f"symm_mem copy-engine AG {symm['ag']['memcpy_ms']:.2f}, symmetric RS kernel "
        f"{symm['rs']['nccl_kernel_ms']:.2f} + divide {divide:.2f} ms; tide copy-engine AG "
        f"{tide['ag']['memcpy_ms']:.2f} / RS {tide['rs']['memcpy_ms']:.2f} ms; the cast "
        f"{_kernel_ms(fsdp2['ag'], CAST_KERNEL):.2f} ms (every mode; was counted in each "
        "all-gather's figure before 2026-12-04, the layout copies twice in stock's)"
    )
    return rates, sm, text


@functools.lru_cache(maxsize=8)
def accumulate_rate(results_dir: Path) -> tuple[float, str]:
    """(GiB/s read + written, source) of TIDE-RS's accumulate kernels in the profiled
    2-GPU Llama step (``ACCUMULATE_STEP``: kernel ms per step over the bytes that step's
    phase 1 moves, ``8 S`` per group: 2 bf16 rows in, fp32 out). ``bench_accumulate``'s
    default kernel alone is quoted beside it. What the kernel takes from compute beside it
    is an interference figure (engine ``sm_rs``), no longer a whole-GPU share."""
    from torchtitan_tide.comm.plans.memory_plan import group_shard_numel

    name, row_mode = ACCUMULATE_STEP
    row = next(r for r in read_result(results_dir, name)["rows"] if r["mode"] == row_mode)
    config = name.split("_step_")[1].removesuffix(".json")
    shard = sum(group_shard_numel(g, 2) for g in measured_groups(config))
    gib = 8 * shard / GIB
    rate = gib / (row["rs_kernel_ms"] / 1e3)
    bench = read_result(results_dir, ACCUMULATE_FILE)["tables"][0]["rows"]
    default = next(r for r in bench if "(default)" in r["variant"])
    text = (
        f"{name} ({row_mode!r} row): {row['rs_kernel_ms']:.2f} accumulate kernel ms per step "
        f"for {gib:.2f} GiB read + written = {rate:.0f} GiB/s (alone, {ACCUMULATE_FILE} "
        f"{default['variant']}: {default['gib_s']:.0f} GiB/s)"
    )
    return rate, text


@functools.lru_cache(maxsize=8)
def copy_rate(results_dir: Path) -> tuple[float, str]:
    """(GiB/s copied, source): a device-to-device copy on one H200 (``COPY_RATE``: read +
    write GiB/s, halved): one candidate for the local copy rate
    (``interference.local_copy_rate``)."""
    name, variant = COPY_RATE
    rows = read_result(results_dir, name)["tables"][0]["rows"]
    row = next(r for r in rows if r["variant"] == variant)
    return row["gib_s"] / 2, (
        f"{name} {variant}: {row['gib_s']:.0f} GiB/s read + write = {row['gib_s'] / 2:.0f} "
        "GiB/s copied"
    )


@functools.lru_cache(maxsize=8)
def measured_groups(config: str) -> tuple[GroupShape, ...]:
    """The FSDP groups of a measured config (``fsdp_groups.load_config_model``)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    return tuple(load_config_model(config).groups)


def layout_costs(results_dir: Path, trace_config: str) -> tuple[dict, str]:
    """ns per element of each layout kernel (profiled fsdp2 / symm_mem steps of
    ``trace_config`` on 2 GPUs, over that config's own groups): copy-out and chunk_cat
    per unsharded element and gather / reduce, copy-in per shard element and gather."""
    steps = MEASURED_STEPS.get(trace_config)
    if not steps:
        return {}, "no profiled step of this model: layout copies 0"
    groups = measured_groups(trace_config)
    numel = sum(g.numel for g in groups)
    gathers = sum(2 if g.reshard_after_forward else 1 for g in groups)
    gathered = sum(g.numel * (2 if g.reshard_after_forward else 1) for g in groups)
    out = {}
    for mode in ("fsdp2", "symm_mem"):
        name, row_mode = steps[mode]
        row = next(r for r in read_result(results_dir, name)["rows"] if r["mode"] == row_mode)
        out[mode] = {
            "copy_out": 1e6 * row["split_with_sizes_copy"] / gathered,
            "chunk_cat": 1e6 * row["chunk_cat"] / numel,
            "copy_in": 1e6 * row["all_gather_copy_in"] / (gathered / 2),
        }
    out["tide_ag"] = {"copy_out": 0.0, "chunk_cat": out["fsdp2"]["chunk_cat"], "copy_in": 0.0}
    out["tide"] = {"copy_out": 0.0, "chunk_cat": 0.0, "copy_in": 0.0}
    file = steps["fsdp2"][0]
    return out, (f"{file}: profiled chunk_cat / split_with_sizes_copy / all_gather_copy_in ms "
                 f"per element of {trace_config} ({gathers} gathers per step; tide_ag: chunk_cat "
                 "only; tide: none)")  # fmt: skip


def shape_class_of(model_args: Any, tokens: int) -> tuple[str, str]:
    """The dense GEMM class of the model's compute (the bench_interference GEMM whose
    figures its GEMMs and other kernels take), and the sentence saying why.

    Rule: ``single_wave`` when one launch of the feed-forward GEMM has output tiles (128 x
    128) that fit in one wave of the H200's SMs, else ``large``. MoE: tokens x top_k /
    experts rows per expert, one launch per expert (the for-loop); with ``use_grouped_mm``
    (TorchTitan's default) one grouped GEMM computes every expert, so a launch has the
    experts' summed tiles (measured: Qwen3's grouped GEMM launches 132 CTAs, every SM), and
    its time is the ``grouped_experts`` class of its own (``interference.class_weights``)."""
    moe = getattr(model_args, "moe_args", None)
    rows = tokens * moe.top_k / moe.num_experts if moe is not None else tokens
    dim = int(getattr(model_args, "dim", 0))
    tiles = math.ceil(rows / 128) * math.ceil(dim / 128)
    what = f"FFN GEMM {int(rows)} rows x dim {dim}"
    grouped = moe is not None and getattr(moe, "use_grouped_mm", False)
    if grouped:
        tiles *= moe.num_experts
        what = f"grouped expert GEMM, {moe.num_experts} x ({int(rows)} rows x dim {dim})"
    cls = SINGLE_WAVE if tiles <= H200_SMS else LARGE
    why = f"{what}: {tiles} tiles per launch vs {H200_SMS} SMs -> {cls}"
    if grouped:
        why += f" (its own kernels' time: class {GROUPED})"
    return cls, why


def trace_mismatch(trace: Mapping[str, Any], groups: Sequence[GroupShape]) -> str:
    """Why ``trace`` cannot stand for ``groups`` ('' when it can): its blocks must have
    the parameter count of the config's blocks (same layer shapes)."""
    traced = {g["params"] for g in trace["groups"] if g["group"].startswith("layers.")}
    wanted = {g.numel for g in groups if g.name.startswith("layers.")}
    if traced and wanted and traced != wanted:
        return f"its blocks have {sorted(traced)} params, this config's {sorted(wanted)}"
    return ""


def _any_trace(results_dir: Path) -> Path:
    for config in TRACE_CONFIG.values():
        if path := newest_trace(results_dir, config):
            return path
    raise SimulateError(f"no *_trace_*.json under {results_dir}: run scripts/bench/bench_trace.py")


def cross_node_transports(results_dir: Path) -> str:
    """What bench_cross_node measured of TIDE's cross-node transports (two emulated nodes
    on one H200): NCCL kernels, SM-ms and wire bytes per step, for the source line of
    the one-sided option (0 kernels, the same bytes as send/recv)."""
    path = results_dir / CROSS_NODE_FILE
    if not path.exists():
        return f"{CROSS_NODE_FILE}: missing; one-sided modeled as 0 SMs and send/recv's bytes"
    rows = {r["variant"]: r for r in json.loads(path.read_text())["tables"][0]["rows"]}
    text = "; ".join(
        f"{name}: {r['nccl_kernels']} NCCL kernels, {r['nccl_sm_ms']:.1f} SM-ms, "
        f"{r['wire_mib']:.0f} MiB per rank and step"
        for name, r in rows.items()
        if r.get("mode") == "tide"
    )
    return f"{CROSS_NODE_FILE} (bench_cross_node, 2 emulated nodes on one H200): {text}"


def _step_results(results_dir: Path, name: str) -> Iterator[tuple[Path, dict, dict]]:
    """(path, metadata, fsdp2 row or {}) of every committed ``*_<name>.json`` (bench_step)."""
    for path in results_dir.glob(f"*_{name}.json"):
        data = json.loads(path.read_text())
        row = next((r for r in data.get("rows", []) if r.get("mode") == "fsdp2"), {})
        yield path, data.get("metadata", {}), row


def _newest_profiled_step(results_dir: Path, name: str, world: int | None) -> Path | None:
    """The newest committed ``*_<name>.json`` (bench_step) whose fsdp2 row has a profiled
    step breakdown (``bd_*`` columns), run at ``world`` ranks (None: any)."""
    found = [
        (meta.get("date", ""), path.name, path)
        for path, meta, row in _step_results(results_dir, name)
        if row.get("bd_step_ms") and world in (None, meta.get("world_size"))
    ]
    return max(found)[2] if found else None


def breakdown_step_file(results_dir: Path, config: str, world: int) -> Path | None:
    """The newest committed ``bench_step`` result of ``config`` run at ``world`` ranks
    with a profiled step breakdown (``bd_*`` columns of its ``fsdp2`` row), if any."""
    name = f"step_world1_{config}" if world == 1 else f"step_{config}"  # bench_step's names
    return _newest_profiled_step(results_dir, name, world)


def _breakdown(path: Path) -> dict[str, float]:
    row = next(r for r in json.loads(path.read_text())["rows"] if r["mode"] == "fsdp2")
    return {
        "step_ms": row["best_step_ms"],
        "compute_ms": row["bd_compute_ms"],
        "optimizer_ms": row["bd_optimizer_ms"],
        "host_ms": row["bd_host_bound_ms"] + row["bd_other_idle_ms"],
    }


def world1_step(results_dir: Path, config: str) -> tuple[dict[str, float] | None, str]:
    """The one-GPU trainer step of ``config``: ``step_ms`` (best), ``compute_ms``,
    ``optimizer_ms``, ``host_ms`` (host-bound + other idle of the profiled step), and
    ``step_ms_log_freq_10`` where recorded; from a committed world-1 ``bench_step``
    result, else the recorded issue-21 figures; (None, why) when neither exists."""
    if path := breakdown_step_file(results_dir, config, 1):
        return _breakdown(path), f"{path.name} (world 1, fsdp2 row, profiled step breakdown)"
    if config in WORLD1_RECORDED:
        return dict(WORLD1_RECORDED[config]), WORLD1_RECORDED_SOURCE
    return None, (
        f"no one-GPU trainer breakdown of {config}: scripts/gpu/check.sh stage world1 "
        "(docs/design/2026-12-02-simulator.md)"
    )


def newest_world1_fsdp_step(results_dir: Path, config: str) -> Path | None:
    """The newest ``*_step_world1_fsdp_<config>.json`` (``bench_step.py
    --fsdp-at-world-size-1``: one rank's work of the config's multi-GPU step, FSDP2 over a
    one-rank mesh on one GPU) whose fsdp2 row has a profiled step breakdown."""
    return _newest_profiled_step(results_dir, f"step_world1_fsdp_{config}", None)


def newest_profiled_trace(results_dir: Path, config: str) -> Path | None:
    """The newest bf16-parameter trace of ``config`` with a profiled iteration's kernels
    (``bench_trace --kernels``)."""
    found = [
        p
        for p in results_dir.glob(f"*_trace_{config}.json")
        if (json.loads(p.read_text()).get("profiled_iteration") or {}).get("kernels")
    ]
    return _newest(sorted(found))


def matched_kernel_level(
    step_kernels: Sequence[Mapping[str, Any]], trace: Mapping[str, Any]
) -> tuple[float, int, float] | None:
    """(level, kernels, share): the kernels of a profiled step (one rank's top kernels,
    bench_step) that the trace's profiled iteration launched as often, their step ms over
    their trace ms, how many, and their share of the trace's kernel time; None when none
    match. Equal launch counts keep FSDP2's, the optimizer's and the collectives' kernels
    out: what is compared is the model's own work."""
    by_name = {k["name"]: k for k in step_kernels}
    both = [
        (k, by_name[k["name"]])
        for k in trace["profiled_iteration"]["kernels"]
        if k["name"] in by_name and by_name[k["name"]]["count"] == k["count"]
    ]
    trace_ms = sum(t["ms"] for t, _ in both)
    if not both or trace_ms <= 0:
        return None
    level = sum(s["ms"] for _, s in both) / trace_ms
    return level, len(both), trace_ms / trace["profiled_iteration"]["kernel_ms"]


def _step_kernels(path: Path) -> list[list[Mapping[str, Any]]]:
    """Per rank, the top kernels of the fsdp2 run's profiled step in a bench_step result."""
    data = json.loads(path.read_text())
    runs = data.get("runs", {}).get("fsdp2") or []
    per_rank = next(
        (r["layout"]["per_rank"] for r in runs if "per_rank" in r.get("layout", {})), {}
    )
    return [rank["kernels"] for rank in per_rank.values() if rank.get("kernels")]


def in_step_compute(results_dir: Path, config: str) -> tuple[float | None, bool, str]:
    """(level, applied, source): how much longer the model's own kernels take inside a
    training step than in its per-group trace (:func:`matched_kernel_level`, mean over
    ranks), from

    1. the profiled fsdp2 run of the config's committed 2-GPU step (bench_step, world 2,
       with its top kernels) against the newest profiled trace: the clock the measured
       steps ran at; applied to every group's and the root's ms (the fsdp2 row's compute
       then comes from the step it is validated against: said in the source);
    2. else the profiled one-rank step (:func:`newest_world1_fsdp_step`, one GPU) against
       the newest profiled trace: reported, not applied (a one-GPU step's SM clock need
       not be a 2-GPU step's). On one H200, 2026-12-03: Llama 0.953 (its trace runs
       power-capped at ~1470 MHz), Qwen3 1.010, Wan2.2 0.982; Wan2.2 was 1.067 against its
       traces timed on zero gradients (the zero-initialized head, which bench_floor fills
       since 3b5ee72).

    (None, False, why) when neither is measured."""
    trace_path = newest_profiled_trace(results_dir, config)
    two = breakdown_step_file(results_dir, config, 2)
    if two is not None and trace_path is not None and (ranks := _step_kernels(two)):
        trace = json.loads(trace_path.read_text())
        levels = [m for kernels in ranks if (m := matched_kernel_level(kernels, trace))]
        if levels:
            level = statistics.fmean(m[0] for m in levels)
            return (
                level,
                True,
                (
                    f"{two.name} (fsdp2 run, 2 GPUs, {len(levels)} ranks) vs {trace_path.name}: "
                    f"{levels[0][1]} kernels launched as often in both ({100 * levels[0][2]:.0f}% of "
                    f"the trace's kernel time) take x {level:.3f} in the step; applied (the fsdp2 "
                    "row's compute level comes from the step it is compared with)"
                ),
            )
    path = newest_world1_fsdp_step(results_dir, config)
    if path is None:
        return (
            None,
            False,
            (
                f"not measured (no 2-GPU step of {config} with kernels, no "
                f"*_step_world1_fsdp_{config}.json: scripts/gpu/check.sh stages step / world1)"
            ),
        )
    ranks = _step_kernels(path)
    if not ranks:
        return None, False, f"{path.name}: no top kernels (bench_step before they were kept)"
    if trace_path is None:
        return None, False, f"no profiled trace of {config} (bench_trace --kernels 25)"
    matched = matched_kernel_level(ranks[0], json.loads(trace_path.read_text()))
    if matched is None:
        return None, False, f"{path.name} vs {trace_path.name}: no kernel launched as often in both"
    level, count, share = matched
    return (
        level,
        False,
        (
            f"{path.name} (one-rank step, FSDP2 at world 1, one GPU) vs {trace_path.name}: {count} "
            f"kernels launched as often in both ({100 * share:.0f}% of the trace's kernel time) "
            f"take x {level:.3f} in the step; not applied (a one-GPU step's clock)"
        ),
    )


def host_ms(
    table: Mapping[str, Any], trace_config: str, results_dir: Path = RESULTS
) -> tuple[float, str]:
    """Per-step trainer time outside fwd+bwd and the optimizer: host-bound + other idle
    of the one-GPU trainer step (:func:`world1_step`), else of the profiled 2-GPU fsdp2
    step of the same config; a config logging every N > 1 steps saves the per-step loss
    read where it was measured (the one-GPU step at log_freq 1 minus at log_freq 10). 0
    where no breakdown exists (said in the source)."""
    measured, source = world1_step(results_dir, trace_config) if trace_config else (None, "")
    if not measured and trace_config and (two := breakdown_step_file(results_dir, trace_config, 2)):
        measured, source = (
            _breakdown(two),
            f"{two.name} (world 2, fsdp2 row, profiled step breakdown)",
        )
    if not measured:
        return 0.0, f"not measured: 0 ({source or 'no one-GPU breakdown of this model'})"
    freq = int(table.get("metrics", {}).get("log_freq", 10))
    text = f"{source}: host-bound + other idle of {trace_config}"
    if freq <= 1 or "step_ms_log_freq_10" not in measured:
        return measured["host_ms"], text
    logging = measured["step_ms"] - measured["step_ms_log_freq_10"]
    host = max(0.0, measured["host_ms"] - logging)
    return host, f"{text}, minus the per-step loss read ({logging:.1f} ms; log_freq {freq})"


def measured_step(results_dir: Path, config: str, mode: str) -> tuple[float | None, str]:
    """Best step ms of ``mode`` in the committed 2x H200 bench_step result, and its file."""
    name, row_mode = MEASURED_STEPS[config][mode]
    row = next((r for r in read_result(results_dir, name)["rows"] if r["mode"] == row_mode), {})
    return row.get("best_step_ms"), f"{name} ({row_mode!r} row)"


def stock_step_spread(results_dir: Path, config: str) -> tuple[float, float, int] | None:
    """(lowest, highest, count) of stock FSDP2's step ms (the ``fsdp2`` row's best round:
    the median of its timed steps) over every committed ``bench_step`` result of
    ``config`` run at 2 ranks: the measurement's own run-to-run spread (stock FSDP2's path
    does not change between our commits; the runs differ in timed steps, 6-15). None when
    fewer than two runs exist."""
    found = [
        row["best_step_ms"]
        for _, meta, row in _step_results(results_dir, f"step_{config}")
        if meta.get("world_size") == 2 and isinstance(row.get("best_step_ms"), (int, float))
    ]
    return (min(found), max(found), len(found)) if len(found) > 1 else None


def newest_world1_trace(results_dir: Path, config: str) -> Path | None:
    """The newest ``*_trace_world1_<config>.json``: ``bench_trace.py --precision world1``
    (what the one-GPU trainer runs: fp32 weights under bf16 autocast)."""
    return _newest(sorted(results_dir.glob(f"*_trace_world1_{config}.json")))


def autocast_casts(
    compute: Mapping[str, GroupCompute],
    groups: Sequence[GroupShape],
    ac: str | float,
    results_dir: Path,
    trace_config: str,
) -> tuple[dict[str, GroupCompute], str]:
    """What fp32 weights under autocast add to a bf16-parameter trace (the one-GPU
    trainer without a world-1 trace): per group, one fp32 -> bf16 cast of its weights per
    forward (autocast caches it for the forward), one more per recomputed forward (``ac``:
    the ``[activation_checkpoint]`` mode, or the recomputed fraction), and the bf16 ->
    fp32 cast of its gradients in backward, each at bench_floor's measured cast ms per
    element (fp32 read, bf16 write)."""
    floor = _newest(sorted(results_dir.glob(f"*_floor_{trace_config}.json")))
    if floor is None:
        return dict(compute), f"no *_floor_{trace_config}.json: casts not charged"
    redo = recompute_fraction({"mode": ac}, {})[0] if isinstance(ac, str) else float(ac)
    data = json.loads(floor.read_text())
    per_elem = data["cast_ms"] / data["work"]["shard_params"]
    out = {}
    for g in groups:
        if g.name not in compute:
            continue
        cast = per_elem * g.numel
        c = compute[g.name]
        out[g.name] = GroupCompute(c.fwd_ms + cast, c.bwd_ms + cast * (1 + redo))
    return out, (
        f"{floor.name}: cast {1e9 * per_elem:.2f} ps per element, once per weight in forward "
        "(+ once per recompute) and once per gradient in backward"
    )


def _traced_workload(trace: Mapping[str, Any], model_args: Any) -> tuple[Workload, dict]:
    """The traced config's workload and ``[activation_checkpoint]`` table."""
    from torchtitan_tide.config import load_toml
    from torchtitan_tide.launch.command_line import resolve_config

    traced = load_toml(str(resolve_config(trace["config"])))
    return workload_of(traced, model_args), traced.get("activation_checkpoint", {})


def compute_inputs(
    cm: Any, trace: Mapping[str, Any] | None, trace_name: str, work: Workload, mfu: float,
    results_dir: Path, trace_config: str | None,
) -> tuple[dict[str, GroupCompute], float, float, dict[str, float], dict[str, str]]:  # fmt: skip
    """(per-group compute, root fwd / bwd ms, class time shares, sources) of ``cm`` at
    ``work`` (``compute`` module: attention quadratic in the sequence, activation
    checkpointing as configured)."""
    sources: dict[str, str] = {}
    ac = cm.table.get("activation_checkpoint", {})
    flops_share = attention_flops_share(cm.model_args, work)[0]
    profiled = trace if trace and (trace.get("profiled_iteration") or {}).get("kernels") else None
    if profiled is None and trace_config:
        path = newest_profiled_trace(results_dir, trace_config)
        profiled = json.loads(path.read_text()) if path else None
    shares = trace_shares(profiled) if profiled else None
    if shares is None:
        shares = {itf.ATTENTION: flops_share}
    redo, sources["activation_checkpoint"] = recompute_fraction(ac, shares)
    if trace is None:
        compute = compute_from_flops(cm, work, mfu, H200_BF16_FLOPS, redo)
        sources["compute"] = (
            f"FLOPs (2/4 x active params x tokens + attention) at MFU {mfu} of "
            f"{H200_BF16_FLOPS:.3g}"
        )
        return compute, 0.0, 0.0, shares, sources
    traced, traced_ac = _traced_workload(trace, cm.model_args)
    blocks = sum(g["fwd_ms"] + g["bwd_ms"] for g in trace["groups"]
                 if g["group"].startswith("layers."))  # fmt: skip
    attention, why = attention_share_of_blocks(profiled or {}, blocks)
    if attention is None:
        attention, why = attention_flops_share(cm.model_args, traced)[0], "by FLOPs (modeled)"
    had = recompute_fraction(traced_ac, shares, where=f"{trace['config']}'s")[0]
    quadratic = attention_flops_share(cm.model_args, traced)[1]  # the traced time's split
    compute, root_fwd, root_bwd = compute_from_trace(
        trace, cm.groups, work, traced, attention, quadratic, (redo, had)
    )
    sources["compute"] = (
        f"trace {trace_name} (bench_trace, {trace['metadata']['machine']}) at "
        f"{traced.tokens} tokens / sequence {traced.seq_len}, scaled to {work.tokens} / "
        f"{work.seq_len}: attention {100 * attention:.1f}% of the blocks' time ({why}; "
        f"{100 * quadratic:.0f}% of it self-attention, quadratic in the sequence), the rest "
        f"linear in tokens; recompute {redo:.2f} forward (traced {had:.2f})"
    )
    return compute, root_fwd, root_bwd, shares, sources


def engine_inputs(
    results_dir: Path,
    trace_config: str | None,
    cm: Any,
    shares: Mapping[str, float],
    tokens: int,
) -> tuple[dict[str, tuple[float, float]], dict[str, float], str, tuple, dict[str, str]]:
    """(engines (f, g) mixed over this model's classes, class weights, the dense GEMM
    class, the per-class table as rows, sources)."""
    sources: dict[str, str] = {}
    dense, sources["shape_class"] = shape_class_of(cm.model_args, tokens)
    steps = {m: f for m, (f, _) in MEASURED_STEPS.get(trace_config or "", {}).items()}
    layer = COLLECTIVE_LAYER.get(cm.spec_name, "llama70b")
    if trace_config and steps:
        coll = read_result(results_dir, COLLECTIVES_FILE)
        g_ce, ce_source = itf.ce_in_step(results_dir, steps, measured_groups(trace_config),
                                         layer, coll["config"]["layer_numel"][layer])  # fmt: skip
    else:
        g_ce, ce_source = 0.0, "no profiled 2-GPU step of this model: copy engine not stretched"
    table = itf.figure_table(results_dir, g_ce, ce_source)
    weights = {
        (dense if cls not in (itf.ATTENTION, itf.GROUPED) else cls): w for cls, w in shares.items()
    }
    if itf.GROUPED in weights and not getattr(getattr(cm.model_args, "moe_args", None),
                                              "use_grouped_mm", False):  # fmt: skip
        weights[dense] = weights.get(dense, 0.0) + weights.pop(itf.GROUPED)
    text = ", ".join(f"{c} {100 * w:.1f}%" for c, w in sorted(weights.items()))
    sources["class_weights"] = f"{text} (time shares of the profiled trace's kernels, else FLOPs)"
    one = itf.one_gpu_file(results_dir)
    sources["interference"] = (
        f"per engine and class ({', '.join(sorted({f.kind for f in table.values()}))}): the "
        f"2x H200 {INTERFERENCE_FILE} split by engine; one-GPU result: "
        f"{one.name if one else 'none committed (bench_interference.py --one-gpu)'}; "
        "report table 'Interference per engine and compute class'"
    )
    sources["copy_engine_in_step"] = ce_source
    return itf.mix(table, weights), weights, dense, tuple(itf.table_rows(table)), sources


def build_inputs(
    cm: Any,
    results_dir: Path,
    trace_path: str | Path | None,
    mfu: float,
    world1: bool = False,
    workload: Workload | None = None,
) -> Inputs:
    """The inputs of ``cm`` (a ``fsdp_groups.ConfigModel``) from the committed results.
    ``world1``: what the one-GPU trainer runs (no FSDP: fp32 weights under autocast):
    the world-1 trace when one exists (else the bf16-parameter trace, said in
    ``sources["compute"]``) and the full model's optimizer. ``workload``: tokens per GPU
    and sequence length other than the config's (the report's sensitivity)."""
    results_dir = Path(results_dir)
    model = cm.spec_name
    trace_config = TRACE_CONFIG.get(model)
    work = workload or workload_of(cm.table, cm.model_args)
    sources: dict[str, str] = {}
    if workload is not None:
        sources["workload"] = f"{work.tokens} tokens per GPU, sequence {work.seq_len} (set)"
    path = Path(trace_path) if trace_path else None
    if path is None and trace_config:
        w1 = newest_world1_trace(results_dir, trace_config) if world1 else None
        if world1 and w1 is None:
            sources["world1_trace"] = (
                f"missing: no *_trace_world1_{trace_config}.json (bench_trace.py --precision "
                "world1); this row uses the bf16-parameter trace plus autocast's casts"
            )
        path = w1 or newest_trace(results_dir, trace_config)
    trace = json.loads(Path(path).read_text()) if path is not None else None
    if trace is not None and (why_not := trace_mismatch(trace, cm.groups)):
        sources["trace_not_used"] = f"{Path(path).name}: {why_not}"
        trace = None
    compute, root_fwd, root_bwd, shares, more = compute_inputs(
        cm, trace, Path(path).name if path else "", work, mfu, results_dir, trace_config
    )
    sources.update(more)
    if "world1_trace" in sources and trace is not None:
        redo = recompute_fraction(cm.table.get("activation_checkpoint", {}), shares)[0]
        compute, sources["autocast"] = autocast_casts(compute, cm.groups, redo, results_dir,
                                                      trace_config or "")  # fmt: skip
    opt_path = Path(path) if trace is not None else _any_trace(results_dir)
    opt_trace = trace or json.loads(opt_path.read_text())
    if opt_trace.get("adamw_ms") is None:  # not timed there (out of memory): another trace's
        opt_path = (newest_trace(results_dir, trace_config) if trace_config else None) or (
            _any_trace(results_dir)
        )
        opt_trace = json.loads(opt_path.read_text())
    opt = (opt_trace["adamw_ms"] + opt_trace["clip_ms"]) / opt_trace["work"]["shard_params"]
    sources["optimizer"] = f"trace {opt_path.name}: AdamW + clip ms per shard element"
    level, applied = None, False
    if trace_config and trace is not None:
        level, applied, sources["in_step"] = in_step_compute(results_dir, trace_config)
        if applied and level is not None:
            sources["compute"] += f", x {level:.3f} in-step level (applied)"
    host, sources["host"] = host_ms(cm.table, trace_config or "", results_dir)
    layer = COLLECTIVE_LAYER.get(model, "llama70b")
    transport, sm_ns, sources["transport"] = transport_rates(results_dir, layer)
    engines, weights, dense, figures, more = engine_inputs(
        results_dir, trace_config, cm, shares, work.tokens
    )
    sources.update(more)
    acc_gibps, sources["accumulate"] = accumulate_rate(results_dir)
    copy_gibps, kind, text = itf.local_copy_rate(results_dir, copy_rate(results_dir))
    sources["copy"] = f"local copies on the copy engine, {kind}: {text}"
    sources["cross_node"] = cross_node_transports(results_dir)
    layout, sources["layout"] = layout_costs(results_dir, trace_config or "")
    inputs = Inputs(
        compute, root_fwd, root_bwd, opt, host, transport, layout, dense, engines, sm_ns,
        weights, acc_gibps, copy_gibps, sources, None if applied else level, figures,
    )  # fmt: skip
    return with_compute_level(inputs, level) if applied and level is not None else inputs


def inputs_record(inputs: Inputs) -> dict[str, Any]:
    """``inputs`` as plain JSON data (the result files' ``inputs``)."""
    from dataclasses import asdict

    data = asdict(inputs)
    data["compute"] = {k: asdict(v) for k, v in inputs.compute.items()}
    return data
