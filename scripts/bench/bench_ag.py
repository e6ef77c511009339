"""All-gather benchmark: stock FSDP2 (AG + copy-out) vs TIDE-AG (issue 3, "Measure").

    python scripts/bench/bench_ag.py --out-dir bench/results [--world 2] [--iters 20]
    python scripts/bench/bench_ag.py --out-dir /tmp/smoke --smoke-cpu   # CPU gloo, tiny shapes

Spawns one process per GPU (NCCL). Three parts, all on every rank:

1. ``copy_engine``: rank 0 pulls 256 MiB from rank 1's symmetric memory as
   (a) one ``copy_``, (b) 576 ``copy_`` calls, (c) ONE ``cudaMemcpyBatchAsync``
   of 576 copies (``copy_engine.batch_copy``); destination poisoned before every
   timed run, exactness checked once per mode.
2. ``layer``: one Llama-3.1-70B layer (dim 8192, FFN 28672, 64 heads, 8 KV
   heads, two RMSNorm weights; fp32 master params, bf16 param dtype) as one
   FSDP group.
3. ``model4``: four such layers, each its own FSDP group; one step unshards
   all four in sequence.

For 2 and 3, variants ``stock``, ``tide_auto`` (``comm.apply(model, "tide")``:
copy engine on one host) and ``tide_nccl_p2p_2x1`` (transport nccl_p2p,
local_world_size 1) run in two interleaved rounds. Per variant and round:
median over ``--iters`` of ``unshard(); wait`` timed with CUDA events on an
idle GPU (``median_ms``; includes host launch time) and with a sleep kernel
queued first (``queued_median_ms``; host launch hidden), host time of the
call. Round 1 also takes a torch-profiler breakdown of device time (NCCL
kernels, other kernels by name, memcpy rows) and checks the TIDE unsharded
parameters bitwise against stock's (storage NaN-poisoned first).

One failing variant is reported as an ``error`` string; the model is rebuilt
for the next one. Results (rank 0): ``<stem>.json`` (written after every
variant, so a crash keeps what was measured), ``<stem>.md``, ``<stem>.png``
with ``<stem> = <out-dir>/<date>_<machine>_<commit>_ag``; the Markdown is
printed last.
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on these machines (docs/design/2026-11-29-h200-facts.md); set
# before anything touches CUDA, inherited by the spawned workers.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
for _p in (str(_HERE), str(_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common
import harness

VARIANTS: tuple[tuple[str, dict | None], ...] = (
    ("stock", None),
    ("tide_auto", {}),
    ("tide_nccl_p2p_2x1", {"transport": "nccl_p2p", "local_world_size": 1}),
)
SCENARIOS: tuple[tuple[str, int, str], ...] = (("layer", 1, "1 layer"), ("model4", 4, "4 layers"))
WARMUP = 3
PROFILE_STEPS = 3
CE_BYTES = 256 * 2**20
CE_COPIES = 576
COPY_OUT_KERNELS = ("split_with_sizes", "chunk_cat")

TABLE_COLUMNS = [
    ("variant", "variant"),
    ("round1_ms", "round-1 median ms"),
    ("round2_ms", "round-2 median ms"),
    ("best_ms", "best ms"),
    ("bus_GiBps", "GiB/s (bus)"),
    ("ratio_vs_stock", "stock/variant"),
    ("nccl_kernel_ms", "NCCL kernel ms"),
    ("other_kernel_ms", "other kernel ms"),
    ("memcpy_ms", "memcpy ms"),
    ("queued_best_ms", "queued ms"),
    ("host_ms", "host ms"),
    ("exact_vs_stock", "exact vs stock"),
    ("error", "error"),
]
CE_COLUMNS = [
    ("mode", "256 MiB pull, rank 0 <- rank 1"),
    ("median_ms", "median ms"),
    ("GiBps", "GiB/s"),
    ("vs_one_copy", "vs one copy_"),
    ("exact", "exact"),
    ("error", "error"),
]


@dataclass(frozen=True)
class LayerShape:
    dim: int = 8192
    ffn: int = 28672
    heads: int = 64
    kv_heads: int = 8


LLAMA_70B = LayerShape()
SMOKE_SHAPE = LayerShape(dim=64, ffn=224, heads=8, kv_heads=2)


@dataclass(frozen=True)
class BenchConfig:
    iters: int
    shape: LayerShape
    device_type: str  # "cuda" (NCCL) or "cpu" (gloo smoke test)
    stem: str  # result path without suffix
    meta: dict = field(default_factory=dict)


class Layer(nn.Module):
    """Parameters of one Llama transformer layer (no forward: only unshard is
    timed). Random data everywhere: Linear's default init, norms 1 + 0.1 N(0,1)."""

    def __init__(self, s: LayerShape) -> None:
        super().__init__()
        head_dim = s.dim // s.heads
        self.attention_norm = nn.Parameter(1 + 0.1 * torch.randn(s.dim))
        self.wq = nn.Linear(s.dim, s.heads * head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(s.heads * head_dim, s.dim, bias=False)
        self.ffn_norm = nn.Parameter(1 + 0.1 * torch.randn(s.dim))
        self.w1 = nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn, bias=False)


