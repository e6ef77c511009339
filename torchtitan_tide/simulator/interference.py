"""Interference in both directions, per engine and compute class, each figure with its
source and whether it was measured or modeled.

Engines (the kinds of communication ops in the step model):

- ``nccl``: NCCL's data-movement kernels on SMs (ring all-gather / reduce-scatter, the
  send/recv kernels of TIDE's ``p2p`` cross-node transport); ``nccl_symk``: NCCL's
  symmetric kernels (symm_mem's reduce-scatter, 9 CTAs);
- ``ce``: the copy engine over NVLink (no SM: TIDE-AG / TIDE-RS node-local moves,
  symm_mem's zero-CTA all-gather, NCCL puts inside a node);
- ``ce_local``: a local HBM-to-HBM copy on the copy engine (TIDE's placement and pack
  copies: ``cudaMemcpyBatchAsync`` asked for the copy engine);
- ``nic``: NCCL one-sided puts across nodes (NCCL's RMA proxy drives the NIC: no SM);
- ``sm_ag``: the all-gather path's SM kernels (the fp32 -> bf16 cast every mode runs,
  FSDP2's copy-in); ``sm_rs``: TIDE-RS's accumulate kernel.

Compute classes: ``single_wave`` GEMM, ``large`` GEMM, ``grouped_experts`` (one grouped
GEMM over every expert, Qwen3's MoE), ``attention`` (flash attention).

A :class:`Figure` holds ``compute`` (f: compute runs at ``1 / (1 + f)`` while an op of
the engine runs beside it) and ``comm`` (g: the op runs at ``1 / (1 + g)`` beside
compute), both from device time where measured. Where the figures come from, first
found wins:

1. NCCL kernels: the 2x H200 bench_interference rows of a collective that is ONE NCCL
   kernel beside the GEMMs: stock FSDP2's and symm_mem's reduce-scatter (chunk_cat runs
   before the GEMM burst). g: the time the collective gained, over that kernel's
   profiled device ms (bench_collectives). The all-gather rows are not used: they hold
   the cast and copy-in kernels too (its -7% / -9% beside large GEMMs: those SM
   kernels waited, the GEMMs did not).
2. The copy engine at 2x H200: compute beside a copy-engine peer copy as measured before
   the first TIDE commit (``docs/design/2026-11-29-h200-facts.md``: +43% single-wave, +9%
   large); its own g from the profiled 2-GPU step (its device time in the step over
   alone: not stretched). The real path (an NVLink copy) beats the one-GPU stand-in, as
   for NCCL's kernels.
3. The one-GPU result (``bench_interference.py --one-gpu``, the newest
   ``*_interference_one_gpu.json`` measured on an H200, :data:`SIMULATED_GPU`): every class
   beside a device-to-device copy (copy engine), a copy kernel on NCCL's CTA counts (24, 9),
   FSDP2's foreach cast and TIDE's accumulate kernel; compute timed at the same burst
   positions alone and beside. The cast and the accumulate are the real kernels: their
   figures beat the derived ones (4). The local copy stands in for the copy engine only in
   the classes 2 lacks (grouped expert GEMM, attention), for its compute figure; the
   copies' own stretch stays the profiled step's (:func:`_ce_stand_in`).
4. The SM kernels of a path (the cast and copy-in, TIDE-RS's accumulate), derived from
   the 2x H200 row of that path: the time the path gained beyond its other parts' own
   stretch is theirs, and so is the compute the GEMMs lost beyond the other parts' share
   (each mode's all-gather path its own g; the compute figure from TIDE-AG's, whose only
   SM kernel is the cast).
5. NIC: modeled: no SM, and the NIC reads HBM at its line rate (50 GB/s at 400 Gb/s,
   about 1% of the measured 3947 GiB/s device copy): 0 both ways.
5b. ``ce_local``: the ``local_batch_ce`` side of the newest one-GPU result that measured it
   (one wave of placement copies in one ``cudaMemcpyBatchAsync`` asked for the copy
   engine), both directions; an H200's first, else another GPU's, the kind naming it (the
   first measurement, 2026-12-07, is an H100's). Without one the most pessimistic figure
   the project has, named so (:data:`PESSIMISTIC`): the one-GPU ``copy_engine`` side (a
   same-device ``copy_``, the driver's choice of engine) with its OWN stretch (+1116%
   beside large GEMMs), not the NVLink copies' profiled +1.8%.
6. A class no result measured takes the ``large`` GEMM's figure (said in its source).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchtitan_tide.simulator.results import newest, read_result

NCCL, NCCL_SYMK, CE, NIC, SM_AG, SM_RS = "nccl", "nccl_symk", "ce", "nic", "sm_ag", "sm_rs"
CE_LOCAL = "ce_local"
ENGINES = (NCCL, NCCL_SYMK, CE, CE_LOCAL, NIC, SM_AG, SM_RS)
SINGLE_WAVE, LARGE, GROUPED, ATTENTION = "single_wave", "large", "grouped_experts", "attention"
CLASSES = (SINGLE_WAVE, LARGE, GROUPED, ATTENTION)
MEASURED_2GPU, MEASURED_1GPU = "measured (2x H200)", "measured (one H200)"
DERIVED, MODELED, NOT_MEASURED = "derived (2x H200)", "modeled", "not measured"
PESSIMISTIC = "most pessimistic figure (not a copy-engine measurement)"

INTERFERENCE_FILE = "2026-11-30_nvidia-h200-x-2_8a9ccda_interference.json"
COLLECTIVES_FILE = "2026-11-30_nvidia-h200-x-2_8a9ccda_collectives.json"
ONE_GPU_KIND = "interference_one_gpu"
SIMULATED_GPU = "H200"  # the GPU of the 2x H200 inputs and of the simulated cluster
# bench_interference --one-gpu: the side op standing for each engine
ONE_GPU_SIDE = {
    CE: "copy_engine", NCCL: "nccl_like_24", NCCL_SYMK: "nccl_like_9",
    SM_AG: "cast_foreach", SM_RS: "accumulate", CE_LOCAL: "local_batch_ce",
}  # fmt: skip
_CAP = 0.99  # the largest share of compute an op may take while it runs


@dataclass(frozen=True)
class Figure:
    """``compute`` (f) and ``comm`` (g) slowdown fractions; ``kind``: measured / derived
    / modeled / not measured; ``source``: the file, rows and arithmetic."""

    compute: float
    comm: float
    kind: str
    source: str


def _frac(pct: float | None) -> tuple[float, str]:
    """A measured percentage as a fraction; a negative reading is 0, and said."""
    value = (pct or 0.0) / 100
    if value < 0:
        return 0.0, f" (reading {100 * value:+.1f}%: below 0, counted 0)"
    return value, ""


def _profile(coll: Mapping[str, Any], layer: str, mode: str, op: str) -> dict[str, Any]:
    return coll["variants"][layer][mode]["rounds"][0]["profile"][op]


def _kernel_ms(profile: Mapping[str, Any], part: str) -> float:
    """Profiled device ms of the kernels whose name holds ``part``."""
    return sum(k["ms"] for k in profile.get("kernels") or [] if part in k["name"])


def two_gpu_rows(results_dir: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(class, mode, op) -> the committed 2x H200 bench_interference row."""
    data = read_result(results_dir, INTERFERENCE_FILE)
    return {
        (str(r["gemm"]).split(" ")[0], r["mode"], r["op"]): r
        for r in data["tables"][0]["rows"]
        if not r.get("error") and r.get("coll_beside_ms") and r.get("slowdown_pct") is not None
    }


