"""The simulator's committed report (``python -m torchtitan_tide.simulate --report``):
validation against the measured 2x H200 and one-GPU steps, the reference configs at
8-64 GPUs, sensitivity to NIC bandwidth and node shape, and a picture of one simulated
step per mode. Writes ``<date>_<machine>_<commit>_simulation.{json,md,png}`` (the
naming of scripts/bench/common.py). Every figure is a SIMULATION except the
``measured_step_ms`` column of the validation."""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.memory_plan import MODES
from torchtitan_tide.simulate import (
    MEASURED_STEPS,
    REFERENCE_CONFIGS,
    REPO,
    WORLD1_SOURCE,
    WORLD1_STEP,
    Cluster,
    _read,
    build_inputs,
    inputs_record,
    simulate_config,
)
from torchtitan_tide.simulate_engine import idle_and_comm

TOLERANCE_PCT = 5.0
GPU_COUNTS = (8, 16, 32, 64)
# What the model lacks where a validation residual exceeds the tolerance (found by
# reading the measured profiles; no factor is fitted to close the gap).
MISSING = {
    ("h200x2_wan22_a14b_20layers", "*"): (
        "per-step trainer time outside the traced fwd+bwd is not an input (host input 0: no "
        "one-GPU trainer breakdown of Wan2.2); the residual, about 700 ms, is the same in every "
        "mode, so mode ratios hold, but no measured input explains it"
    ),
    ("h200x2_llama70b_4layers", "tide"): (
        "TIDE's own compute-stream work is not an input: the TIDE-RS accumulate kernels "
        "(8.9 ms/step measured at 680bfea, rs_kernel_ms) and the copy engine's HBM traffic "
        "beside compute (bench_interference reads -4% beside 8192^3, counted as 0)"
    ),
    ("world1", "*"): (
        "the one-GPU trainer applies no FSDP: fp32 parameters under torch.autocast (a bf16 "
        "cast of every weight at each use, fp32 gradients), not the traced bf16-param fwd+bwd "
        "of the 2-GPU step's per-GPU work; the 'parts' column compares compute and optimizer"
    ),
}


