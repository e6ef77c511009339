"""The simulator's committed report (``python -m torchtitan_tide.simulator --report``):
validation against the measured 2x H200 and one-GPU steps, tide against stock FSDP2 and
both SymmMem generations at 64 GPUs with each step's breakdown (compute, SM time taken
from compute, layout copies, exposed communication in forward / backward / tail) beside
the paper's figures and every assumption of ours the paper does not state, the
interference table per engine and compute class (measured or modeled), the reference
configs at 8-64 GPUs, the sensitivity to tokens per GPU x NIC bandwidth for the three
models and to the cluster and TIDE's options, and a picture of one simulated step per
mode. Writes ``<date>_<machine>_<commit>_simulation.{json,md,png}``
(the naming of scripts/bench/common.py). Every figure is a SIMULATION except the
``measured_step_ms`` column of the validation. Reads only what the model returns
(rows, sources) and the measured steps (``inputs.measured_step`` / ``world1_step``)."""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from torchtitan_tide.simulator.cluster import NCCL_MEASURED, Cluster
from torchtitan_tide.simulator.engine import base_name, device_spans, idle_and_comm, other_spans
from torchtitan_tide.simulator.inputs import (
    MEASURED_STEPS,
    MODES,
    REPO,
    Inputs,
    Workload,
    build_inputs,
    inputs_record,
    measured_step,
    stock_step_spread,
    with_compute_level,
    without_comm_slowdown,
    world1_step,
)
from torchtitan_tide.simulator.network import SOURCES as LINK_SOURCES
from torchtitan_tide.simulator.step import simulate_config

TOLERANCE_PCT = 5.0
GPU_COUNTS = (8, 16, 32, 64)
NCCL_NEW = "2.31.2"  # a release with 2.29.7's LSA+GIN RS and 2.30.7's zero-SM AG
REFERENCE_CONFIGS = tuple(
    f"{m}_{c}"
    for m in ("llama70b", "qwen3_30b_a3b", "wan22_a14b")
    for c in ("fsdp2", "symm_mem", "tide")
)
# The paper's abstract, quoted as it is: step-time reductions, no model named.
PAPER = (
    "TIDE paper (abstract): step time reduced by up to 27.1% relative to stock FSDP2 (a "
    "1.372x speed-up) and by up to 6.0% relative to FSDP2+SymmMem (1.064x), across "
    "Llama-3.1 70B, Wan2.2 and Qwen3-30B-A3B; the abstract does not say which model "
    "reaches either figure"
)
# What the paper's abstract does not state and the simulation has to assume.
ASSUMPTIONS = (
    "node shape: 8 GPUs per node (8 x 8 at 64 GPUs); the abstract gives only '64 GPUs'",
    (
        "network: one 400 Gb/s NIC per GPU (8x400G), NCCL's flat ring across nodes for stock "
        "FSDP2; sensitivity at 100 / 200 Gb/s"
    ),
    (
        "tokens per GPU: the configs' (Llama and Qwen3 8192 in one sequence, Wan2.2 one latent "
        "of 32,760 tokens); sensitivity at 2048 / 4096 / 8192 (one sequence each)"
    ),
    "activation checkpointing: full in every reference config (the abstract does not say)",
    (
        "precision: bf16 parameters and gradients, fp32 reduce (stock FSDP2 sends fp32), fp32 "
        "master weights, fused AdamW"
    ),
    (
        "SymmMem baseline: NCCL 2.28.9 (measured on 2x H200) and NCCL 2.31.2 (hierarchical "
        "zero-SM all-gather, LSA+GIN reduce-scatter: modeled from release notes); tide is "
        "compared with the stronger"
    ),
    (
        "TIDE: the op plans the code runs (comm/plans/window_rounds.py on NCCL windows, comm/plans/plan.py "
        "on the copy engine and send/recv), on the transport its [tide] ag_transport / "
        "cross_node_transport = 'auto' take on the row's NCCL (>= 2.29: NCCL windows and the "
        "one-sided phase-2 ring, host RMA between nodes assumed; 2.28.9: copy engine in the "
        "node, send/recv across), fp32 partials on the RS wire unless a row says bf16; in place "
        "where the plan delivers in place (every N x L of more than one node since issue 45: "
        "at 8 x 8 no pack, no placement copy); every local rank of a node simulated on its own "
        "GPU (streams, NIC, NVLink, HBM), the one whose step ends last sets the step; the "
        "in-place arena's credits not modeled (every all-gather finds its range free)"
    ),
    (
        "local copies (placement, pack; in place at 8 x 8: TIDE-RS's pack only): a wave of "
        "per-parameter copies forced onto the copy engine (bench_interference --one-gpu, "
        "local_batch_ce), its rate alone and both interference figures, measured on one "
        "H100 where no H200 measured it (the other inputs are H200's); without it the most "
        "pessimistic figure the project has: the interference table says which"
    ),
    "H200 SXM GPUs at the power-capped clocks of the measured machines",
)
# Residuals no measured input explains (found by reading the committed profiles; no
# factor is fitted to close them).
UNEXPLAINED = {
    ("h200x2_llama70b_4layers", "tide"): (
        "not explained by a measured input: every TIDE kernel and both interference "
        "directions are charged per engine; left: TIDE's host work per group (the "
        "all-gather run-ahead bound waits on the host), the copy engine's HBM traffic "
        "beside the step's bandwidth-bound kernels (measured beside GEMMs only), and the "
        "2-GPU step's SM clock (Llama's trace runs power-capped at ~1470-1560 MHz)"
    ),
    ("h200x2_qwen3_30b_a3b_4layers", "tide"): (
        "not explained by a measured input (with the one-GPU interference, 2026-12-04): the "
        "grouped expert GEMM beside the copy engine is measured beside a device-to-device "
        "copy of one GPU (HBM read and write at the local rate), charged here for TIDE's "
        "NVLink pulls, which move a fraction of that HBM traffic per GPU; with the 2x H200 "
        "inputs alone this row was within 5% (docs/design/2026-12-04-simulator.md)"
    ),
    ("h200x2_qwen3_30b_a3b_4layers", "fsdp2"): (
        "not explained by a measured input: the largest uncertain term is compute slowed "
        "beside NCCL's collectives (bench_interference's synthetic GEMM of the shape class; "
        "the grouped expert GEMM itself is not timed beside a collective); the measured stock "
        "step itself varies between runs (column 'stock fsdp2 measured range ms')"
    ),
}