def _nccl_figure(row: Mapping[str, Any], kernel_ms: float, what: str) -> Figure:
    f, note = _frac(row["slowdown_pct"])
    gained = row["coll_beside_ms"] - row["coll_alone_ms"]
    g = max(0.0, gained / kernel_ms)
    return Figure(f, g, MEASURED_2GPU, (
        f"{INTERFERENCE_FILE}: GEMM {row['gemm']} beside {what} {100 * f:+.1f}%{note}; the "
        f"collective gained {gained:.2f} ms over {kernel_ms:.2f} kernel ms "
        f"({COLLECTIVES_FILE} profile) = {100 * g:+.0f}%"
    ))  # fmt: skip


# GEMM slowdown beside a copy-engine copy (a peer copy over NVLink, 2x H200), measured
# before the first TIDE commit: docs/design/2026-11-29-h200-facts.md.
CE_FACTS = {SINGLE_WAVE: 0.43, LARGE: 0.09}
CE_FACTS_SOURCE = (
    "docs/design/2026-11-29-h200-facts.md (2x H200): GEMM 1024x4096x8192 0.18 -> 0.26 ms (+43%), "
    "8192^3 1.40 -> 1.53 ms (+9%) beside a copy-engine peer copy"
)


def _path(
    row: Mapping[str, Any], known: Sequence[tuple[float, float, float]], sm_ms: float, what: str
) -> tuple[float, float, str]:
    """Split a 2x H200 path's reading beside GEMMs: ``known`` parts (device ms, f, g) keep
    their own figures; the time the path gained beyond them is its SM kernels' (of
    ``sm_ms`` alone), and so is the compute the GEMMs lost beyond what the known parts
    take over their spans. Returns (f, g, text) of the SM kernels."""
    f_path, note = _frac(row["slowdown_pct"])
    gained = row["coll_beside_ms"] - row["coll_alone_ms"]
    rest = gained - sum(ms * g for ms, _, g in known)
    g_sm = max(0.0, rest / sm_ms)
    span_sm = sm_ms * (1 + g_sm)
    spans = [(ms * (1 + g), f) for ms, f, g in known]
    window = span_sm + sum(span for span, _ in spans)
    lost = window * f_path / (1 + f_path) - sum(span * f / (1 + f) for span, f in spans)
    share = min(_CAP, max(0.0, lost) / span_sm)
    text = (
        f"{INTERFERENCE_FILE}: GEMM {row['gemm']} beside {what} {100 * f_path:+.1f}%{note}; "
        f"the path gained {gained:.2f} ms, {rest:.2f} of it its SM kernels' ({sm_ms:.2f} ms "
        f"alone, {COLLECTIVES_FILE} profile), which take {100 * share:.0f}% of compute "
        "beyond the copy engine's share"
    )
    return share / (1 - share), g_sm, text


