"""Step simulator: one training step per comm mode at any GPU count and node shape, from
a one-GPU layer trace (a SIMULATION, not a measurement).

    python -m torchtitan_tide.simulate --config llama70b_tide --gpus 64
        [--trace T.json] [--cluster train_configs/clusters/h200_8x400g.toml]
        [--modes fsdp2,symm_mem,tide,tide_ag] [--results-dir bench/results]
    python -m torchtitan_tide.simulate --report [--out-dir bench/results]   # validation,
        # the reference-config table, NIC/node sensitivity, the stream picture

The FSDP groups (order, per-group shard numel, ``reshard_after_forward``) are the memory
planner's (``torchtitan_tide.plan.load_config_model``). Per group, in FSDP2's order, an
event model (``torchtitan_tide.simulate_engine``) runs: the forward all-gather issued as
the previous group's forward starts (prefetch one ahead, FSDP2's run-ahead), the group's
forward after its all-gather; the backward re-gather of groups resharded after forward,
issued as the next group's backward starts; each group's reduce-scatter after its
backward; the optimizer and grad-norm clip after the last reduce-scatter; the trainer's
per-step host time last. Streams: ``compute``; ``nccl`` (fsdp2 and symm_mem all-gathers
and every stock reduce-scatter: one NCCL communicator serializes them); ``ce`` (TIDE-AG:
cross-node phase, then node-local copy-engine phase, back to back); ``rs_local`` and
``rs_net`` (TIDE-RS's node-local reduce and cross-node partials, fp32 or ``[tide]
rs_wire_dtype``, pipelined across groups, at most ``[tide] rs_inflight`` partials in flight). fsdp2 / symm_mem /
tide_ag put their layout copies on the compute stream: the AG copy-out before each
gather's compute, chunk_cat (the RS copy-in) after each backward, the AG copy-in ahead of
each gather on its stream. Compute slows by the measured GEMM interference of its shape class while an
all-gather / reduce-scatter of the mode runs beside it.

Inputs (each recorded with its source in the output, :class:`Inputs`): per-group
forward/backward ms, root ms, AdamW and clip ms from ``bench_trace.py`` (same model,
scaled by tokens per GPU and activation checkpointing when the config differs; without
a trace: FLOPs at ``--mfu``); per-mode collective bandwidths from ``bench_collectives``
(2x H200); interference from ``bench_interference``; layout-copy ms per element from
``bench_step``'s profiled kernels; the per-step host time from the one-GPU ``bench_step``
breakdown; NIC bandwidth, GPUs per node and whether NCCL >= 2.30.7 is installed (then
symm_mem's cross-node all-gather is NCCL's hierarchical zero-SM all-gather) from
``--cluster``. docs/2026-12-01-simulator.md explains the model and its residuals.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.memory_plan import MODES, GroupShape, group_shard_numel
from torchtitan_tide.comm.options import RS_WIRE_ITEMSIZE
from torchtitan_tide.config import tomllib
from torchtitan_tide.simulate_engine import COMPUTE, Op, Span, simulate, summarize

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GIB = 2**30
H200_BF16_FLOPS = 989e12  # dense bf16 peak, the FLOPs fallback's denominator
H200_SMS = 132
SINGLE_WAVE, LARGE = "single_wave", "large"

# The committed measurements the defaults read (bench/results). Keys: the model (the
# TOML's [model] name); values: the benchmark's own names.
TRACE_CONFIG = {
    "llama3_tide": "h200x2_llama70b_4layers",
    "qwen3_tide": "h200x2_qwen3_30b_a3b_4layers",
    "wan22": "h200x2_wan22_a14b_20layers",
}
COLLECTIVE_LAYER = {"llama3_tide": "llama70b", "qwen3_tide": "qwen3_30b_a3b", "wan22": "wan22_a14b"}
COLLECTIVES_FILE = "2026-11-30_nvidia-h200-x-2_8a9ccda_collectives.json"
INTERFERENCE_FILE = "2026-11-30_nvidia-h200-x-2_8a9ccda_interference.json"
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
# The one-GPU trainer step (issue 21: bench_step at world 1 on one H200, commit 8d17df0,
# profiled step breakdown, log_freq 1): host-bound + other idle is the per-step host time.
WORLD1_STEP = {
    "h200x2_llama70b_4layers": {"step_ms": 483.2, "compute_ms": 399.9, "optimizer_ms": 66.4,
                                "host_ms": 14.9 + 2.0, "step_ms_log_freq_10": 471.8},
    "h200x2_qwen3_30b_a3b_4layers": {"step_ms": 199.8, "compute_ms": 134.6,
                                     "optimizer_ms": 35.7, "host_ms": 26.9 + 2.6,
                                     "step_ms_log_freq_10": 173.7},
}  # fmt: skip
WORLD1_SOURCE = "issue 21: bench_step at world 1 on one H200 (8d17df0), profiled step breakdown"
REFERENCE_CONFIGS = tuple(
    f"{m}_{c}"
    for m in ("llama70b", "qwen3_30b_a3b", "wan22_a14b")
    for c in ("fsdp2", "symm_mem", "tide")
)
AC_FACTOR = {"none": 0.0, "selective": 0.0, "full": 1.0}  # forwards recomputed in backward


class SimulateError(ValueError):
    """Bad simulator input; the message names the flag, file or key and the fix."""


# ----------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Cluster:
    """A cluster file's ``[cluster]`` table (TOML)."""

    name: str = "default: 8 GPUs per node, 400 Gb/s NIC per GPU, NCCL < 2.30.7"
    gpus_per_node: int = 8
    """GPUs of one node (NVLink domain)."""
    nic_gbps_per_gpu: float = 400.0
    """Network bandwidth per GPU, Gbit/s (one NIC per GPU: 400 for 8x400G)."""
    nccl_hierarchical_ag: bool = False
    """NCCL >= 2.30.7 installed: symm_mem's cross-node all-gather is NCCL's hierarchical
    zero-SM all-gather (else a ring, like fsdp2's)."""
    source: str = "default"

    @property
    def net_gibps(self) -> float:
        return self.nic_gbps_per_gpu * 1e9 / 8 / GIB