def _common():
    bench = str(REPO / "scripts" / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import common

    return common


def model_of(config: str) -> str:
    """A reference config's model: its name without the ``_<comm mode>`` suffix."""
    for mode in ("_symm_mem", "_fsdp2", "_tide"):
        if config.endswith(mode):
            return config.removesuffix(mode)
    return config


def _why(config: str, mode: str, sources: dict[str, str]) -> str:
    """What the model lacks for a row outside the tolerance, from its inputs' sources."""
    lacking = []
    if sources.get("host", "").startswith("not measured"):
        lacking.append(
            f"per-step trainer time outside fwd+bwd is an input of 0 ({sources['host']})"
        )
    if "world1_trace" in sources:
        lacking.append(f"world-1 trace {sources['world1_trace']}")
    if note := UNEXPLAINED.get((config, mode)):
        lacking.append(note)
    return "; ".join(lacking) or "not explained"


def validation_rows(results_dir: Path, cluster: Cluster) -> list[dict[str, Any]]:
    """Simulated vs measured: every mode of the three h200x2_* configs at 2 GPUs, and
    the one-GPU trainer step (no FSDP) where a one-GPU measurement exists. Where the
    config's in-step level was measured (``inputs.in_step_compute``), each row also has
    the step simulated with it (``in_step_*``; not the row's verdict)."""
    rows = []
    for config in MEASURED_STEPS:
        sim = simulate_config(config, 2, MODES, cluster, results_dir)
        at_level = _at_in_step_level(config, 2, MODES, cluster, results_dir, sim)
        for r in sim["rows"]:
            measured, source = measured_step(results_dir, config, r["mode"])
            row = _residual(config, r["mode"], 2, r, measured, source, sim["sources"])
            if r["mode"] == "fsdp2":
                row["stock_range"] = _spread_text(results_dir, config)
            rows.append({**row, **_level_columns(sim["inputs"], at_level.get(r["mode"]), measured)})
        w1, w1_source = world1_step(results_dir, config)
        if not w1:
            continue
        one = simulate_config(config, 1, ["fsdp2"], cluster, results_dir, cm=sim["cm"])
        r = one["rows"][0]
        row = _residual(config, "none (1 GPU)", 1, r, w1["step_ms"], w1_source, one["sources"])
        row["parts"] = (f"compute sim {r['sim_compute_ms']:.1f} / measured {w1['compute_ms']:.1f} ms, "
                        f"optimizer {r['sim_optimizer_ms']:.1f} / {w1['optimizer_ms']:.1f} ms")  # fmt: skip
        level_one = _at_in_step_level(config, 1, ["fsdp2"], cluster, results_dir, one)
        rows.append({**row, **_level_columns(one["inputs"], level_one.get("fsdp2"), w1["step_ms"])})
    return rows


def _spread_text(results_dir: Path, config: str) -> str:
    spread = stock_step_spread(results_dir, config)
    if spread is None:
        return ""
    low, high, runs = spread
    return f"{low:.1f}-{high:.1f} ({runs} runs)"


def _at_in_step_level(config, gpus, modes, cluster, results_dir, sim) -> dict[str, float]:
    """Per mode, the simulated step ms with the config's in-step level applied ({} when
    the level was not measured)."""
    level = sim["inputs"].in_step_level
    if level is None:
        return {}
    scaled = with_compute_level(sim["inputs"], level)
    again = simulate_config(config, gpus, modes, cluster, results_dir, cm=sim["cm"], inputs=scaled)
    return {r["mode"]: r["sim_step_ms"] for r in again["rows"]}


def _level_columns(inputs: Inputs, simulated: float | None, measured: float | None) -> dict:
    res = None if not (simulated and measured) else 100 * (simulated / measured - 1)
    return {"in_step_level": inputs.in_step_level, "in_step_simulated_ms": simulated,
            "in_step_residual_pct": res}  # fmt: skip


def _residual(config, mode, gpus, sim_row, measured, source, sources) -> dict[str, Any]:
    simulated = sim_row["sim_step_ms"]
    res = None if not measured else 100 * (simulated / measured - 1)
    ok = res is not None and abs(res) <= TOLERANCE_PCT
    return {
        "config": config, "mode": mode, "gpus": gpus, "simulated_step_ms": simulated,
        "measured_step_ms": measured, "residual_pct": res, "within_5pct": ok, "stock_range": "",
        "sm_ms_taken": sim_row["sim_sm_ms_taken"], "accumulate_ms": sim_row["sim_accumulate_ms"],
        "comm_slowed_ms": sim_row["sim_comm_slowed_ms"],
        "missing": "" if ok else _why(config, mode, sources), "measured_source": source,
        "sources": dict(sources),
    }  # fmt: skip


def reference_rows(results_dir: Path, cluster: Cluster) -> tuple[list[dict], dict]:
    """The nine reference configs at 8-64 GPUs, each in the mode its TOML selects (the
    ``*_tide`` configs also as tide_ag); speed-up vs the same model's fsdp2 config."""
    from torchtitan_tide.fsdp_groups import load_config_model
    from torchtitan_tide.memory_report import selected_mode

    rows, inputs = [], {}
    fsdp2_step: dict[tuple[str, int], float] = {}
    ceiling: dict[tuple[str, int], float] = {}
    for config in REFERENCE_CONFIGS:
        cm = load_config_model(config)
        model = model_of(config)
        inp = build_inputs(cm, results_dir, None, 0.4)
        inputs[config] = inputs_record(inp)
        mode = selected_mode(cm.tide)
        modes = [mode, "tide_ag"] if mode == "tide" else [mode]
        for gpus in GPU_COUNTS:
            sim = simulate_config(config, gpus, modes, cluster, results_dir, cm=cm, inputs=inp)
            for r in sim["rows"]:
                if r["mode"] == "fsdp2":
                    fsdp2_step[(model, gpus)] = r["sim_step_ms"]
                    ceiling[(model, gpus)] = r["sim_step_ms"] / _floor(r)
                rows.append({**r, "model": model})
    for r in rows:
        base = fsdp2_step.get((r["model"], r["gpus"]))
        r["sim_speedup_vs_fsdp2"] = base / r["sim_step_ms"] if base else None
        r["ceiling_vs_fsdp2"] = ceiling.get((r["model"], r["gpus"]))
    return rows, inputs


AS_BUILT = f"tide (NCCL {NCCL_MEASURED}: as built, copy engine + send/recv)"
AUTO_NEW = f"tide (NCCL {NCCL_NEW}: auto, NCCL windows + one-sided ring)"


def _variants(old: Cluster, new: Cluster) -> list[tuple[str, str, Cluster, dict]]:
    """The 64-GPU comparison's rows, one per row the code runs: (mode, label, cluster,
    simulate_config options). TIDE on each NCCL runs what ``auto`` takes there."""
    return [
        ("fsdp2", "fsdp2", old, {}),
        ("symm_mem", f"symm_mem (NCCL {NCCL_MEASURED})", old, {}),
        ("symm_mem", f"symm_mem (NCCL {NCCL_NEW})", new, {}),
        ("tide", AS_BUILT, old, {}),
        ("tide", AUTO_NEW, new, {}),
        ("tide", f"tide (NCCL {NCCL_NEW}: auto, bf16 wire)", new, {"rs_wire_bytes": 2}),
    ]


def baseline_rows(results_dir: Path, cluster: Cluster, gpus: int = 64) -> list[dict[str, Any]]:
    """Per model at ``gpus``: fsdp2, symm_mem and tide on NCCL 2.28.9 and on NCCL >= 2.31
    (tide: what ``auto`` runs there), each with its step breakdown, its speed-up against
    fsdp2 and against the symm_mem of the same NCCL, and the ceiling (:func:`_ceiling`)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    out: list[dict[str, Any]] = []
    cms: dict[str, Any] = {}
    old, new = replace(cluster, nccl_version=NCCL_MEASURED), replace(cluster, nccl_version=NCCL_NEW)
    variants = _variants(old, new)
    for model in ("llama70b", "qwen3_30b_a3b", "wan22_a14b"):
        for mode, label, clu, kw in variants:
            config = f"{model}_{mode}"
            if config not in cms:
                cm = load_config_model(config)
                cms[config] = (cm, build_inputs(cm, results_dir, None, 0.4))
            cm, inp = cms[config]
            r = simulate_config(config, gpus, [mode], clu, results_dir, cm=cm, inputs=inp, **kw)
            r = r["rows"][0]
            r["step_ms_comm_not_slowed"] = simulate_config(
                config, gpus, [mode], clu, results_dir, cm=cm, inputs=without_comm_slowdown(inp),
                **kw,
            )["rows"][0]["sim_step_ms"]  # fmt: skip
            out.append({"model": model, "gpus": gpus, "variant": label, **r})
        _compare(out[-len(variants) :])
    return out


def _floor(row: dict[str, Any]) -> float:
    """A row's step without communication: compute, optimizer and host."""
    return row["sim_bd_compute_ms"] + row["sim_bd_optimizer_ms"] + row["sim_bd_host_ms"]


def _ceiling(rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Beside a row's speed-up, its ceiling (stock's step over compute + optimizer + host:
    no speed-up from communication can pass it) and what the row still loses to it: SM
    time taken from compute, layout copies, exposed communication."""
    stock = next(r for r in rows if r["mode"] == "fsdp2")
    row["ceiling_vs_fsdp2"] = stock["sim_step_ms"] / _floor(stock)
    row["lost_to_ceiling_ms"] = row["sim_step_ms"] - _floor(row)
    row["lost_exposed_ms"] = sum(row[f"sim_bd_exposed_{k}_ms"] for k in ("fwd", "bwd", "tail"))


def _compare(rows: list[dict[str, Any]]) -> None:
    """Speed-up of each row against fsdp2 and against the symm_mem row of the same NCCL,
    with and without collectives slowed by compute; the ceiling beside it."""
    for key, tag in (("sim_step_ms", ""), ("step_ms_comm_not_slowed", "_comm_not_slowed")):
        step = {r["variant"]: r[key] for r in rows}
        symm = {r["nccl"]: r[key] for r in rows if r["mode"] == "symm_mem"}
        for row in rows:
            row[f"vs_fsdp2_reduction_pct{tag}"] = 100 * (1 - row[key] / step["fsdp2"])
            row[f"vs_fsdp2_speedup{tag}"] = step["fsdp2"] / row[key]
            row[f"vs_symm_reduction_pct{tag}"] = 100 * (1 - row[key] / symm[row["nccl"]])
            row[f"vs_symm_speedup{tag}"] = symm[row["nccl"]] / row[key]
    for row in rows:
        _ceiling(rows, row)


def ring_rs_symm_mem(inputs: Inputs) -> Inputs:
    """``inputs`` with symm_mem's reduce-scatter replaced by NCCL's ring (fsdp2's measured
    rate and the ring kernel's interference): symm_mem with only its all-gather in
    symmetric memory, what the public API allows on NCCL < 2.30.7 (not built)."""
    transport = {
        **inputs.transport_gibps,
        "symm_mem": {
            **inputs.transport_gibps["symm_mem"],
            "rs": inputs.transport_gibps["fsdp2"]["rs"],
        },
    }
    engines = {**inputs.engines, "nccl_symk": inputs.engines["nccl"]}
    return replace(inputs, transport_gibps=transport, engines=engines)


TOKENS = (2048, 4096, 8192)
NIC_GBPS = (100, 200, 400)


def sensitivity_rows(results_dir: Path, cluster: Cluster) -> list[dict[str, Any]]:
    """Llama-3.1-70B and Qwen3-30B-A3B at 64 GPUs: GPUs per node, the NCCL generation
    (TIDE takes what ``auto`` runs on it), collectives not slowed by compute, symm_mem with
    NCCL's ring RS, and the transports the code can be told to run on NCCL 2.31."""
    from torchtitan_tide.fsdp_groups import load_config_model

    rows = []
    new = replace(cluster, nccl_version=NCCL_NEW)
    variants = [("gpus_per_node", v, replace(cluster, gpus_per_node=v), {}) for v in (4, 8)]
    variants += [("nccl_version", v, replace(cluster, nccl_version=v), {})
                 for v in ("2.30.7", NCCL_NEW)]  # fmt: skip
    variants += [(f"TIDE on NCCL {NCCL_NEW}", "rs_wire_dtype = 'bfloat16'", new,
                  {"rs_wire_bytes": 2})]  # fmt: skip
    for config in ("llama70b_fsdp2", "qwen3_30b_a3b_fsdp2"):
        cm = load_config_model(config)
        inp = build_inputs(cm, results_dir, None, 0.4)
        for knob, value, variant, ins, kw in [
            *((k, v, c, inp, kw) for k, v, c, kw in variants),
            ("comm slowed by compute", "off (not applied)", cluster,
             without_comm_slowdown(inp), {}),
            ("symm_mem RS (NCCL 2.28.9)", "ring (not built)", cluster, ring_rs_symm_mem(inp), {}),
        ]:  # fmt: skip
            sim = simulate_config(config, 64, MODES, variant, results_dir, cm=cm, inputs=ins, **kw)
            stock = next(r for r in sim["rows"] if r["mode"] == "fsdp2")
            rows += [
                {"model": model_of(config), "knob": knob, "value": value,
                 "ceiling_vs_fsdp2": stock["sim_step_ms"] / _floor(stock), **r}
                for r in sim["rows"]
            ]  # fmt: skip
    return rows


# The tokens x NIC table's step columns: (key, mode, NCCL, simulate_config options), one
# per row the code can run.
TOKENS_NIC_ROWS = (
    ("fsdp2", "fsdp2", NCCL_MEASURED, {}),
    ("symm_mem_2_28", "symm_mem", NCCL_MEASURED, {}),
    ("symm_mem_2_31", "symm_mem", NCCL_NEW, {}),
    ("tide_2_28", "tide", NCCL_MEASURED, {}),
    ("tide_2_31", "tide", NCCL_NEW, {}),
    ("tide_2_31_bf16", "tide", NCCL_NEW, {"rs_wire_bytes": 2}),
)


def tokens_nic_rows(
    results_dir: Path, cluster: Cluster, gpus: int = 64,
    tokens_per_gpu: tuple[int, ...] = TOKENS, nics: tuple[int, ...] = NIC_GBPS,
    models: tuple[str, ...] = ("llama70b", "qwen3_30b_a3b", "wan22_a14b"),
) -> list[dict[str, Any]]:  # fmt: skip
    """The three models at ``gpus``: tokens per GPU (one sequence) x NIC Gb/s per GPU; one
    step column per row the code can run (:data:`TOKENS_NIC_ROWS`: TIDE as ``auto`` runs it
    on each NCCL), tide against stock FSDP2 and the symm_mem of the same NCCL, and the
    ceiling (stock's step over compute + optimizer + host)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    rows = []
    for model in models:
        cms = {m: load_config_model(f"{model}_{m}") for m in ("fsdp2", "symm_mem", "tide")}
        for tokens in tokens_per_gpu:
            work = Workload(tokens, tokens)
            ins = {m: build_inputs(cm, results_dir, None, 0.4, workload=work)
                   for m, cm in cms.items()}  # fmt: skip
            for nic in nics:
                step, floor = {}, 0.0
                for key, mode, nccl, kw in TOKENS_NIC_ROWS:
                    clu = replace(cluster, nic_gbps_per_gpu=nic, nccl_version=nccl)
                    sim = simulate_config(f"{model}_{mode}", gpus, [mode], clu, results_dir,
                                          cm=cms[mode], inputs=ins[mode], **kw)  # fmt: skip
                    step[key] = sim["rows"][0]["sim_step_ms"]
                    if key == "fsdp2":
                        floor = _floor(sim["rows"][0])
                rows.append({
                    "model": model, "tokens_per_gpu": tokens, "nic_gbps_per_gpu": nic,
                    **{f"{k}_ms": v for k, v in step.items()},
                    "ceiling_vs_fsdp2": step["fsdp2"] / floor,
                    "tide_2_28_vs_fsdp2": step["fsdp2"] / step["tide_2_28"],
                    "tide_2_28_vs_symm_mem": step["symm_mem_2_28"] / step["tide_2_28"],
                    "tide_2_31_vs_fsdp2": step["fsdp2"] / step["tide_2_31"],
                    "tide_2_31_vs_symm_mem": step["symm_mem_2_31"] / step["tide_2_31"],
                    "tide_2_31_bf16_vs_symm_mem": step["symm_mem_2_31"] / step["tide_2_31_bf16"],
                })  # fmt: skip
    return rows


AS_RUN = "as run (in place at N x L: no pack, no placement copy)"
IN_PLACE_OFF = "for reference, what the code runs with in place off (ag_in_place_groups = 0)"
PACK_AS_NVLINK = "TIDE-RS pack copies as NVLink copies"
NO_PACK = "no TIDE-RS pack copies (no local copy left)"
WHAT_IFS = (AS_RUN, IN_PLACE_OFF, PACK_AS_NVLINK, NO_PACK)


def what_if_rows(results_dir: Path, cluster: Cluster, gpus: int = 64) -> list[dict[str, Any]]:
    """What would close the rest, NOT what the code runs: the headline's NCCL 2.31 row (in
    place at every N x L, issue 45: the all-gather has no pack and no placement copy, so the
    earlier "no local copies" what-if is what it runs) with one input changed, each named.
    The local copies left are TIDE-RS phase 1's packs (``PackSlices``): ``as NVLink
    copies``: stretched and slowing compute as the copy engine's NVLink copies (+1.8%,
    +9%), not as the copy engine's local copy measured on one GPU (``local_batch_ce``);
    ``no ... pack copies``: free. For reference (a row the
    code runs, not a what-if): in place off, the placement path, to show what in place
    took off without counting it twice."""
    from torchtitan_tide.fsdp_groups import load_config_model

    new = replace(cluster, nccl_version=NCCL_NEW)
    rows = []
    for model in ("llama70b", "qwen3_30b_a3b", "wan22_a14b"):
        steps = {}
        for mode in ("fsdp2", "symm_mem", "tide"):
            cm = load_config_model(f"{model}_{mode}")
            ins = build_inputs(cm, results_dir, None, 0.4)
            variants = {mode: (ins, {})}
            if mode == "tide":
                variants = {
                    AS_RUN: (ins, {}),
                    IN_PLACE_OFF: (ins, {"in_place_groups": 0}),
                    PACK_AS_NVLINK: (replace(ins, engines={
                        **ins.engines, "ce_local": ins.engines["ce"]}), {}),
                    NO_PACK: (replace(ins, copy_gibps=1e12, engines={
                        **ins.engines, "ce_local": (0.0, 0.0)}), {}),
                }  # fmt: skip
            for name, (variant, kw) in variants.items():
                sim = simulate_config(f"{model}_{mode}", gpus, [mode], new, results_dir, cm=cm,
                                      inputs=variant, **kw)  # fmt: skip
                steps[name] = sim["rows"][0]["sim_step_ms"]
                if mode == "fsdp2":
                    ceiling = steps[name] / _floor(sim["rows"][0])
        for name in WHAT_IFS:
            rows.append({"model": model, "what_if": name, "sim_step_ms": steps[name],
                         "vs_fsdp2_speedup": steps["fsdp2"] / steps[name],
                         "ceiling_vs_fsdp2": ceiling,
                         "vs_symm_speedup": steps["symm_mem"] / steps[name]})  # fmt: skip
    return rows


def headline_rows(baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and NCCL: the row ``auto`` runs there against stock FSDP2 and the symm_mem
    of the same NCCL, the ceiling beside it, what it still loses, and the paper's figures."""
    out = []
    for row in baseline:
        if row["mode"] != "tide" or row["rs_wire_bytes"] != 4:
            continue
        out.append({
            "model": row["model"], "nccl": row["nccl"], "tide_runs": row["variant"],
            "vs_fsdp2_speedup": row["vs_fsdp2_speedup"],
            "ceiling_vs_fsdp2": row["ceiling_vs_fsdp2"],
            "vs_symm_speedup": row["vs_symm_speedup"],
            "lost_to_ceiling_ms": row["lost_to_ceiling_ms"],
            "sm_taken_ms": row["sim_bd_sm_taken_ms"], "exposed_ms": row["lost_exposed_ms"],
            "layout_ms": row["sim_bd_layout_ms"], "local_copies_ms": row["sim_bd_local_copies_ms"],
            "paper": "1.372x vs stock (up to), 1.064x vs FSDP2+SymmMem (up to)",
        })  # fmt: skip
    return out