@functools.lru_cache(maxsize=16)
def _two_gpu_figures(results_dir: Path, g_ce: float) -> dict[tuple[str, str], Figure]:
    """Figures of the 2x H200 rows (module docstring, 1 and 3)."""
    rows = two_gpu_rows(results_dir)
    coll = read_result(results_dir, COLLECTIVES_FILE)
    layer = read_result(results_dir, INTERFERENCE_FILE)["config"]["layer"]
    prof = {(m, op): _profile(coll, layer, m, op)
            for m in ("fsdp2", "symm_mem", "tide") for op in ("ag", "rs")}  # fmt: skip
    symk = prof[("symm_mem", "rs")]["nccl_kernel_ms"] + _kernel_ms(prof[("symm_mem", "rs")],
                                                                   "MulFunctor")  # fmt: skip
    out: dict[tuple[str, str], Figure] = {}
    for cls in {c for c, _, _ in rows}:
        f_ce = CE_FACTS.get(cls)
        if f_ce is not None:
            out[(CE, cls)] = Figure(f_ce, g_ce, MEASURED_2GPU, (
                f"{CE_FACTS_SOURCE}; its own stretch from the profiled 2-GPU step"))  # fmt: skip
        if (row := rows.get((cls, "fsdp2", "rs"))) is not None:
            ring = prof[("fsdp2", "rs")]["nccl_kernel_ms"]
            out[(NCCL, cls)] = _nccl_figure(row, ring, "NCCL's ring RS")
        if (row := rows.get((cls, "symm_mem", "rs"))) is not None:
            out[(NCCL_SYMK, cls)] = _nccl_figure(row, symk, "NCCL's symmetric RS")
        ce = [(prof[("tide", op)]["memcpy_ms"], f_ce or 0.0, g_ce) for op in ("ag", "rs")]
        if (row := rows.get((cls, "tide", "ag"))) is not None:
            f, g, text = _path(row, ce[:1], prof[("tide", "ag")]["kernel_ms"],
                               "TIDE-AG (cast + copy engine)")  # fmt: skip
            out[(SM_AG, cls)] = Figure(f, g, DERIVED, text)
            for mode in ("fsdp2", "symm_mem"):
                path, p = rows.get((cls, mode, "ag")), prof[(mode, "ag")]
                if path is None or (NCCL, cls) not in out:
                    continue
                known = [(p["memcpy_ms"], f_ce or 0.0, g_ce)] if p["memcpy_ms"] > 0.1 else []
                if p["nccl_kernel_ms"]:
                    known.append((p["nccl_kernel_ms"], *_fg(out[(NCCL, cls)])))
                sm_ms = p["kernel_ms"] - p["nccl_kernel_ms"] - _kernel_ms(p, "split_with")
                _, g_mode, text = _path(path, known, sm_ms, f"{mode}'s all-gather")
                text += "; compute figure TIDE-AG's cast (the same foreach kernel)"
                out[(f"{SM_AG}:{mode}", cls)] = Figure(f, g_mode, DERIVED, text)
        if (row := rows.get((cls, "tide", "rs"))) is not None:
            f, g, text = _path(row, ce[1:], prof[("tide", "rs")]["kernel_ms"],
                               "TIDE-RS (copy engine + accumulate)")  # fmt: skip
            out[(SM_RS, cls)] = Figure(f, g, DERIVED, text)
    return out