def load_cluster(path: str | Path | None) -> Cluster:
    """The cluster of ``path`` (TOML, table ``[cluster]``); the default without one."""
    if path is None:
        return Cluster()
    try:
        table = tomllib.loads(Path(path).read_text()).get("cluster")
    except FileNotFoundError:
        raise SimulateError(f"--cluster {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SimulateError(f"--cluster {path}: not TOML ({exc})") from None
    if not isinstance(table, dict):
        raise SimulateError(f"--cluster {path}: needs a [cluster] table")
    known = {"name", "gpus_per_node", "nic_gbps_per_gpu", "nccl_hierarchical_ag"}
    if unknown := sorted(set(table) - known):
        raise SimulateError(f"--cluster {path}: unknown key(s) {unknown}; known: {sorted(known)}")
    for key in ("gpus_per_node", "nic_gbps_per_gpu"):
        value = table.get(key, getattr(Cluster, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise SimulateError(f"--cluster {path}: [cluster] {key} = {value!r} must be > 0")
    if not isinstance(table.get("nccl_hierarchical_ag", False), bool):
        raise SimulateError(f"--cluster {path}: [cluster] nccl_hierarchical_ag must be true/false")
    return Cluster(
        name=str(table.get("name", Path(path).stem)),
        gpus_per_node=int(table.get("gpus_per_node", 8)),
        nic_gbps_per_gpu=float(table.get("nic_gbps_per_gpu", 400.0)),
        nccl_hierarchical_ag=bool(table.get("nccl_hierarchical_ag", False)),
        source=f"file: {path}",
    )


# ----------------------------------------------------------------- inputs


@dataclass(frozen=True)
class GroupCompute:
    """Forward / backward ms of one FSDP group on one GPU."""

    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True)
class Inputs:
    """Everything but the groups and the cluster; ``sources`` says where each came from.

    ``bandwidth_gibps[mode][phase]``: ``ag`` / ``rs`` (stock: ring bytes ``(W-1) S b``
    per rank; TIDE: the node-local phase's ``(L-1) N S b``), measured on 2 GPUs of one
    node. ``interference[mode][ag|rs]``: GEMM slowdown fraction of this config's shape
    class. ``layout_ns``: per element, ``copy_out`` (unsharded, per all-gather),
    ``chunk_cat`` (unsharded, per reduce-scatter), ``copy_in`` (shard, per all-gather),
    per mode."""

    compute: Mapping[str, GroupCompute]
    root_fwd_ms: float
    root_bwd_ms: float
    optimizer_ms_per_shard_elem: float
    host_ms: float
    bandwidth_gibps: Mapping[str, Mapping[str, float]]
    interference: Mapping[str, Mapping[str, float]]
    layout_ns: Mapping[str, Mapping[str, float]]
    shape_class: str
    sources: Mapping[str, str] = field(default_factory=dict)


def _read(results_dir: Path, name: str) -> dict[str, Any]:
    path = results_dir / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SimulateError(
            f"{path}: missing (a committed benchmark result the simulator reads)"
        ) from None


def newest_trace(results_dir: Path, config: str) -> Path | None:
    """The newest ``*_trace_<config>.json`` (``bench_trace.py``) under ``results_dir``."""
    found = sorted(results_dir.glob(f"*_trace_{config}.json"))
    dated = [
        (json.loads(p.read_text()).get("metadata", {}).get("date", ""), p.name, p) for p in found
    ]
    return max(dated)[2] if dated else None


def collective_bandwidths(results_dir: Path, layer: str) -> tuple[dict[str, dict[str, float]], str]:
    """Per mode: ``ag`` / ``rs`` GiB/s of the simulator's own byte counts at W = 2
    (``S b`` per rank for every phase: AG in bf16; stock RS in fp32; TIDE-RS reads bf16),
    from ``bench_collectives``' measured ms of one ``layer`` group."""
    data = _read(results_dir, COLLECTIVES_FILE)
    rows = [r for r in data["tables"][0]["rows"] if r["layer"] == layer and not r.get("error")]
    if not rows:
        raise SimulateError(f"{COLLECTIVES_FILE}: no rows of layer {layer!r}")
    out = {}
    for row in rows:
        # bench_collectives' GiB/s: unsharded bytes (bf16 AG, fp32 RS) * (W-1)/W / ms, W = 2
        # = S * b / ms with its b; TIDE-RS moves bf16 rows, half the fp32 bytes.
        rs_scale = 0.5 if row["mode"] == "tide" else 1.0
        out[row["mode"]] = {"ag": row["ag_GiBps"], "rs": row["rs_GiBps"] * rs_scale}
    return out, f"{COLLECTIVES_FILE}, layer {layer}: AG/RS GiB/s per mode (2x H200, W = 2)"


def interference_fractions(results_dir: Path, shape_class: str) -> tuple[dict, str]:
    """Per mode, beside ``ag`` / ``rs``: the GEMM slowdown of ``shape_class`` (negative
    measured values, noise, count as 0). tide_ag: tide's AG, fsdp2's RS."""
    data = _read(results_dir, INTERFERENCE_FILE)
    out: dict[str, dict[str, float]] = {}
    for row in data["tables"][0]["rows"]:
        if row.get("error") or not str(row["gemm"]).startswith(shape_class):
            continue
        out.setdefault(row["mode"], {})[row["op"]] = max(0.0, row["slowdown_pct"] / 100)
    out["tide_ag"] = {"ag": out["tide"]["ag"], "rs": out["fsdp2"]["rs"]}
    return out, f"{INTERFERENCE_FILE}, GEMM {shape_class} beside AG/RS (tide_ag: tide AG, fsdp2 RS)"


def layout_costs(
    results_dir: Path, trace_config: str, groups: Sequence[GroupShape]
) -> tuple[dict, str]:
    """ns per element of each layout kernel (profiled fsdp2 / symm_mem steps of
    ``trace_config`` on 2 GPUs): copy-out and chunk_cat per unsharded element and
    gather / reduce, copy-in per shard element and gather."""
    steps = MEASURED_STEPS.get(trace_config)
    if not steps:
        return {}, "no profiled step of this model: layout copies 0"
    numel = sum(g.numel for g in groups)
    gathers = sum(2 if g.reshard_after_forward else 1 for g in groups)
    gathered = sum(g.numel * (2 if g.reshard_after_forward else 1) for g in groups)
    out = {}
    for mode in ("fsdp2", "symm_mem"):
        name, row_mode = steps[mode]
        row = next(r for r in _read(results_dir, name)["rows"] if r["mode"] == row_mode)
        out[mode] = {
            "copy_out": 1e6 * row["split_with_sizes_copy"] / gathered,
            "chunk_cat": 1e6 * row["chunk_cat"] / numel,
            "copy_in": 1e6 * row["all_gather_copy_in"] / (gathered / 2),
        }
    out["tide_ag"] = {"copy_out": 0.0, "chunk_cat": out["fsdp2"]["chunk_cat"], "copy_in": 0.0}
    out["tide"] = {"copy_out": 0.0, "chunk_cat": 0.0, "copy_in": 0.0}
    file = steps["fsdp2"][0]
    return out, (f"{file}: profiled chunk_cat / split_with_sizes_copy / all_gather_copy_in ms "
                 f"per element ({gathers} gathers per step; tide_ag: chunk_cat only; tide: none)")  # fmt: skip


def tokens_per_gpu(table: Mapping[str, Any], model_args: Any) -> int:
    """``local_batch_size`` x tokens per sample: ``seq_len``, or for Wan2.2 the patchified
    latent (``[wan22] latent_frames x latent_height x latent_width / patch_size``)."""
    training = table.get("training", {})
    batch = int(training.get("local_batch_size", 8))
    if hasattr(model_args, "patch_size"):
        from models.wan22.job_config import Wan22DataConfig

        data = {**vars(Wan22DataConfig()), **table.get("wan22", {})}
        latent = (data["latent_frames"], data["latent_height"], data["latent_width"])
        return batch * math.prod(n // p for n, p in zip(latent, model_args.patch_size))
    return batch * int(training.get("seq_len", 2048))


def shape_class_of(model_args: Any, tokens: int) -> tuple[str, str]:
    """``single_wave`` when the feed-forward GEMM's output tiles (128 x 128) fit in one
    wave of the H200's SMs (MoE: tokens x top_k / experts rows per expert), else
    ``large``; and the sentence saying why."""
    moe = getattr(model_args, "moe_args", None)
    rows = tokens * moe.top_k / moe.num_experts if moe is not None else tokens
    dim = int(getattr(model_args, "dim", 0))
    tiles = math.ceil(rows / 128) * math.ceil(dim / 128)
    cls = SINGLE_WAVE if tiles <= H200_SMS else LARGE
    return cls, f"FFN GEMM {int(rows)} rows x dim {dim}: {tiles} tiles vs {H200_SMS} SMs -> {cls}"


def compute_from_trace(
    trace: Mapping[str, Any], groups: Sequence[GroupShape], scale: float, recompute: bool
) -> tuple[dict[str, GroupCompute], float, float]:
    """Per group ms from a trace: the same group name, else (a block the trace does not
    have) the median of the trace's ``layers.*``; times ``scale``; with ``recompute``
    (full activation checkpointing in the target, none in the trace) backward + forward."""
    by_name = {g["group"]: g for g in trace["groups"]}
    layers = [g for n, g in by_name.items() if n.startswith("layers.")]
    median_layer = {k: statistics.median(g[k] for g in layers) for k in ("fwd_ms", "bwd_ms")}
    out = {}
    for group in groups:
        if group.name == "root":
            continue
        src = by_name.get(group.name) or (
            median_layer if group.name.startswith("layers.") else None
        )
        if src is None:
            raise SimulateError(f"the trace has no group {group.name!r} (it has {sorted(by_name)})")
        fwd, bwd = scale * src["fwd_ms"], scale * src["bwd_ms"]
        out[group.name] = GroupCompute(fwd, bwd + (fwd if recompute else 0.0))
    return out, scale * trace["root_fwd_ms"], scale * trace["root_bwd_ms"]


def compute_from_flops(
    cm: Any, tokens: int, mfu: float, recompute: bool
) -> dict[str, GroupCompute]:
    """Without a trace: 2 x active params x tokens per forward, 4 x per backward, at
    ``mfu`` of the H200's dense bf16 peak."""
    out = {}
    share = cm.active_numel / max(1, cm.total_numel)
    for group in cm.groups:
        if group.name == "root":
            continue
        fwd = 1e3 * 2 * group.numel * share * tokens / (H200_BF16_FLOPS * mfu)
        out[group.name] = GroupCompute(fwd, 2 * fwd + (fwd if recompute else 0.0))
    return out


def trace_mismatch(trace: Mapping[str, Any], groups: Sequence[GroupShape]) -> str:
    """Why ``trace`` cannot stand for ``groups`` ('' when it can): its blocks must have
    the parameter count of the config's blocks (same layer shapes)."""
    traced = {g["params"] for g in trace["groups"] if g["group"].startswith("layers.")}
    wanted = {g.numel for g in groups if g.name.startswith("layers.")}
    if traced and wanted and traced != wanted:
        return f"its blocks have {sorted(traced)} params, this config's {sorted(wanted)}"
    return ""


def _any_trace(results_dir: Path) -> dict[str, Any]:
    for config in TRACE_CONFIG.values():
        if path := newest_trace(results_dir, config):
            return json.loads(path.read_text())
    raise SimulateError(f"no *_trace_*.json under {results_dir}: run scripts/bench/bench_trace.py")


def host_ms(table: Mapping[str, Any], trace_config: str) -> tuple[float, str]:
    """Per-step host time: the one-GPU trainer step's host-bound + other idle (measured at
    ``log_freq = 1``); a config logging every N > 1 steps saves the per-step loss read,
    measured as the one-GPU step at log_freq 1 minus at log_freq 10."""
    measured = WORLD1_STEP.get(trace_config)
    if not measured:
        return 0.0, "not measured for this model: 0"
    freq = int(table.get("metrics", {}).get("log_freq", 10))
    text = f"{WORLD1_SOURCE}: host-bound + other idle of {trace_config}"
    if freq <= 1:
        return measured["host_ms"], text
    logging = measured["step_ms"] - measured["step_ms_log_freq_10"]
    host = max(0.0, measured["host_ms"] - logging)
    return host, f"{text}, minus the per-step loss read ({logging:.1f} ms; log_freq {freq})"


def build_inputs(cm: Any, results_dir: Path, trace_path: str | Path | None, mfu: float) -> Inputs:
    """The inputs of ``cm`` (a ``plan.ConfigModel``) from the committed results."""
    model = cm.spec_name
    trace_config = TRACE_CONFIG.get(model)
    tokens = tokens_per_gpu(cm.table, cm.model_args)
    ac = cm.table.get("activation_checkpoint", {}).get("mode", "selective")
    sources: dict[str, str] = {}
    path = (
        Path(trace_path)
        if trace_path
        else (newest_trace(results_dir, trace_config) if trace_config else None)
    )
    trace = json.loads(Path(path).read_text()) if path is not None else None
    if trace is not None and (why_not := trace_mismatch(trace, cm.groups)):
        sources["trace_not_used"] = f"{Path(path).name}: {why_not}"
        trace = None
    if trace is not None:
        from torchtitan_tide.config import load_toml
        from torchtitan_tide.launch import resolve_config

        traced = load_toml(str(resolve_config(trace["config"])))
        traced_tokens = tokens_per_gpu(traced, cm.model_args)
        traced_ac = traced.get("activation_checkpoint", {}).get("mode", "selective")
        scale = tokens / traced_tokens
        recompute = AC_FACTOR.get(ac, 0.0) > AC_FACTOR.get(traced_ac, 0.0)
        compute, root_fwd, root_bwd = compute_from_trace(trace, cm.groups, scale, recompute)
        sources["compute"] = (
            f"trace {Path(path).name} (bench_trace, {trace['metadata']['machine']}), "
            f"x {scale:.3f} tokens per GPU"
            + (", + forward recompute (full AC)" if recompute else "")
        )
    else:
        recompute = AC_FACTOR.get(ac, 0.0) > 0
        compute, root_fwd, root_bwd = compute_from_flops(cm, tokens, mfu, recompute), 0.0, 0.0
        sources["compute"] = (
            f"FLOPs (2/4 x active params x tokens) at MFU {mfu} of {H200_BF16_FLOPS:.3g}"
        )
    opt_trace = trace or _any_trace(results_dir)
    opt = (opt_trace["adamw_ms"] + opt_trace["clip_ms"]) / opt_trace["work"]["shard_params"]
    sources["optimizer"] = f"trace of {opt_trace['config']}: AdamW + clip ms per shard element"
    host, sources["host"] = host_ms(cm.table, trace_config or "")
    layer = COLLECTIVE_LAYER.get(model, "llama70b")
    bandwidth, sources["bandwidth"] = collective_bandwidths(results_dir, layer)
    cls, why = shape_class_of(cm.model_args, tokens)
    interference, sources["interference"] = interference_fractions(results_dir, cls)
    sources["shape_class"] = why
    layout, sources["layout"] = layout_costs(results_dir, trace_config or "", cm.groups)
    return Inputs(
        compute, root_fwd, root_bwd, opt, host, bandwidth, interference, layout, cls, sources
    )


# ----------------------------------------------------------------- comm durations


@dataclass(frozen=True)
class Layout:
    """``W`` ranks as ``N`` nodes of ``L`` (the FSDP group's ranks of one node)."""

    world: int
    local: int

    @property
    def nodes(self) -> int:
        return self.world // self.local


def stock_ms(shard_bytes: float, lay: Layout, bus_gibps: float, net_gibps: float) -> float:
    """NCCL ring: ``(W-1) * shard`` bytes per rank at the bus bandwidth; across nodes at
    most ``L * net`` (each ring crosses the network once per node, on its own NIC)."""
    bw = bus_gibps if lay.nodes == 1 else min(bus_gibps, lay.local * net_gibps)
    return 1e3 * (lay.world - 1) * shard_bytes / (bw * GIB)


def hierarchical_ms(
    shard_bytes: float, lay: Layout, local_gibps: float, net_gibps: float
) -> tuple[float, float]:
    """(cross-node, node-local) ms of a hierarchical gather: ``(N-1) * shard`` over the
    network, then ``(L-1) * N * shard`` over NVLink."""
    cross = 1e3 * (lay.nodes - 1) * shard_bytes / (net_gibps * GIB)
    local = 1e3 * (lay.local - 1) * lay.nodes * shard_bytes / (local_gibps * GIB)
    return cross, local


# ----------------------------------------------------------------- the step


def build_ops(
    groups: Sequence[GroupShape],
    inputs: Inputs,
    mode: str,
    lay: Layout,
    cluster: Cluster,
    dtypes: Any,
    rs_inflight: int = 2,
    rs_wire_bytes: int = 4,
) -> list[Op]:
    """The ops of one step of ``mode`` (see the module docstring), in issue order.
    ``rs_wire_bytes``: bytes per element of TIDE-RS's cross-node partials
    (``[tide] rs_wire_dtype``: 4 fp32, 2 bf16)."""
    if mode not in MODES:
        raise SimulateError(f"mode {mode!r}: choose from {MODES}")
    comm = lay.world > 1
    bw, slow, lay_ns = (
        inputs.bandwidth_gibps.get(mode, {}),
        inputs.interference.get(mode, {}),
        inputs.layout_ns.get(mode, {}),
    )
    net = cluster.net_gibps
    names = [g.name for g in groups]
    ops: list[Op] = []
    comp = {g.name: inputs.compute.get(g.name, GroupCompute(0.0, 0.0)) for g in groups}

    def add(name, stream, ms, kind, after=(), issued_with=(), group=""):
        op = Op(name, stream, max(0.0, ms), kind, tuple(after), tuple(issued_with),
                slow if stream == COMPUTE and kind == "compute" else {}, group)  # fmt: skip
        ops.append(op)
        return name

    def gather(g: GroupShape, tag: str, issued_with: Sequence[str]) -> str | None:
        """The all-gather of ``g`` (its copy-in on the gather's stream, ahead of it);
        returns the op its consumer waits for."""
        if not comm:
            return None
        s = group_shard_numel(g, lay.world)
        b = s * dtypes.param_bytes
        copy_in = lay_ns.get("copy_in", 0.0) * s / 1e6
        name = f"{g.name}.{tag}.ag"
        hierarchical = mode in ("tide", "tide_ag") or (
            mode == "symm_mem" and cluster.nccl_hierarchical_ag and lay.nodes > 1
        )
        if not hierarchical:
            ms = copy_in + stock_ms(b, lay, bw["ag"], net)
            return add(name, "nccl", ms, "ag", issued_with=issued_with, group=g.name)
        stream = "nccl" if mode == "symm_mem" else "ce"
        cross, local = hierarchical_ms(b, lay, bw["ag"], net)
        if not cross:
            return add(name, stream, copy_in + local, "ag", issued_with=issued_with, group=g.name)
        add(f"{name}_net", stream, copy_in + cross, "net", issued_with=issued_with, group=g.name)
        return add(name, stream, local, "ag", after=[f"{name}_net"], group=g.name)

    def consume(g: GroupShape, ag: str | None, tag: str) -> list[str]:
        """What ``g``'s compute waits for: its all-gather, then the copy-out on the
        compute stream (queued at the consumer's pre-forward / pre-backward)."""
        if ag is None:
            return []
        copy_out = lay_ns.get("copy_out", 0.0) * g.numel / 1e6
        if not copy_out:
            return [ag]
        return [
            add(f"{g.name}.{tag}.copy_out", COMPUTE, copy_out, "layout", after=[ag], group=g.name)
        ]

    # forward: group i+1's all-gather is issued as group i's forward starts
    pending = {groups[0].name: gather(groups[0], "fwd", [])}
    for i, g in enumerate(groups):
        after = consume(g, pending[g.name], "fwd")
        fwd = add(
            f"{g.name}.fwd", COMPUTE, comp[g.name].fwd_ms, "compute", after=after, group=g.name
        )
        if i + 1 < len(groups):
            pending[names[i + 1]] = gather(groups[i + 1], "fwd", [fwd])
    add("root.fwd_rest", COMPUTE, inputs.root_fwd_ms, "compute", group="root")
    loss = add("root.bwd_rest", COMPUTE, inputs.root_bwd_ms, "compute", group="root")
    # backward, reverse order: group j-1's re-gather is issued as group j's backward
    # starts (queued on the stream before j's reduce-scatter); groups kept unsharded
    # after forward wait for their forward gather only
    order = list(reversed(groups))
    bwd_ag = {g.name: None for g in groups}
    if order[0].reshard_after_forward:
        bwd_ag[order[0].name] = gather(order[0], "bwd", [loss])
    rs_done: list[str] = []
    rs_net: list[str] = []
    for k, g in enumerate(order):
        after = consume(g, bwd_ag[g.name], "bwd") if g.reshard_after_forward else []
        bwd = add(
            f"{g.name}.bwd", COMPUTE, comp[g.name].bwd_ms, "compute", after=after, group=g.name
        )
        if k + 1 < len(order) and order[k + 1].reshard_after_forward:
            bwd_ag[order[k + 1].name] = gather(order[k + 1], "bwd", [bwd])
        if not comm:
            continue
        s = group_shard_numel(g, lay.world)
        chunk = lay_ns.get("chunk_cat", 0.0) * g.numel / 1e6
        src = (
            add(f"{g.name}.chunk_cat", COMPUTE, chunk, "layout", after=[bwd], group=g.name)
            if chunk
            else bwd
        )
        if mode != "tide":
            ms = stock_ms(s * dtypes.reduce_bytes, lay, bw["rs"], net)
            rs_done.append(add(f"{g.name}.rs", "nccl", ms, "rs", after=[src], group=g.name))
            continue
        window = [rs_net[-rs_inflight]] if len(rs_net) >= rs_inflight else []  # run-ahead bound
        local_ms = 1e3 * (lay.local - 1) * lay.nodes * s * dtypes.grad / (bw["rs"] * GIB)
        local = add(f"{g.name}.rs", "rs_local", local_ms, "rs", after=[src, *window], group=g.name)
        if lay.nodes == 1:
            rs_done.append(local)
            continue
        cross = 1e3 * (lay.nodes - 1) * s * rs_wire_bytes / (net * GIB)
        rs_net.append(add(f"{g.name}.rs_net", "rs_net", cross, "net", after=[local], group=g.name))
        rs_done.append(rs_net[-1])
    shard = sum(group_shard_numel(g, lay.world) if comm else g.numel for g in groups)
    add(
        "optimizer", COMPUTE, inputs.optimizer_ms_per_shard_elem * shard, "optimizer", after=rs_done
    )
    add("host", COMPUTE, inputs.host_ms, "host")
    return ops


def simulate_step(
    groups, inputs, mode, lay, cluster, dtypes, rs_inflight=2, rs_wire_bytes=4
) -> tuple[dict, list[Span]]:
    """(summary figures, spans) of one simulated step."""
    spans = simulate(
        build_ops(groups, inputs, mode, lay, cluster, dtypes, rs_inflight, rs_wire_bytes)
    )
    return summarize(spans), spans


def layout_for(cm: Any, gpus: int, cluster: Cluster) -> Layout:
    """FSDP shard degree and ranks per node of ``gpus`` (the planner's ``world_for``)."""
    if gpus == 1:
        return Layout(1, 1)
    from torchtitan_tide.plan import PlanError, world_for

    try:
        world = world_for(cm.table, gpus, cluster.gpus_per_node, where=cm.path.name)
    except PlanError as exc:
        raise SimulateError(str(exc)) from None
    return Layout(world.shard_degree, world.local)


def simulate_config(
    config: str,
    gpus: int,
    modes: Sequence[str],
    cluster: Cluster,
    results_dir: Path = RESULTS,
    trace: str | None = None,
    mfu: float = 0.4,
    cm: Any = None,
    inputs: Inputs | None = None,
) -> dict[str, Any]:
    """Rows (one per mode) and the inputs of ``config`` at ``gpus``."""
    from torchtitan_tide.plan import load_config_model

    cm = cm or load_config_model(config)
    inputs = inputs or build_inputs(cm, results_dir, trace, mfu)
    lay = layout_for(cm, gpus, cluster)
    rows, spans = [], {}
    for mode in modes:
        fig, sp = simulate_step(
            cm.groups, inputs, mode, lay, cluster, cm.dtypes, cm.tide.rs_inflight,
            RS_WIRE_ITEMSIZE[cm.tide.rs_wire_dtype],
        )  # fmt: skip
        rows.append({"config": cm.path.stem, "gpus": gpus, "nodes": lay.nodes, "mode": mode,
                     **{f"sim_{k}": v for k, v in fig.items()}})  # fmt: skip
        spans[mode] = sp
    base = next((r for r in rows if r["mode"] == "fsdp2"), None)
    for row in rows:
        if base:
            row["sim_speedup_vs_fsdp2"] = base["sim_step_ms"] / row["sim_step_ms"]
    return {"rows": rows, "spans": spans, "inputs": inputs, "cm": cm}


def inputs_record(inputs: Inputs) -> dict[str, Any]:
    data = asdict(inputs)
    data["compute"] = {k: asdict(v) for k, v in inputs.compute.items()}
    return data


# ----------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_tide.simulate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", help="training TOML: a name in train_configs/ or a path")
    p.add_argument("--gpus", type=int, help="total GPUs of the run")
    p.add_argument("--trace", help="bench_trace.py JSON (default: the newest of the same model)")
    p.add_argument("--cluster", help="cluster TOML (train_configs/clusters/*.toml)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--mfu", type=float, default=0.4, help="MFU of the FLOPs fallback (no trace)")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--report", action="store_true",
                   help="write the validation, reference-config table, sensitivity and picture")  # fmt: skip
    p.add_argument("--out-dir", default=str(RESULTS))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.report:
            from torchtitan_tide import simulate_report

            for kind, path in simulate_report.write_report(
                Path(args.results_dir), Path(args.out_dir), cluster
            ).items():
                print(f"wrote {kind}: {path}")
            return 0
        if not args.config or not args.gpus:
            parser.error("--config and --gpus are required (or --report)")
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if bad := [m for m in modes if m not in MODES]:
            parser.error(f"--modes {bad}: choose from {list(MODES)}")
        result = simulate_config(
            args.config, args.gpus, modes, cluster, Path(args.results_dir), args.trace, args.mfu
        )
    except (ValueError, FileNotFoundError) as exc:  # SimulateError, PlanError
        parser.error(str(exc))
    rows = result["rows"]
    print(f"Simulated step (a SIMULATION, not a measurement): {args.config} at {args.gpus} GPUs "
          f"({rows[0]['nodes']} node(s)), cluster: {cluster.name}")  # fmt: skip
    print(
        "| mode | step ms | speed-up vs fsdp2 | exposed ms (first/between/last) | SM-ms taken | layout ms |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['sim_step_ms']:.1f} | {r.get('sim_speedup_vs_fsdp2', float('nan')):.3f} | "
              f"{r['sim_exposed_ms']:.1f} ({r['sim_exposed_first_ms']:.1f}/{r['sim_exposed_between_ms']:.1f}/"
              f"{r['sim_exposed_last_ms']:.1f}) | {r['sim_sm_ms_taken']:.1f} | {r['sim_layout_ms']:.1f} |")  # fmt: skip
    print("Inputs:")
    for key, text in result["inputs"].sources.items():
        print(f"  {key}: {text}")
    print(f"  cluster: {cluster.source}")
    if args.json:
        out = {"rows": rows, "inputs": inputs_record(result["inputs"]), "cluster": asdict(cluster)}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