def assumption_rows(inputs: dict[str, Inputs]) -> list[dict[str, str]]:
    """The paper's figures, our assumptions it does not state, and the physical figures
    the model uses (each with its source)."""
    rows = [{"kind": "paper (abstract)", "what": PAPER}]
    rows += [{"kind": "our assumption", "what": a} for a in ASSUMPTIONS]
    rows += [{"kind": f"modeled: {k}", "what": v} for k, v in LINK_SOURCES.items()]
    for config, inp in inputs.items():
        rows.append({"kind": f"measured: copy engine in the 2-GPU step ({config})",
                     "what": inp.sources.get("copy_engine_in_step", "")})  # fmt: skip
        rows.append({"kind": f"measured: compute classes ({config})",
                     "what": inp.sources.get("class_weights", "")})  # fmt: skip
    return rows


VALIDATION_COLUMNS = [("config", "config"), ("mode", "mode"), ("gpus", "GPUs"),
                      ("simulated_step_ms", "simulated ms"), ("measured_step_ms", "measured ms"),
                      ("residual_pct", "residual %"), ("within_5pct", "within 5%"),
                      ("stock_range", "stock fsdp2 measured range ms"),
                      ("sm_ms_taken", "SM-ms taken"), ("accumulate_ms", "TIDE accumulate ms"),
                      ("comm_slowed_ms", "comm slowed by compute ms"),
                      ("in_step_level", "in-step level (not applied)"),
                      ("in_step_simulated_ms", "simulated at in-step level ms"),
                      ("in_step_residual_pct", "residual at in-step level %"),
                      ("missing", "missing input / mechanism (residual > 5%)"), ("parts", "parts")]  # fmt: skip