def _fg(fig: Figure) -> tuple[float, float]:
    return fig.compute, fig.comm


def gpu_of(path: Path) -> str:
    """The GPU a result was measured on, from its metadata's machine ("NVIDIA H100 80GB
    HBM3 x 1" -> "H100")."""
    machine = json.loads(path.read_text()).get("metadata", {}).get("machine") or ""
    words = machine.replace("NVIDIA ", "").split()
    return words[0] if words else "unknown GPU"


def _newest_simulated_first(found: list[Path]) -> Path | None:
    """The newest of ``found`` measured on :data:`SIMULATED_GPU` (the GPU of every other
    input), else the newest of any GPU."""
    return newest([p for p in found if gpu_of(p) == SIMULATED_GPU]) or newest(found)


def one_gpu_file(results_dir: Path) -> Path | None:
    """The newest committed one-GPU interference result (``--one-gpu``), the simulated
    GPU's first (:func:`_newest_simulated_first`)."""
    return _newest_simulated_first(sorted(Path(results_dir).glob(f"*_{ONE_GPU_KIND}.json")))


def _local_batch_rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(path.read_text())["tables"][0]["rows"]
    return [r for r in rows if r.get("side") == ONE_GPU_SIDE[CE_LOCAL] and not r.get("error")
            and r.get("side_gib_s_alone")]  # fmt: skip


def local_copy_file(results_dir: Path) -> Path | None:
    """The newest one-GPU result that measured ``local_batch_ce`` (the copy engine's local
    copy), :data:`SIMULATED_GPU`'s first, else another GPU's (its figures then say which
    GPU: a Hopper copy engine on both, HBM differs)."""
    found = [p for p in sorted(Path(results_dir).glob(f"*_{ONE_GPU_KIND}.json"))
             if _local_batch_rows(p)]  # fmt: skip
    return _newest_simulated_first(found)


def _measured_on(path: Path) -> str:
    gpu = gpu_of(path)
    return MEASURED_1GPU if gpu == SIMULATED_GPU else f"measured (one {gpu})"