def _common():
    bench = str(REPO / "scripts" / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import common

    return common


def measured_step(results_dir: Path, config: str, mode: str) -> tuple[float | None, str]:
    """Best step ms of ``mode`` in the committed bench_step result, and its file."""
    name, row_mode = MEASURED_STEPS[config][mode]
    row = next((r for r in _read(results_dir, name)["rows"] if r["mode"] == row_mode), {})
    return row.get("best_step_ms"), f"{name} ({row_mode!r} row)"


def model_of(config: str) -> str:
    """A reference config's model: its name without the ``_<comm mode>`` suffix."""
    for mode in ("_symm_mem", "_fsdp2", "_tide"):
        if config.endswith(mode):
            return config.removesuffix(mode)
    return config


def _missing(config: str, mode: str) -> str:
    return MISSING.get((config, mode)) or MISSING.get((config, "*")) or "not explained"


def validation_rows(results_dir: Path, cluster: Cluster) -> list[dict[str, Any]]:
    """Simulated vs measured: every mode of the three h200x2_* configs at 2 GPUs, and
    the one-GPU step (no communication) where a one-GPU measurement exists."""
    rows = []
    for config in MEASURED_STEPS:
        sim = simulate_config(config, 2, MODES, cluster, results_dir)
        for r in sim["rows"]:
            measured, source = measured_step(results_dir, config, r["mode"])
            rows.append(
                _residual(
                    config,
                    r["mode"],
                    2,
                    r["sim_step_ms"],
                    measured,
                    source,
                    _missing(config, r["mode"]),
                )
            )
        if config in WORLD1_STEP:
            one = simulate_config(
                config, 1, ["fsdp2"], cluster, results_dir, cm=sim["cm"], inputs=sim["inputs"]
            )
            r = one["rows"][0]
            w1 = WORLD1_STEP[config]
            row = _residual(config, "none (1 GPU)", 1, r["sim_step_ms"], w1["step_ms"], WORLD1_SOURCE,
                            _missing("world1", "*"))  # fmt: skip
            row["parts"] = (f"compute sim {r['sim_compute_ms']:.1f} / measured {w1['compute_ms']:.1f} ms, "
                            f"optimizer {r['sim_optimizer_ms']:.1f} / {w1['optimizer_ms']:.1f} ms")  # fmt: skip
            rows.append(row)
    return rows


def _residual(config, mode, gpus, simulated, measured, source, missing) -> dict[str, Any]:
    res = None if not measured else 100 * (simulated / measured - 1)
    ok = res is not None and abs(res) <= TOLERANCE_PCT
    return {
        "config": config, "mode": mode, "gpus": gpus, "simulated_step_ms": simulated,
        "measured_step_ms": measured, "residual_pct": res, "within_5pct": ok,
        "missing": "" if ok else missing, "measured_source": source,
    }  # fmt: skip


def reference_rows(results_dir: Path, cluster: Cluster) -> tuple[list[dict], dict]:
    """The nine reference configs at 8-64 GPUs, each in the mode its TOML selects (the
    ``*_tide`` configs also as tide_ag); speed-up vs the same model's fsdp2 config."""
    from torchtitan_tide.fsdp_groups import load_config_model
    from torchtitan_tide.memory_report import selected_mode

    rows, inputs = [], {}
    fsdp2_step: dict[tuple[str, int], float] = {}
    for config in REFERENCE_CONFIGS:
        cm = load_config_model(config)
        model = model_of(config)
        inp = build_inputs(cm, results_dir, None, 0.4)
        inputs[config] = inputs_record(inp)
        mode = selected_mode(cm.tide)
        modes = [mode, "tide_ag"] if mode == "tide" else [mode]
        for gpus in GPU_COUNTS:
            for r in simulate_config(config, gpus, modes, cluster, results_dir, cm=cm, inputs=inp)[
                "rows"
            ]:
                if r["mode"] == "fsdp2":
                    fsdp2_step[(model, gpus)] = r["sim_step_ms"]
                r["model"] = model
                rows.append(r)
    for r in rows:
        base = fsdp2_step.get((r["model"], r["gpus"]))
        r["sim_speedup_vs_fsdp2"] = base / r["sim_step_ms"] if base else None
    return rows, inputs


def sensitivity_rows(results_dir: Path, cluster: Cluster) -> list[dict[str, Any]]:
    """Llama-3.1-70B and Qwen3-30B-A3B at 64 GPUs: NIC Gb/s per GPU, GPUs per node, and
    NCCL's hierarchical all-gather for symm_mem."""
    from torchtitan_tide.fsdp_groups import load_config_model

    rows = []
    variants = [
        ("nic_gbps_per_gpu", v, replace(cluster, nic_gbps_per_gpu=v)) for v in (100, 200, 400, 800)
    ]
    variants += [("gpus_per_node", v, replace(cluster, gpus_per_node=v)) for v in (4, 8)]
    variants += [("nccl_hierarchical_ag", True, replace(cluster, nccl_hierarchical_ag=True))]
    for config in ("llama70b_fsdp2", "qwen3_30b_a3b_fsdp2"):
        cm = load_config_model(config)
        inp = build_inputs(cm, results_dir, None, 0.4)
        for knob, value, variant in variants:
            for r in simulate_config(config, 64, MODES, variant, results_dir, cm=cm, inputs=inp)[
                "rows"
            ]:
                rows.append({"model": model_of(config), "knob": knob, "value": value, **r})
    return rows


VALIDATION_COLUMNS = [("config", "config"), ("mode", "mode"), ("gpus", "GPUs"),
                      ("simulated_step_ms", "simulated ms"), ("measured_step_ms", "measured ms"),
                      ("residual_pct", "residual %"), ("within_5pct", "within 5%"),
                      ("missing", "missing input / mechanism (residual > 5%)"), ("parts", "parts")]  # fmt: skip
REFERENCE_COLUMNS = [("config", "config"), ("gpus", "GPUs"), ("nodes", "nodes"), ("mode", "mode"),
                     ("sim_step_ms", "sim step ms"), ("sim_speedup_vs_fsdp2", "sim speed-up vs fsdp2"),
                     ("sim_exposed_ms", "sim exposed ms"), ("sim_exposed_first_ms", "first AG"),
                     ("sim_exposed_between_ms", "between"), ("sim_exposed_last_ms", "last RS"),
                     ("sim_sm_ms_taken", "SM-ms taken from compute"), ("sim_layout_ms", "layout ms")]  # fmt: skip
SENSITIVITY_COLUMNS = [("model", "model"), ("knob", "cluster knob"), ("value", "value"), ("mode", "mode"),
                       ("sim_step_ms", "sim step ms"), ("sim_speedup_vs_fsdp2", "speed-up vs fsdp2"),
                       ("sim_exposed_ms", "exposed ms")]  # fmt: skip


def write_report(results_dir: Path, out_dir: Path, cluster: Cluster) -> dict[str, str]:
    """Compute everything and write the JSON, Markdown and PNG; returns their paths."""
    common = _common()
    validation = validation_rows(results_dir, cluster)
    reference, inputs = reference_rows(results_dir, cluster)
    sensitivity = sensitivity_rows(results_dir, cluster)
    meta = common.metadata(max(GPU_COUNTS), machine="cpu")
    stem = common.result_stem(out_dir, "simulation", meta)
    tables = [
        {"title": "Validation: simulated vs measured steps (2x H200; one H200)", "columns": VALIDATION_COLUMNS, "rows": validation},
        {"title": f"Reference configs at 8-64 GPUs (SIMULATION; cluster: {cluster.name})", "columns": REFERENCE_COLUMNS, "rows": reference},
        {"title": "Sensitivity at 64 GPUs (SIMULATION)", "columns": SENSITIVITY_COLUMNS, "rows": sensitivity},
    ]  # fmt: skip
    result = {
        "kind": "simulation",
        "metadata": meta,
        "cluster": asdict(cluster),
        "validation": validation,
        "reference": reference,
        "sensitivity": sensitivity,
        "inputs": inputs,
        "tables": [{**t, "columns": [list(c) for c in t["columns"]]} for t in tables],
        "headline": [],
    }
    within = sum(1 for r in validation if r["within_5pct"])
    notes = (
        f"A SIMULATION (torchtitan_tide/simulate.py, docs/2026-12-01-simulator.md), not a measurement, "
        f"except the validation's measured column. {within} of {len(validation)} validation rows "
        f"within {TOLERANCE_PCT:.0f}%; no fitted factor. Inputs and their sources: the JSON's `inputs` "
        f"(per reference config) and each validation row's `measured_source`. Picture: "
        f"llama70b_fsdp2 at 64 GPUs, one simulated step per mode.\n"
    )
    paths = {"markdown": str(stem) + ".md", "json": str(stem) + ".json"}
    common.write_result(stem, result, "Step simulation per comm mode", notes)
    if draw_streams(Path(str(stem) + ".png"), "llama70b_fsdp2", 64, cluster, results_dir):
        paths["png"] = str(stem) + ".png"
    return paths


STREAM_ROWS = ("compute", "nccl", "ce", "rs_local", "rs_net")
COLORS = {"compute": "#4c72b0", "layout": "#dd8452", "optimizer": "#55a868", "host": "#bbbbbb",
          "ag": "#8172b3", "rs": "#c44e52", "net": "#937860"}  # fmt: skip


def exposed_intervals(spans) -> list[tuple[float, float]]:
    """Compute-stream idle intervals during which communication runs."""
    idle, comm = idle_and_comm(spans)
    out = []
    for a, b in idle:
        for c, d in comm:
            if min(b, d) > max(a, c):
                out.append((max(a, c), min(b, d)))
    return out


def draw_streams(path: Path, config: str, gpus: int, cluster: Cluster, results_dir: Path) -> bool:
    """Per mode, the streams of one simulated step over time; exposed communication
    hatched red on the compute row. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    sim = simulate_config(config, gpus, MODES, cluster, results_dir)
    fig, axes = plt.subplots(len(MODES), 1, figsize=(16, 2.2 * len(MODES)), sharex=True)
    for ax, mode in zip(axes, MODES):
        spans = sim["spans"][mode]
        row = next(r for r in sim["rows"] if r["mode"] == mode)
        for y, stream in enumerate(STREAM_ROWS):
            bars = [
                (s.start_ms, s.end_ms - s.start_ms, s.op.kind)
                for s in spans
                if s.op.stream == stream
            ]
            for kind in {k for _, _, k in bars}:
                ax.broken_barh([(a, w) for a, w, k in bars if k == kind], (y - 0.4, 0.8),
                               facecolors=COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.2)  # fmt: skip
        exposed = exposed_intervals(spans)
        ax.broken_barh([(a, b - a) for a, b in exposed], (-0.45, 0.9), facecolors="none",
                       edgecolor="red", hatch="////", linewidth=0.8)  # fmt: skip
        ax.set_yticks(range(len(STREAM_ROWS)), STREAM_ROWS)
        ax.invert_yaxis()
        ax.set_title(f"{mode}: step {row['sim_step_ms']:.0f} ms, exposed {row['sim_exposed_ms']:.1f} ms "
                     f"(first AG {row['sim_exposed_first_ms']:.1f}, between {row['sim_exposed_between_ms']:.1f}, "
                     f"last RS {row['sim_exposed_last_ms']:.1f}), SM-ms taken {row['sim_sm_ms_taken']:.1f}",
                     fontsize=9, loc="left")  # fmt: skip
    axes[-1].set_xlabel("ms (simulated)")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    handles.append(Patch(facecolor="none", edgecolor="red", hatch="////", label="exposed comm"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"SIMULATION: {config} at {gpus} GPUs ({cluster.name}), one step per comm mode",
                 x=0.01, ha="left", fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