BREAKDOWN = [("sim_bd_compute_ms", "compute ms"),
             ("sim_bd_sm_taken_ms", "SM time taken from compute ms"),
             ("sim_bd_layout_ms", "layout copies ms"),
             ("sim_bd_exposed_fwd_ms", "exposed comm: forward ms"),
             ("sim_bd_exposed_bwd_ms", "exposed comm: backward ms"),
             ("sim_bd_exposed_tail_ms", "exposed comm: tail ms"),
             ("sim_bd_optimizer_ms", "optimizer ms"), ("sim_bd_host_ms", "host ms")]  # fmt: skip
BASELINE_COLUMNS = [("model", "model"), ("variant", "variant"),
                    ("tide_transport", "TIDE runs"), ("rs_phase2", "TIDE-RS phase 2"),
                    ("in_place", "in place"),
                    ("sim_slowest_local_rank", "local rank that sets the step"),
                    ("sim_step_ms", "sim step ms"),
                    ("vs_fsdp2_reduction_pct", "step-time reduction vs fsdp2 %"),
                    ("vs_fsdp2_speedup", "speed-up vs fsdp2"),
                    ("ceiling_vs_fsdp2", "ceiling vs fsdp2"),
                    ("vs_symm_reduction_pct", "reduction vs symm_mem (same NCCL) %"),
                    ("vs_symm_speedup", "speed-up vs symm_mem (same NCCL)"),
                    ("lost_to_ceiling_ms", "lost to the ceiling ms"),
                    *BREAKDOWN, ("sim_bd_local_copies_ms", "local copies, device ms"),
                    ("sim_bd_nic_busy_ms", "NIC busy ms"),
                    ("sim_accumulate_ms", "TIDE accumulate ms"),
                    ("sim_comm_slowed_ms", "comm slowed by compute and shared links ms"),
                    ("step_ms_comm_not_slowed", "sim step ms, comm not slowed"),
                    ("vs_fsdp2_speedup_comm_not_slowed", "speed-up vs fsdp2, comm not slowed"),
                    ("vs_symm_speedup_comm_not_slowed",
                     "speed-up vs symm_mem, comm not slowed")]  # fmt: skip