def one_gpu_figures(results_dir: Path) -> dict[tuple[str, str], Figure]:
    """(engine, class) -> the one-GPU measurement (empty when none is committed): every
    engine from :func:`one_gpu_file`, the local copy (``ce_local``) from
    :func:`local_copy_file`."""
    out = {}
    for path, engines in ((one_gpu_file(results_dir), set(ONE_GPU_SIDE) - {CE_LOCAL}),
                          (local_copy_file(results_dir), {CE_LOCAL})):  # fmt: skip
        if path is None:
            continue
        for row in json.loads(path.read_text())["tables"][0]["rows"]:
            engine = next((e for e in engines if ONE_GPU_SIDE[e] == row.get("side")), None)
            if engine is None or row.get("error") or row.get("slowdown_pct") is None:
                continue
            f, note = _frac(row["slowdown_pct"])
            g, gnote = _frac(row.get("side_slowdown_pct"))
            out[(engine, row["compute"])] = Figure(f, g, _measured_on(path), (
                f"{path.name}: {row['compute']} beside {row['side']} {100 * f:+.1f}%{note} "
                f"(same burst positions alone), {row['side']} device time "
                f"{100 * g:+.1f}%{gnote}"
            ))  # fmt: skip
    return out


def _ce_stand_in(fig: Figure | None, g_ce: float, ce_source: str) -> Figure | None:
    """The one-GPU copy-engine figure of a class the 2x H200 peer copy did not measure:
    its compute figure (a local device-to-device copy reads and writes this GPU's HBM: an
    upper bound on the HBM contention of an NVLink transfer, which writes or reads it
    once), with the copies' own stretch of the profiled 2-GPU step (``g_ce``), not the
    local copy's: that copy is HBM-bound beside compute (+1116% beside large GEMMs on
    ad3cde0), the NVLink copies TIDE runs are link-bound (docs/design/2026-12-04-simulator.md)."""
    if fig is None:
        return None
    return replace(fig, comm=g_ce, source=(
        f"{fig.source}; compute figure used (upper bound: local HBM read + write), the "
        f"side's own stretch not used: the copies' stretch in the profiled 2-GPU step, "
        f"{100 * g_ce:+.1f}% ({ce_source or 'not measured: 0'})"))  # fmt: skip


def _pessimistic_local(fig: Figure | None) -> Figure | None:
    """Local copies until ``local_batch_ce`` is measured: the one-GPU same-device ``copy_``
    with both its figures, its own stretch included (:data:`PESSIMISTIC`)."""
    if fig is None:
        return None
    return replace(fig, kind=PESSIMISTIC, source=(
        f"{fig.source}; both figures used: the most pessimistic the project has for a local "
        "copy until bench_interference --one-gpu measures local_batch_ce (a copy forced onto "
        "the copy engine)"))  # fmt: skip


def _unmeasured_local(fig: Figure | None) -> Figure | None:
    """Local copies with no one-GPU result at all: the NVLink copy's figures, said."""
    if fig is None:
        return None
    return replace(fig, kind=NOT_MEASURED, source=(
        f"no one-GPU result: the copy engine's NVLink figures ({fig.source})"))  # fmt: skip


SM_AG_PATHS = {"fsdp2": f"{SM_AG}:fsdp2", "symm_mem": f"{SM_AG}:symm_mem", "tide": SM_AG}
TABLE_ENGINES = (*ENGINES, SM_AG_PATHS["fsdp2"], SM_AG_PATHS["symm_mem"])