def layer_numel(s: LayerShape) -> int:
    """Parameter count of one :class:`Layer`."""
    head_dim = s.dim // s.heads
    kv = s.kv_heads * head_dim
    q = s.heads * head_dim
    return 2 * s.dim + 2 * s.dim * q + 2 * s.dim * kv + 3 * s.dim * s.ffn


# ---------------------------------------------------------------- pure helpers


bus_gibps = common.bus_gibps
classify_device_event = common.classify_device_event


def breakdown(events: Sequence[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per-step device time from ``(name, us)`` device rows of ``steps`` steps:
    ``{kind}_ms`` for every kind of :func:`classify_device_event`, per-name ms
    (``by_name``: kind -> name -> ms), and ``copy_out_kernels`` (names of
    FSDP copy-in/copy-out kernels seen: split_with_sizes_copy, chunk_cat)."""
    kinds = {k: 0.0 for k in ("nccl_kernel", "other_kernel", "memcpy", "memset")}
    by_name: dict[str, dict[str, float]] = {k: {} for k in kinds}
    for name, us in events:
        kind = classify_device_event(name)
        ms = us / 1e3 / steps
        kinds[kind] += ms
        by_name[kind][name] = by_name[kind].get(name, 0.0) + ms
    out: dict[str, Any] = {f"{k}_ms": v for k, v in kinds.items()}
    out["by_name"] = {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in by_name.items()}
    out["copy_out_kernels"] = sorted(
        n for n in by_name["other_kernel"] if any(c in n for c in COPY_OUT_KERNELS)
    )
    return out


def summarize_variant(
    rounds: Sequence[dict], nbytes: int, world: int, stock_best_ms: float | None
) -> dict[str, Any]:
    """One table row's numbers from a variant's per-round results. A round is
    ``{"error": str}`` or has ``median_ms``, ``queued_median_ms``,
    ``host_median_ms`` and optionally ``profile`` (a :func:`breakdown`) and
    ``exact_vs_stock``. ``best_ms`` is the smaller round median."""
    meds = [r.get("median_ms") for r in rounds]
    best = common.min_or_none(meds)
    prof = next((r["profile"] for r in rounds if r.get("profile")), {})
    errors = [
        f"r{i + 1}: {common.short_error(r['error'])}"
        for i, r in enumerate(rounds)
        if r.get("error")
    ]
    exact = next((r["exact_vs_stock"] for r in rounds if r.get("exact_vs_stock") is not None), None)
    return {
        "round1_ms": meds[0] if len(meds) > 0 else None,
        "round2_ms": meds[1] if len(meds) > 1 else None,
        "best_ms": best,
        "bus_GiBps": bus_gibps(nbytes, world, best),
        "ratio_vs_stock": (stock_best_ms / best) if (stock_best_ms and best) else None,
        "nccl_kernel_ms": prof.get("nccl_kernel_ms"),
        "other_kernel_ms": prof.get("other_kernel_ms"),
        "memcpy_ms": prof.get("memcpy_ms"),
        "queued_best_ms": common.min_or_none([r.get("queued_median_ms") for r in rounds]),
        "host_ms": common.min_or_none([r.get("host_median_ms") for r in rounds]),
        "exact_vs_stock": exact,
        "copy_out_kernels": prof.get("copy_out_kernels"),
        "error": "; ".join(errors) or None,
    }


def table_rows(results: dict) -> list[dict[str, Any]]:
    """Rows of the all-gather table (one per scenario x variant measured so far)."""
    rows = []
    world = results["metadata"]["world_size"]
    for key, _, label in SCENARIOS:
        scn = results.get(key)
        if not scn:
            continue
        variants = scn.get("variants", {})
        stock = variants.get("stock", {}).get("rounds", [])
        stock_best = common.min_or_none([r.get("median_ms") for r in stock])
        for vname, _ in VARIANTS:
            rounds = variants.get(vname, {}).get("rounds", [])
            if not rounds:
                continue
            row = summarize_variant(rounds, scn["unsharded_bf16_bytes"], world, stock_best)
            row["variant"] = f"{label} {vname}"
            rows.append(row)
    return rows


def ce_rows(ce: dict | None) -> list[dict[str, Any]]:
    """Rows of the copy-engine table from the ``copy_engine`` result."""
    if not ce or not ce.get("modes"):
        return []
    one = ce["modes"].get("one_copy", {}).get("GiBps")
    rows = []
    for mode, label in (
        ("one_copy", "(a) one copy_"),
        ("loop", f"(b) {ce.get('copies')} copy_ calls"),
        ("batch", f"(c) one batch of {ce.get('copies')} (cudaMemcpyBatchAsync)"),
    ):
        m = ce["modes"].get(mode, {})
        g = m.get("GiBps")
        rows.append(
            {
                "mode": label,
                "median_ms": m.get("median_ms"),
                "GiBps": g,
                "vs_one_copy": (g / one) if (g and one) else None,
                "exact": m.get("exact"),
                "error": common.short_error(m.get("error")),
            }
        )
    return rows


def markdown_report(results: dict) -> tuple[str, list[dict], list[dict]]:
    """(extra Markdown below the main table, AG rows, copy-engine rows)."""
    rows = table_rows(results)
    crows = ce_rows(results.get("copy_engine"))
    meta = results["metadata"]
    lines = [
        (
            f"{meta['machine']} ({meta['hostname']}), torch {meta['torch']}, "
            f"NCCL {meta['nccl']}, CUDA {meta['cuda']}, commit {meta['commit']}, "
            f"world {meta['world_size']}, {meta['date']}, iters {results['config']['iters']}, "
            f"status {results['status']}."
        ),
        "",
        (
            "Times: `unshard(); wait` of every FSDP group (1 layer: one group; 4 layers: four "
            "in sequence), median of the iterations per round on an idle GPU (host launch "
            "included); best = min of the two rounds. queued ms: same with a ~10 ms sleep "
            "kernel queued first (host launch hidden unless host ms exceeds it). GiB/s = bf16 "
            "bytes x (world-1)/world / best. Kernel and memcpy ms: torch profiler device time "
            "per step, round 1. exact vs stock: TIDE unsharded params (NaN-poisoned first) "
            "bitwise equal to stock's."
        ),
        "",
    ]
    ce = results.get("copy_engine")
    if crows:
        lines += [
            "## Copy-engine microbenchmark",
            "",
            common.format_markdown_table(crows, CE_COLUMNS),
        ]
        if ce.get("batch_vs_one_copy") is not None:
            lines.append(
                f"(c)/(a) = {ce['batch_vs_one_copy']:.3f} (target >= 0.90: "
                f"{'met' if ce['batch_vs_one_copy'] >= 0.9 else 'NOT met'}); "
                f"{ce['copies']} copies of {ce['chunk_bytes']} B = {ce['bytes']} B.\n"
            )
    if ce and ce.get("error"):
        lines += [f"Copy-engine microbenchmark error: {ce['error']}", ""]
    lines += ["## Device rows per variant (round-1 profile, ms per step)", ""]
    for key, _, label in SCENARIOS:
        for vname, _ in VARIANTS:
            rounds = results.get(key, {}).get("variants", {}).get(vname, {}).get("rounds", [])
            r0 = rounds[0] if rounds else {}
            prof = r0.get("profile")
            if not prof:
                continue
            parts = []
            for kind in ("nccl_kernel", "other_kernel", "memcpy", "memset"):
                names = prof["by_name"].get(kind, {})
                if names:
                    parts.append(
                        f"{kind}: " + ", ".join(f"`{n[:70]}` {ms:.3f}" for n, ms in names.items())
                    )
            extra = ""
            if r0.get("transports"):
                extra += f" transports: {r0['transports']}."
            if r0.get("batch_fallback"):
                extra += f" batch-copy FALLBACK: {r0['batch_fallback']}."
            cok = prof.get("copy_out_kernels")
            lines.append(
                f"- {label} {vname}: copy-out kernels: {cok or 'none'}.{extra} " + "; ".join(parts)
            )
    return "\n".join(lines) + "\n", rows, crows


def write_outputs(results: dict, final: bool) -> Path:
    """Rank 0: write ``<stem>.json`` and ``<stem>.md`` (and ``.png`` when
    ``final``). Returns the Markdown path."""
    stem = results["config"]["stem"]
    common.write_json(stem + ".json", results)
    extra, rows, crows = markdown_report(results)
    md = Path(stem + ".md")
    common.write_markdown_table(
        md, rows, TABLE_COLUMNS, title="TIDE-AG vs stock FSDP2 all-gather", extra=extra
    )
    if final:
        charts = []
        for key, _, label in SCENARIOS:
            sub = [r for r in rows if r["variant"].startswith(label + " ")]
            if sub:
                charts.append(
                    common.BarChart(
                        f"{label}: unshard+wait, best median",
                        [r["variant"][len(label) + 1 :] for r in sub],
                        [r["best_ms"] for r in sub],
                        "ms",
                    )
                )
        if crows:
            charts.append(
                common.BarChart(
                    "256 MiB peer pull",
                    ["one copy_", "576 copy_", "batch 576"],
                    [r["GiBps"] for r in crows],
                    "GiB/s",
                )
            )
        if charts:
            m = results["metadata"]
            common.write_bar_png(
                stem + ".png", charts, f"{m['machine']}, {m['commit']}, {m['date']}"
            )
    return md


# ---------------------------------------------------------------- measurement


def device_rows(prof) -> list[tuple[str, float]]:
    """``(name, us)`` of every device-side row (kernel, memcpy, memset) of a
    torch profile; GPU user annotations (record_function ranges) skipped."""
    rows = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(evt, "is_user_annotation", False) or evt.name.startswith("FSDP::"):
            continue  # record_function ranges projected on the GPU timeline: not work
        try:
            us = float(evt.time_range.elapsed_us())
        except AttributeError:
            us = float(getattr(evt, "device_time_total", 0.0))
        rows.append((evt.name, us))
    return rows


def _profile(step: Callable[[], None], reshard: Callable[[], None], device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    dist.barrier()
    harness.sync(device)
    with profile(activities=acts) as prof:
        for _ in range(PROFILE_STEPS):
            step()
            harness.sync(device)
            reshard()
    harness.sync(device)
    return breakdown(device_rows(prof), PROFILE_STEPS)


def _unsharded_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def _check_exact(
    step: Callable[[], None],
    reshard: Callable[[], None],
    model: nn.Module,
    ref: list[torch.Tensor],
    device: torch.device,
) -> tuple[bool, int]:
    """Unshard once with every TIDE storage NaN-poisoned first; (all params
    bitwise equal to ``ref``, number that differ)."""
    from torchtitan_tide.comm.fsdp import all_gather as tide_ag

    def poison(outputs: list[torch.Tensor]) -> None:
        for o in outputs:
            o.fill_(float("nan"))

    tide_ag.set_debug_hooks(before=poison)
    try:
        step()
        harness.sync(device)
    finally:
        tide_ag.set_debug_hooks()
    params = _unsharded_params(model)
    bad = sum(1 for p, r in zip(params, ref) if p.shape != r.shape or not torch.equal(p, r)) + abs(
        len(params) - len(ref)
    )
    reshard()
    return bad == 0, bad


def _transports(model: nn.Module) -> list[str]:
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    names = []
    for _, pg in fsdp_patch.fsdp_param_groups(model):
        state = getattr(pg, "_tide_ag_state", None)
        names.append(state.transport.name if state is not None else "fsdp2")
    return names


def measure_variant(
    model: nn.Module,
    units: list[nn.Module],
    device: torch.device,
    iters: int,
    detail: bool,
    ref: list[torch.Tensor] | None,
    is_tide: bool,
) -> dict:
    """Time ``unshard(); wait`` of every unit in ``units`` (in order) as one
    step: warm-up, ``iters`` idle-GPU timings, ``iters`` queued timings; with
    ``detail`` also a profile, the transports, and (TIDE with ``ref``) the
    exactness check. Leaves every unit resharded."""

    def step() -> None:
        for u in units:
            u.unshard()  # async_op=False: returns after wait_for_unshard

    def reshard() -> None:
        for u in units:
            u.reshard()

    for _ in range(WARMUP):
        step()
        reshard()
    harness.sync(device)
    idle, queued, host = [], [], []
    for _ in range(iters):
        ms, _ = harness.time_call(step, device, queued=False)
        reshard()
        idle.append(ms)
    for _ in range(iters):
        ms, h = harness.time_call(step, device, queued=True)
        reshard()
        queued.append(ms)
        host.append(h)
    out: dict[str, Any] = {
        "median_ms": common.median(idle),
        "min_ms": min(idle),
        "queued_median_ms": common.median(queued),
        "host_median_ms": common.median(host),
        "times_ms": [round(t, 4) for t in idle],
        "queued_times_ms": [round(t, 4) for t in queued],
    }
    if detail:
        out["profile"] = _profile(step, reshard, device)
        out["transports"] = _transports(model)
        if is_tide:
            from torchtitan_tide.comm.transports import copy_engine

            out["batch_fallback"] = copy_engine._batch_state["disabled_reason"]
            if ref is not None:
                out["exact_vs_stock"], out["mismatched_params"] = _check_exact(
                    step, reshard, model, ref, device
                )
    return out


def build_model(n_layers: int, shape: LayerShape, device: torch.device) -> tuple[nn.Module, list]:
    """``n_layers`` layers, each its own FSDP group (fp32 master, bf16 param
    dtype), same random data on every rank. Returns (model, units)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        layers = nn.ModuleList(Layer(shape) for _ in range(n_layers))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp_policy)
    harness.sync(device)
    model: nn.Module = layers[0] if n_layers == 1 else layers
    return model, list(layers)


def run_scenario(
    key: str,
    n_layers: int,
    cfg: BenchConfig,
    device: torch.device,
    results: dict,
    checkpoint: Callable[[], None],
) -> None:
    """Both rounds of every variant on a fresh ``n_layers`` model; fills
    ``results[key]`` and calls ``checkpoint()`` after every variant."""
    from torchtitan_tide import comm

    rank = dist.get_rank()
    nbytes = layer_numel(cfg.shape) * n_layers * 2
    scn = results[key] = {
        "layers": n_layers,
        "unsharded_bf16_bytes": nbytes,
        "variants": {name: {"rounds": []} for name, _ in VARIANTS},
    }
    model, units = build_model(n_layers, cfg.shape, device)
    ref: list[torch.Tensor] | None = None
    for rnd in (1, 2):
        for name, options in VARIANTS:
            if options is not None and device.type == "cpu" and options.get("transport"):
                options = {**options, "transport": "gloo"}  # smoke test: gloo stands in
            if model is None:
                model, units = build_model(n_layers, cfg.shape, device)
            t0 = time.perf_counter()
            err, res = None, {}
            try:
                if options is not None:
                    comm.apply(model, "tide", **options)
                try:
                    res = measure_variant(
                        model,
                        units,
                        device,
                        cfg.iters,
                        detail=rnd == 1,
                        ref=ref,
                        is_tide=options is not None,
                    )
                    if name == "stock" and rnd == 1:
                        for u in units:
                            u.unshard()
                        ref = [p.clone() for p in _unsharded_params(model)]
                        for u in units:
                            u.reshard()
                finally:
                    if options is not None:
                        comm.remove(model)
            except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
                err = f"{type(e).__name__}: {e}"
                res = {"error": err, "traceback": traceback.format_exc()[-3000:]}
                print(f"[rank {rank}] {key} {name} round {rnd} FAILED: {err}", flush=True)
            agreed = harness.agree_errors(err)
            if agreed and not res.get("error"):
                res = {"error": f"failed on another rank: {agreed}"}
            if agreed:  # FSDP/TIDE state may be mid-way: start the next variant afresh
                del model, units
                model, units = None, []
                harness.sync(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res["round"] = rnd
            res["wall_s"] = round(time.perf_counter() - t0, 2)
            scn["variants"][name]["rounds"].append(res)
            if rank == 0:
                print(
                    f"{key} {name} round {rnd}: median "
                    f"{res.get('median_ms', float('nan')):.4f} ms, queued "
                    f"{res.get('queued_median_ms', float('nan')):.4f} ms"
                    f"{' ERROR ' + str(res.get('error')) if res.get('error') else ''}",
                    flush=True,
                )
            checkpoint()
    del model, units, ref
    harness.sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- copy engine


def _time_stream(
    op: Callable[[], None], poison: Callable[[], None], stream, iters: int
) -> list[float]:
    """ms per ``op`` on ``stream`` (CUDA events); ``poison`` runs before each,
    outside the timed window. Warm-up first."""
    with torch.cuda.stream(stream):
        for _ in range(WARMUP):
            poison()
            op()
        pairs = []
        for _ in range(iters):
            poison()
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record(stream)
            op()
            e.record(stream)
            pairs.append((s, e))
    stream.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def copy_engine_bench(device: torch.device, iters: int) -> dict:
    """Rank 0 pulls ``CE_COPIES`` equal chunks (~256 MiB in all) from rank 1's
    symmetric buffer three ways (see module docstring). Collective over the
    world (rendezvous, broadcast, barriers); rank 0 returns the results."""
    if device.type != "cuda" or dist.get_world_size() < 2:
        return {"error": "skipped: needs >= 2 CUDA GPUs"}
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots

    rank = dist.get_rank()
    chunk = CE_BYTES // CE_COPIES // 16 * 16
    nbytes = chunk * CE_COPIES
    out: dict[str, Any] = {"bytes": nbytes, "copies": CE_COPIES, "chunk_bytes": chunk, "modes": {}}
    slots = SymmSlots.create(nbytes, dist.group.WORLD, device)
    gen = torch.Generator(device=device).manual_seed(1234)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    if rank == 1:
        slots.buffer.narrow(0, 0, nbytes).copy_(data)
    dist.broadcast(data, src=1)  # rank 0: the expected bytes
    torch.cuda.synchronize(device)
    dist.barrier()
    if rank == 0:
        try:
            _pull_modes(out, slots, data, device, nbytes, chunk, iters)
        except Exception as e:  # noqa: BLE001 - reported; the barriers below must still run
            out["error"] = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize(device)
    dist.barrier()  # peers keep their buffer until rank 0 is done
    del slots
    torch.cuda.synchronize(device)
    dist.barrier()
    return out


def _pull_modes(
    out: dict, slots, data: torch.Tensor, device: torch.device, nbytes: int, chunk: int, iters: int
) -> None:
    """Rank 0 part of :func:`copy_engine_bench`: time the three pull modes from
    rank 1 into ``out["modes"]`` and check each against ``data`` once."""
    from torchtitan_tide.comm.transports.copy_engine import batch_copy

    peer = 1
    stream = torch.cuda.Stream(device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    peer_buf = slots.peer_bufs[peer]
    pairs = [
        (dst.narrow(0, i * chunk, chunk), peer_buf.narrow(0, i * chunk, chunk))
        for i in range(CE_COPIES)
    ]
    dsts = [dst.data_ptr() + i * chunk for i in range(CE_COPIES)]
    srcs = [slots.peer_ptrs[peer] + i * chunk for i in range(CE_COPIES)]
    sizes = [chunk] * CE_COPIES
    devs = [slots.peer_devices[peer]] * CE_COPIES

    def one() -> None:
        dst.copy_(peer_buf.narrow(0, 0, nbytes))

    def loop() -> None:
        for d, s in pairs:
            d.copy_(s)

    def batch() -> None:
        batch_copy(dsts, srcs, sizes, devs, device.index, stream)

    def poison() -> None:
        dst.fill_(255)

    for mode, op in (("one_copy", one), ("loop", loop), ("batch", batch)):
        try:
            times = _time_stream(op, poison, stream, iters)
            with torch.cuda.stream(stream):
                poison()
                op()
            stream.synchronize()
            med = common.median(times)
            out["modes"][mode] = {
                "median_ms": med,
                "min_ms": min(times),
                "GiBps": nbytes / 2**30 / (med / 1e3),
                "exact": bool(torch.equal(dst, data)),
            }
        except Exception as e:  # noqa: BLE001 - reported
            out["modes"][mode] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.synchronize(device)
    a = out["modes"]["one_copy"].get("GiBps")
    c = out["modes"]["batch"].get("GiBps")
    out["batch_vs_one_copy"] = (c / a) if (a and c) else None
    out["within_10pct"] = (c / a >= 0.9) if (a and c) else None


# ---------------------------------------------------------------- processes


def _worker(rank: int, world: int, cfg: BenchConfig) -> None:
    device = torch.device("cuda", rank) if cfg.device_type == "cuda" else torch.device("cpu")
    results: dict[str, Any] = {
        "kind": "ag",
        "metadata": cfg.meta,
        "config": {
            "iters": cfg.iters,
            "warmup": WARMUP,
            "profile_steps": PROFILE_STEPS,
            "shape": dataclasses.asdict(cfg.shape),
            "variants": dict(VARIANTS),
            "stem": cfg.stem,
            "device_type": cfg.device_type,
        },
        "status": "partial",
    }

    def checkpoint(final: bool = False) -> None:
        if rank != 0:
            return
        try:  # rank 0 only: never let a write error desynchronize the ranks
            write_outputs(results, final=final)
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: writing results failed: {type(e).__name__}: {e}", flush=True)

    t0 = time.perf_counter()
    try:
        ce = copy_engine_bench(device, max(cfg.iters, 20))
    except Exception as e:  # noqa: BLE001 - reported
        ce = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(f"[rank {rank}] copy-engine microbenchmark FAILED: {ce['error']}", flush=True)
    if rank == 0:
        results["copy_engine"] = ce
        print(f"copy engine: {ce.get('modes', ce.get('error'))}", flush=True)
    checkpoint()
    for key, n_layers, _ in SCENARIOS:
        run_scenario(key, n_layers, cfg, device, results, checkpoint)
    results["status"] = "complete"
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    checkpoint(final=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_out_dir(ap)
    ap.add_argument("--world", type=int, default=None, help="processes (default: min(2, GPUs))")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="CPU gloo run with tiny shapes: checks the script, not a measurement",
    )
    args = ap.parse_args(argv)
    if args.smoke_cpu:
        device_type, shape, world, machine = "cpu", SMOKE_SHAPE, args.world or 2, "cpu smoke"
    else:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_type, shape, world, machine = "cuda", LLAMA_70B, args.world or min(2, n_gpus), None
        if world < 2 or n_gpus < world:
            print(
                f"needs >= 2 CUDA GPUs and --world <= {n_gpus} (got world={world})", file=sys.stderr
            )
            return 2
    meta = common.metadata(world, machine=machine)
    stem = common.result_stem(args.out_dir, "ag_smoke" if args.smoke_cpu else "ag", meta)
    stem.parent.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(
        iters=args.iters, shape=shape, device_type=device_type, stem=str(stem), meta=meta
    )
    md = Path(str(stem) + ".md")
    try:
        harness.spawn(_worker, world, device_type, (cfg,))
    except Exception:
        if md.exists():
            print(md.read_text(), flush=True)
        print(f"benchmark failed; partial results (if any) under {stem}.*", file=sys.stderr)
        raise
    common.announce_results(stem, md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