HEADLINE_COLUMNS = [("model", "model"), ("nccl", "NCCL"), ("tide_runs", "TIDE runs (auto)"),
                    ("vs_fsdp2_speedup", "speed-up vs stock FSDP2"),
                    ("ceiling_vs_fsdp2", "ceiling (stock / (compute + optimizer + host))"),
                    ("vs_symm_speedup", "speed-up vs FSDP2 + SymmMem (same NCCL)"),
                    ("lost_to_ceiling_ms", "TIDE's step above compute + optimizer + host ms"),
                    ("sm_taken_ms", "of it: SM time taken ms"),
                    ("exposed_ms", "of it: exposed comm ms"), ("layout_ms", "of it: layout ms"),
                    ("local_copies_ms", "local copies, device ms (off the compute stream)"),
                    ("paper", "the paper")]  # fmt: skip
WHAT_IF_COLUMNS = [("model", "model"),
                   ("what_if", "what if (not what the code runs, unless the row says so)"),
                   ("sim_step_ms", "sim step ms"), ("vs_fsdp2_speedup", "speed-up vs fsdp2"),
                   ("ceiling_vs_fsdp2", "ceiling vs fsdp2"),
                   ("vs_symm_speedup", f"speed-up vs symm_mem (NCCL {NCCL_NEW})")]  # fmt: skip