def figure_table(
    results_dir: Path, g_ce: float = 0.0, ce_source: str = ""
) -> dict[tuple[str, str], Figure]:
    """(engine, class) -> :class:`Figure` for every engine (and the all-gather SM kernels
    of each mode's path, ``sm_ag:<mode>``) and class, in the module docstring's order.
    ``g_ce``: the copy engine's stretch in the profiled 2-GPU step (:func:`ce_in_step`)
    for the derived figures, ``ce_source`` its source."""
    two = _two_gpu_figures(Path(results_dir), round(g_ce, 6))
    one = one_gpu_figures(Path(results_dir))
    table: dict[tuple[str, str], Figure | None] = {}
    for engine in TABLE_ENGINES:
        for cls in CLASSES:
            key, base = (engine, cls), engine.split(":")[0]
            if engine == NIC:
                table[key] = Figure(0.0, 0.0, MODELED, (
                    "one-sided puts across nodes hold no SM; the NIC reads HBM at its line "
                    "rate (about 1% of the device copy rate): 0 both ways"))  # fmt: skip
            elif engine in (NCCL, NCCL_SYMK):
                table[key] = two.get(key) or one.get(key)
            elif engine == CE:
                table[key] = two.get(key) or _ce_stand_in(one.get(key), g_ce, ce_source)
            elif engine == CE_LOCAL:
                table[key] = (
                    one.get(key)
                    or _pessimistic_local(one.get((CE, cls)))
                    or (_unmeasured_local(table.get((CE, cls))))
                )
            else:
                table[key] = one.get((base, cls)) or two.get(key)
            fig = table[key]
            if engine == CE and fig is not None and fig.kind == MEASURED_2GPU and ce_source:
                table[key] = replace(fig, source=f"{fig.source} ({ce_source})")
    for (engine, cls), fig in list(table.items()):
        if fig is not None:
            continue
        large = table.get((engine, LARGE))
        if large is None:
            table[(engine, cls)] = Figure(0.0, 0.0, NOT_MEASURED, f"{cls}: no measurement, 0")
            continue
        why = f"{cls} not measured beside {engine}: the large GEMM's figure ({large.source})"
        table[(engine, cls)] = replace(large, kind=NOT_MEASURED, source=why)
    return table  # type: ignore[return-value]


def ce_in_step(results_dir: Path, step_files: Mapping[str, str], groups: Sequence[Any],
               layer: str, layer_numel: int) -> tuple[float, str]:  # fmt: skip
    """The copy engine's stretch in the profiled 2-GPU step of a config: TIDE's copy-engine
    device ms in the step over the same copies alone (bench_collectives' memcpy ms per
    element of ``layer``, times the step's gathered and reduced elements), after taking
    out the step's copies that are not communication (stock FSDP2's step memcpy ms over
    its own alone figure). (0, why) when not measured."""
    coll = read_result(results_dir, COLLECTIVES_FILE)
    tide_file, fsdp2_file = step_files.get("tide"), step_files.get("fsdp2")
    if not tide_file or not fsdp2_file:
        return 0.0, "no profiled 2-GPU step: copy engine not stretched (0)"
    numel = sum(g.numel for g in groups)
    gathered = sum(g.numel * (2 if g.reshard_after_forward else 1) for g in groups)

    def alone(mode: str) -> float:
        ag, rs = _profile(coll, layer, mode, "ag"), _profile(coll, layer, mode, "rs")
        return (ag["memcpy_ms"] * gathered + rs["memcpy_ms"] * numel) / layer_numel

    def in_step(name: str, mode: str) -> float:
        runs = read_result(results_dir, name).get("runs", {}).get(mode) or [{}]
        return float(runs[0].get("layout", {}).get("memcpy_ms") or 0.0)

    other = max(0.0, in_step(fsdp2_file, "fsdp2") - alone("fsdp2"))
    tide_alone = alone("tide")
    tide_step = in_step(tide_file, "tide") - other
    if tide_alone <= 0 or tide_step <= 0:
        return 0.0, f"{tide_file}: no copy-engine time in the profile (0)"
    g = max(0.0, tide_step / tide_alone - 1)
    return g, (
        f"{tide_file}: TIDE's copy-engine device time {tide_step:.1f} ms in the step (after "
        f"{other:.1f} ms of non-communication copies) vs {tide_alone:.1f} ms alone "
        f"({COLLECTIVES_FILE}) = {100 * g:+.1f}%"
    )