REFERENCE_COLUMNS = [("config", "config"), ("gpus", "GPUs"), ("nodes", "nodes"), ("mode", "mode"),
                     ("tide_transport", "TIDE runs"), ("sim_step_ms", "sim step ms"),
                     ("sim_speedup_vs_fsdp2", "sim speed-up vs fsdp2"),
                     ("ceiling_vs_fsdp2", "ceiling vs fsdp2"),
                     *BREAKDOWN, ("sim_accumulate_ms", "TIDE accumulate ms"),
                     ("sim_comm_slowed_ms", "comm slowed by compute and shared links ms")]  # fmt: skip
SENSITIVITY_COLUMNS = [("model", "model"), ("knob", "cluster knob"), ("value", "value"), ("mode", "mode"),
                       ("tide_transport", "TIDE runs"), ("rs_phase2", "TIDE-RS phase 2"),
                       ("sim_step_ms", "sim step ms"), ("sim_speedup_vs_fsdp2", "speed-up vs fsdp2"),
                       ("ceiling_vs_fsdp2", "ceiling vs fsdp2"), ("sim_exposed_ms", "exposed ms")]  # fmt: skip
TOKENS_NIC_COLUMNS = [("model", "model"), ("tokens_per_gpu", "tokens per GPU"),
                      ("nic_gbps_per_gpu", "NIC Gb/s per GPU"), ("fsdp2_ms", "fsdp2 ms"),
                      ("symm_mem_2_28_ms", f"symm_mem (NCCL {NCCL_MEASURED}) ms"),
                      ("symm_mem_2_31_ms", f"symm_mem (NCCL {NCCL_NEW}) ms"),
                      ("tide_2_28_ms", f"tide (NCCL {NCCL_MEASURED}: copy engine + send/recv) ms"),
                      ("tide_2_31_ms", f"tide (NCCL {NCCL_NEW}: windows + one-sided) ms"),
                      ("tide_2_31_bf16_ms", f"tide (NCCL {NCCL_NEW}, bf16 wire) ms"),
                      ("ceiling_vs_fsdp2", "ceiling vs fsdp2"),
                      ("tide_2_28_vs_fsdp2", f"tide {NCCL_MEASURED} vs fsdp2"),
                      ("tide_2_28_vs_symm_mem", f"tide {NCCL_MEASURED} vs symm_mem {NCCL_MEASURED}"),
                      ("tide_2_31_vs_fsdp2", f"tide {NCCL_NEW} vs fsdp2"),
                      ("tide_2_31_vs_symm_mem", f"tide {NCCL_NEW} vs symm_mem {NCCL_NEW}"),
                      ("tide_2_31_bf16_vs_symm_mem",
                       f"tide {NCCL_NEW} bf16 wire vs symm_mem {NCCL_NEW}")]  # fmt: skip
INTERFERENCE_COLUMNS = [("engine", "engine"), ("compute_class", "compute class"),
                        ("compute_slowdown_pct", "compute slowed beside it %"),
                        ("comm_slowdown_pct", "it slowed beside compute %"),
                        ("kind", "measured or modeled"), ("source", "source")]  # fmt: skip
ASSUMPTION_COLUMNS = [("kind", "what"), ("what", "figure or assumption")]


SOURCE_COLUMNS = [("config", "config"), ("input", "input"), ("source", "source")]


def source_rows(validation: list[dict[str, Any]], cluster: Cluster) -> list[dict[str, str]]:
    """One row per (config and GPU count, input) of the validation rows' sources, each
    measured step, the cluster and the modeled NCCL generation."""
    rows, seen = [], set()
    for r in validation:
        where = f"{r['config']} ({r['gpus']} GPU)"
        for key, text in r["sources"].items():
            if (where, key) not in seen:
                seen.add((where, key))
                rows.append({"config": where, "input": key, "source": text})
        rows.append({"config": where, "input": f"measured step ({r['mode']})",
                     "source": r["measured_source"]})  # fmt: skip
    rows.append(
        {"config": "all", "input": "cluster", "source": f"{cluster.source} ({cluster.name})"}
    )
    rows.append({"config": "all", "input": f"symm_mem on NCCL {NCCL_NEW}",
                 "source": "NCCL release notes 2.29.7 / 2.30.3 / 2.30.7 / 2.31.2 (modeled, "
                           "docs/design/2026-12-02-simulator.md)"})  # fmt: skip
    return rows


def _table(title: str, columns: list, rows: list) -> dict[str, Any]:
    return {"title": title, "columns": columns, "rows": rows}


def write_report(results_dir: Path, out_dir: Path, cluster: Cluster) -> dict[str, str]:
    """Compute everything and write the JSON, Markdown and PNG; returns their paths."""
    common = _common()
    validation = validation_rows(results_dir, cluster)
    baseline = baseline_rows(results_dir, cluster)
    headline = headline_rows(baseline)
    what_if = what_if_rows(results_dir, cluster)
    reference, inputs = reference_rows(results_dir, cluster)
    tokens_nic = tokens_nic_rows(results_dir, cluster)
    sensitivity = sensitivity_rows(results_dir, cluster)
    from torchtitan_tide.fsdp_groups import load_config_model

    models = {m: build_inputs(load_config_model(f"{m}_tide"), results_dir, None, 0.4)
              for m in ("llama70b", "qwen3_30b_a3b", "wan22_a14b")}  # fmt: skip
    assumptions = assumption_rows(models)
    figures = list(models["llama70b"].figures)
    meta = common.metadata(max(GPU_COUNTS), machine="cpu")
    stem = common.result_stem(out_dir, "simulation", meta)
    sim = (
        f"SIMULATION; {cluster.gpus_per_node} GPUs per node, {cluster.nic_gbps_per_gpu:.0f} Gb/s "
        "NIC per GPU, NCCL as each row says"
    )
    ref = f"SIMULATION; {cluster.name}"
    tables = [
        _table("Validation: simulated vs measured steps (2x H200; one H200)",
               VALIDATION_COLUMNS, validation),
        _table("Headline at 64 GPUs (8 x 8, 8192 tokens/GPU): the row `auto` runs on each NCCL "
               f"against stock and SymmMem of the same NCCL, with its ceiling ({sim})",
               HEADLINE_COLUMNS, headline),
        _table(f"What would close the rest at 64 GPUs on NCCL {NCCL_NEW}: WHAT-IFS, not what the "
               "code runs (one input changed each; the row with in place off is, for reference, "
               f"what the code runs with it off; {sim})", WHAT_IF_COLUMNS, what_if),
        _table("64 GPUs: every row the code runs, against stock FSDP2 and the SymmMem of the "
               f"same NCCL, with the step's breakdown ({sim})", BASELINE_COLUMNS, baseline),
        _table("The paper's figures, our assumptions it does not state, the modeled links",
               ASSUMPTION_COLUMNS, assumptions),
        _table("Sensitivity at 64 GPUs: tokens per GPU x NIC Gb/s per GPU, one column per row "
               f"the code runs, with the ceiling ({sim})", TOKENS_NIC_COLUMNS, tokens_nic),
        _table("Interference per engine and compute class (f: compute beside it, g: it beside "
               "compute; what is measured, derived or modeled)", INTERFERENCE_COLUMNS, figures),
        _table(f"Reference configs at 8-64 GPUs ({ref})", REFERENCE_COLUMNS, reference),
        _table(f"Sensitivity at 64 GPUs: node shape, NCCL, TIDE's wire, comm not slowed ({sim})",
               SENSITIVITY_COLUMNS, sensitivity),
    ]  # fmt: skip
    sources = source_rows(validation, cluster)
    tables.append({"title": "Inputs and their sources (the validation rows)",
                   "columns": SOURCE_COLUMNS, "rows": sources})  # fmt: skip
    within = sum(1 for r in validation if r["within_5pct"])
    result = {
        "kind": "simulation",
        "metadata": meta,
        "cluster": asdict(cluster),
        "paper": PAPER,
        "assumptions": list(ASSUMPTIONS),
        "validation": validation,
        "headline_64": headline,
        "what_if_64": what_if,
        "baseline_64": baseline,
        "tokens_nic": tokens_nic,
        "interference": figures,
        "reference": reference,
        "sensitivity": sensitivity,
        "inputs": inputs,
        "sources": sources,
        "tables": [{**t, "columns": [list(c) for c in t["columns"]]} for t in tables],
        "headline": [
            common.headline_row(
                f"simulated step at 64 GPUs, {r['model']}, NCCL {r['nccl']}",
                "speed-up of the row auto runs",
                {
                    "vs_fsdp2": r["vs_fsdp2_speedup"],
                    "ceiling_vs_fsdp2": r["ceiling_vs_fsdp2"],
                    "vs_symm_mem": r["vs_symm_speedup"],
                },
                better="higher",
            )
            for r in headline
        ],
    }
    lacking = sorted({r["config"] for r in validation if "world1_trace" in r["sources"]}
                     | {r["config"] for r in validation if r["sources"]["host"].startswith("not measured")})  # fmt: skip
    kinds = sorted({f["kind"] for f in figures})
    notes = (
        f"A SIMULATION (torchtitan_tide/simulator/, docs/design/2026-12-07-simulator.md), not a "
        f"measurement, except the validation's measured column. {within} of {len(validation)} "
        f"validation rows within {TOLERANCE_PCT:.0f}%; no fitted factor. Every mode is charged "
        "the same way: each part of a collective once (its transport at its own profiled "
        "device time, the cast, FSDP2's copy-in / copy-out / chunk_cat, TIDE-RS's "
        "accumulate), slowed and slowing compute as measured for its engine and the model's "
        f"compute classes ({', '.join(kinds)}: the interference table says which is which; "
        "concurrent engines add up), layout kernels slowed as compute is. TIDE is the op plan "
        "the code runs (comm/plans/window_rounds.py on NCCL windows, comm/plans/plan.py on the copy engine "
        "and send/recv: simulator/plans.py), on the transport `auto` takes on the row's NCCL; "
        "every op charged by its type (puts across nodes on one NIC per GPU shared by every "
        "stream, FIFO per communicator; puts in the node on NVLink; placement and pack as "
        "local HBM copies). In place where the plan runs in place (every layout across nodes; "
        "the local ranks of a node each simulated on their own links). Links (NV18, NIC, NCCL latency and channels) are modeled from named figures "
        "(the assumptions table). The in-step "
        "columns: the same rows with the model's kernels at the level measured in a profiled "
        "one-rank step on one GPU (inputs.in_step_compute; not the rows' verdict). Rows "
        "lacking a GPU input (world-1 trace or trainer breakdown): "
        f"{', '.join(lacking) or 'none'}. "
        "Every input's source: each validation row's `sources` and `measured_source`, the "
        f"JSON's `inputs` (per reference config). symm_mem on NCCL {NCCL_NEW} is modeled from "
        f"release notes. Picture: llama70b_fsdp2 at 64 GPUs on NCCL {NCCL_NEW}, one simulated "
        "step per mode.\n"
    )
    paths = {"markdown": str(stem) + ".md", "json": str(stem) + ".json"}
    common.write_result(stem, result, "Step simulation per comm mode", notes)
    new = replace(cluster, nccl_version=NCCL_NEW)
    if draw_streams(Path(str(stem) + ".png"), "llama70b_fsdp2", 64, new, results_dir):
        paths["png"] = str(stem) + ".png"
    return paths