def local_copy_rate(results_dir: Path, fallback: tuple[float, str]) -> tuple[float, str, str]:
    """(GiB/s copied, kind, source) of a local HBM-to-HBM copy on the copy engine:
    :func:`local_copy_file`'s ``local_batch_ce`` rate alone (median over its rows; the kind
    names the GPU), else the most pessimistic rate the project has: the lower of
    ``fallback`` (a device copy's rate, ``inputs.copy_rate``) and the one-GPU
    ``copy_engine`` side's rate alone."""
    local = local_copy_file(results_dir)
    if local is not None:
        measured = sorted(r["side_gib_s_alone"] for r in _local_batch_rows(local))
        rate = measured[len(measured) // 2]
        return rate, _measured_on(local), f"{local.name}: local_batch_ce alone, {rate:.0f} GiB/s"
    path = one_gpu_file(results_dir)
    found = [fallback]
    if path is not None:
        data = json.loads(path.read_text())
        unit = (data["config"].get("side_bytes") or {}).get("copy_engine", 256 * 2**20)
        units = data["config"]["units"].get("copy_engine", 0)
        alone = sorted(r["side_alone_ms"] for r in data["tables"][0]["rows"]
                       if r.get("side") == "copy_engine" and r.get("side_alone_ms"))  # fmt: skip
        if alone and units:
            ms = alone[len(alone) // 2]
            rate = units * unit / 2**30 / (ms / 1e3)
            text = (f"{path.name}: copy_engine side alone, {units} x {unit / 2**20:.0f} MiB in "
                    f"{ms:.2f} ms = {rate:.0f} GiB/s")  # fmt: skip
            found.append((rate, text))
    rate, text = min(found)
    return rate, PESSIMISTIC, f"{text} (the lowest of: {'; '.join(t for _, t in found)})"


ATTENTION_NAMES = ("sdpa", "flash", "fmha", "attention")
GROUPED_NAMES = ("GroupProblemShape", "grouped")


def kernel_class(name: str, dense_class: str) -> str:
    """A profiled kernel's compute class by its name: attention, grouped GEMM, else the
    model's dense GEMM class (elementwise kernels included: said in the weights' source)."""
    low = name.lower()
    if any(part in low for part in ATTENTION_NAMES):
        return ATTENTION
    if any(part.lower() in low for part in GROUPED_NAMES):
        return GROUPED
    return dense_class


def class_weights(
    trace: Mapping[str, Any] | None, dense_class: str, flops_attention_share: float
) -> tuple[dict[str, float], str]:
    """The share of the model's compute time in each class: from the profiled trace's
    kernels (``bench_trace --kernels``), else attention by FLOPs (modeled)."""
    kernels = ((trace or {}).get("profiled_iteration") or {}).get("kernels") or []
    if kernels:
        total = sum(k["ms"] for k in kernels)
        weights: dict[str, float] = {}
        for k in kernels:
            cls = kernel_class(k["name"], dense_class)
            weights[cls] = weights.get(cls, 0.0) + k["ms"] / total
        text = ", ".join(f"{c} {100 * w:.1f}%" for c, w in sorted(weights.items()))
        return weights, (
            f"profiled trace's top kernels by name ({text}; elementwise and other kernels "
            f"counted as {dense_class})"
        )
    a = min(1.0, max(0.0, flops_attention_share))
    return {ATTENTION: a, dense_class: 1 - a}, (
        f"modeled: attention {100 * a:.1f}% of the FLOPs, the rest {dense_class} (no "
        "profiled trace)"
    )


def mix(
    table: Mapping[tuple[str, str], Figure], weights: Mapping[str, float]
) -> dict[str, tuple[float, float]]:
    """Per engine of :data:`TABLE_ENGINES`, (f, g) averaged over the compute classes by
    time share."""
    total = sum(weights.values()) or 1.0
    out = {}
    for engine in TABLE_ENGINES:
        f = sum(w * table[(engine, c)].compute for c, w in weights.items()) / total
        g = sum(w * table[(engine, c)].comm for c, w in weights.items()) / total
        out[engine] = (f, g)
    return out


def table_rows(table: Mapping[tuple[str, str], Figure]) -> list[dict[str, Any]]:
    """The table as report rows (engine, class, f %, g %, kind, source)."""
    return [
        {"engine": e, "compute_class": c, "compute_slowdown_pct": 100 * fig.compute,
         "comm_slowdown_pct": 100 * fig.comm, "kind": fig.kind, "source": fig.source}
        for (e, c), fig in sorted(table.items(), key=lambda kv: (
            TABLE_ENGINES.index(kv[0][0]), CLASSES.index(kv[0][1])))
    ]  # fmt: skip