STREAM_ROWS = (
    "compute",
    "ag_in",
    "nccl",
    "tide",
    "tide_one_sided",
    "tide_fan",
    "tide_place",
    "tide_rs_cross",
    "nccl_p2p",
)
COLORS = {"compute": "#4c72b0", "layout": "#dd8452", "optimizer": "#55a868", "host": "#bbbbbb",
          "nccl": "#c44e52", "nccl_symk": "#8c2d2d", "ce": "#8172b3", "ce_local": "#da8bc3",
          "nic": "#d8c3a5",
          "sm_ag": "#555555", "sm_rs": "#000000"}  # fmt: skip


def exposed_intervals(spans, beside=()) -> list[tuple[float, float]]:
    """Compute-stream idle intervals of one rank's ``spans`` during which communication
    runs (its own, or the other simulated ranks' ``beside``)."""
    idle, comm = idle_and_comm(spans, beside)
    out = []
    for a, b in idle:
        for c, d in comm:
            if min(b, d) > max(a, c):
                out.append((max(a, c), min(b, d)))
    return out


def draw_streams(path: Path, config: str, gpus: int, cluster: Cluster, results_dir: Path) -> bool:
    """Per mode, the streams of one simulated step over time (of the local rank that sets
    the step, where several are simulated); exposed communication hatched red on the
    compute row. False when matplotlib is missing."""
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
        row = next(r for r in sim["rows"] if r["mode"] == mode)
        rank = row["sim_slowest_local_rank"]
        spans = device_spans(sim["spans"][mode], rank)
        beside = other_spans(sim["spans"][mode], rank)
        for y, stream in enumerate(STREAM_ROWS):
            bars = [
                (s.start_ms, s.end_ms - s.start_ms, s.op.kind)
                for s in spans
                if base_name(s.op.stream) == stream
            ]
            for kind in {k for _, _, k in bars}:
                ax.broken_barh([(a, w) for a, w, k in bars if k == kind], (y - 0.4, 0.8),
                               facecolors=COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.2)  # fmt: skip
        exposed = exposed_intervals(spans, beside)
        ax.broken_barh([(a, b - a) for a, b in exposed], (-0.45, 0.9), facecolors="none",
                       edgecolor="red", hatch="////", linewidth=0.8)  # fmt: skip
        ax.set_yticks(range(len(STREAM_ROWS)), STREAM_ROWS)
        ax.invert_yaxis()
        ax.set_title(f"{mode}{f' (local rank {rank})' if rank else ''}: step {row['sim_step_ms']:.0f} ms, exposed {row['sim_exposed_ms']:.1f} ms "
                     f"(first AG {row['sim_exposed_first_ms']:.1f}, between {row['sim_exposed_between_ms']:.1f}, "
                     f"last RS {row['sim_exposed_last_ms']:.1f}), SM-ms taken {row['sim_sm_ms_taken']:.1f}, "
                     f"comm slowed {row['sim_comm_slowed_ms']:.1f} ms", fontsize=9, loc="left")  # fmt: skip
    axes[-1].set_xlabel("ms (simulated)")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    handles.append(Patch(facecolor="none", edgecolor="red", hatch="////", label="exposed comm"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"SIMULATION: {config} at {gpus} GPUs ({cluster.gpus_per_node} per node, "
                 f"{cluster.nic_gbps_per_gpu:.0f} Gb/s per GPU, NCCL {cluster.nccl_version}), "
                 "one step per comm mode",
                 x=0.01, ha="left", fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
