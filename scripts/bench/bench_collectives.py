"""Per-FSDP-group collectives: all-gather and reduce-scatter of one layer per model under
every comm mode (issue 5, "The suite").

    python scripts/bench/bench_collectives.py --out-dir bench/results [--iters 20]
        [--modes fsdp2,symm_mem,tide,tide_ag] [--layers llama70b,qwen3_30b_a3b,wan22_a14b]
    python scripts/bench/bench_collectives.py --small --out-dir /tmp/c      # 2 GPUs, tiny shapes
    python scripts/bench/bench_collectives.py --smoke-cpu --out-dir /tmp/c  # 2 gloo ranks, tiny

Layers (``harness.FULL_LAYERS``), each one FSDP group of fp32 master parameters with
bf16 param dtype and fp32 reduce dtype: a Llama-3.1-70B layer, a Qwen3-30B-A3B MoE
layer (128 experts as grouped 3-D weights) and a Wan2.2 A14B DiT block. Modes
(:data:`MODES`): ``fsdp2``, ``symm_mem`` (its own spawn: ``NCCL_CTA_POLICY=2`` is set
before its process group exists), ``tide`` (TIDE-AG + TIDE-RS) and ``tide_ag``
(TIDE-AG + FSDP2's reduce-scatter). Modes that need the same environment share one
spawn (one process per GPU); every (layer, mode) gets a fresh model, in two rounds
interleaved over the modes of the spawn.

Per variant and round, median over ``--iters`` after warm-up of:

- AG: ``module.unshard()`` (FSDP2: copy-in, collective, copy-out);
- RS: the group's ``post_backward()`` + ``finalize_backward()`` after an unshard and
  fresh random bf16 gradients set outside the timed window (FSDP2: chunk_cat,
  collective, views into the sharded ``.grad``);

timed with CUDA events behind a ~10 ms sleep kernel (device time; host ms beside).
Round 1 also records (CUDA): a torch-profiler trace of 3 AG + RS steps per variant
(kernel ms; SM-weighted ms = duration x min(1, CTAs / SMs) from each kernel's grid;
memcpy rows as copy-engine ms), the peak allocated / reserved bytes of one AG and one
RS, the device memory ``comm.apply`` took (symmetric buffers), and correctness against
exact references, the values stock FSDP2 must produce too: AG = the bf16 cast of the
fp32 master (bitwise), RS = the fp32 mean of every rank's bf16 gradients (max error /
max |reference| <= 1e-5).

One failing variant is recorded as an ``error`` string and the rest runs; a crashed
spawn is recorded and the next spawn runs. Rank 0 writes ``<stem>.json`` after every
variant, then ``<stem>.md`` and ``.png`` (``<stem>`` =
``<out-dir>/<date>_<machine>_<commit>_collectives``); the Markdown is printed last.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import harness  # on import: NVLink multicast off (docs/design/2026-11-29-h200-facts.md)


@dataclass(frozen=True)
class ModeSpec:
    """One benchmarked variant: ``comm.apply(model, comm_mode, **options)``."""

    comm_mode: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""


MODES: dict[str, ModeSpec] = {
    "fsdp2": ModeSpec("fsdp2", {}, "stock FSDP2"),
    "symm_mem": ModeSpec("symm_mem", {}, "FSDP2, buffers in symmetric memory, NCCL_CTA_POLICY=2"),
    "tide": ModeSpec("tide", {"reduce_scatter": "tide"}, "TIDE-AG + TIDE-RS"),
    "tide_ag": ModeSpec("tide", {"reduce_scatter": "fsdp2"}, "TIDE-AG + FSDP2's reduce-scatter"),
    # TIDE-RS accumulate launch shapes (tide = the default: short-lived CTAs, rs_ctas=0).
    "tide_ctas8": ModeSpec("tide", {"rs_ctas": 8}, "TIDE, accumulate on 8 persistent CTAs"),
    "tide_ctas32": ModeSpec("tide", {"rs_ctas": 32}, "TIDE, accumulate on 32 persistent CTAs"),
}
CPU_MODES = ("fsdp2", "tide")  # gloo: symm_mem needs NCCL
ROUNDS = 2
WARMUP = 3
PROFILE_STEPS = 3
RS_REL_TOL = 1e-5
CHECK_STEP = 1_000_000  # gradient seeds of the correctness check (timed steps count from 0)
MIB = 2**20

TIME_COLUMNS = [
    ("layer", "layer"),
    ("mode", "mode"),
    ("ag_r1_ms", "AG r1 ms"),
    ("ag_r2_ms", "AG r2 ms"),
    ("ag_ms", "AG best ms"),
    ("ag_GiBps", "AG GiB/s"),
    ("ag_speedup", "AG fsdp2/mode"),
    ("rs_r1_ms", "RS r1 ms"),
    ("rs_r2_ms", "RS r2 ms"),
    ("rs_ms", "RS best ms"),
    ("rs_GiBps", "RS GiB/s"),
    ("rs_speedup", "RS fsdp2/mode"),
    ("error", "error"),
]
RESOURCE_COLUMNS = [
    ("layer", "layer"),
    ("mode", "mode"),
    ("ag_kernel_ms", "AG kernel ms"),
    ("ag_sm_ms", "AG SM-weighted ms"),
    ("ag_memcpy_ms", "AG copy-engine ms"),
    ("rs_kernel_ms", "RS kernel ms"),
    ("rs_sm_ms", "RS SM-weighted ms"),
    ("rs_memcpy_ms", "RS copy-engine ms"),
    ("ag_peak_mib", "AG peak MiB"),
    ("rs_peak_mib", "RS peak MiB"),
    ("rs_reserved_mib", "RS reserved MiB"),
    ("apply_mib", "apply MiB"),
    ("ag_exact", "AG exact"),
    ("rs_rel_err", "RS max rel err"),
]


@dataclass(frozen=True)
class BenchConfig:
    """What one spawn measures (``modes``: the modes of that spawn)."""

    iters: int
    layers: tuple[str, ...]
    modes: tuple[str, ...]
    small: bool
    device_type: str  # "cuda" (NCCL) or "cpu" (gloo smoke run)
    stem: str  # result path without suffix


def layer_specs(small: bool) -> dict[str, harness.LayerSpec]:
    return harness.SMALL_LAYERS if small else harness.FULL_LAYERS


# ---------------------------------------------------------------- measurement


def measure_ag(model, device: torch.device, iters: int) -> dict[str, Any]:
    """Median ``unshard()`` time over ``iters`` after warm-up; leaves ``model`` resharded."""
    for _ in range(WARMUP):
        model.unshard()
        model.reshard()
    times, host = [], []
    for _ in range(iters):
        ms, host_ms = harness.time_call(model.unshard, device, queued=True)
        model.reshard()
        times.append(ms)
        host.append(host_ms)
    return _timing(times, host)


def measure_rs(model, group, device: torch.device, iters: int, rank: int) -> dict[str, Any]:
    """Median reduce-scatter time (``harness.reduce_scatter``) over ``iters`` after
    warm-up, each step on fresh random gradients set outside the timed window."""

    def prepare(step: int) -> None:
        model.unshard()
        harness.set_random_grads(group, harness.grad_seed(rank, step))

    def reduce() -> None:
        harness.reduce_scatter(group)

    try:
        for step in range(WARMUP):
            prepare(step)
            reduce()
        times, host = [], []
        for step in range(WARMUP, WARMUP + iters):
            prepare(step)
            ms, host_ms = harness.time_call(reduce, device, queued=True)
            times.append(ms)
            host.append(host_ms)
    finally:
        model.zero_grad(set_to_none=True)
    return _timing(times, host)


def _timing(times: Sequence[float], host: Sequence[float]) -> dict[str, Any]:
    return {
        "median_ms": common.median(times),
        "min_ms": min(times),
        "host_median_ms": common.median(host),
        "times_ms": [round(t, 4) for t in times],
    }


def profile_variant(model, group, device: torch.device, rank: int, with_rs: bool) -> dict | None:
    """Device time per step of AG (and RS) from a trace of ``PROFILE_STEPS`` steps;
    kernels attributed through ``bench::`` ranges with the device synchronized at
    every boundary. Rank 0 returns ``{"ag": summary, "rs": summary}``, others None."""
    from torch.profiler import record_function

    def labeled(label: str, fn: Callable[[], None]) -> None:
        with record_function("bench::" + label):
            fn()
            harness.sync(device)

    def body() -> None:
        for step in range(PROFILE_STEPS):
            labeled("barrier", dist.barrier)
            labeled("ag", model.unshard)
            if not with_rs:
                labeled("reshard", model.reshard)
                continue
            seed = harness.grad_seed(rank, CHECK_STEP + 1 + step)
            labeled("prepare", functools.partial(harness.set_random_grads, group, seed))
            labeled("barrier", dist.barrier)
            labeled("rs", lambda: harness.reduce_scatter(group))

    try:
        events = harness.profiled_trace(body, device, export=rank == 0)
    finally:
        model.zero_grad(set_to_none=True)
    if events is None:
        return None
    labeled_rows = common.label_by_range(events)
    sms = harness.sm_count(device)
    return {
        op: common.summarize_device_events(
            [row for label, row in labeled_rows if label == op], sms, PROFILE_STEPS
        )
        for op in (("ag", "rs") if with_rs else ("ag",))
    }


def memory_variant(model, group, device: torch.device, rank: int, with_rs: bool) -> dict | None:
    """Allocator bytes of one AG and one RS (``harness.memory_delta``); None on CPU."""
    if device.type != "cuda":
        return None
    out = {"ag": harness.memory_delta(model.unshard, device)}
    if with_rs:
        harness.set_random_grads(group, harness.grad_seed(rank, CHECK_STEP + 100))
        dist.barrier()
        out["rs"] = harness.memory_delta(lambda: harness.reduce_scatter(group), device)
        model.zero_grad(set_to_none=True)
    else:
        model.reshard()
    return out


def check_variant(model, group, device: torch.device, world: int, rank: int, with_rs: bool) -> dict:
    """Correctness against exact references (module docstring). Every rank checks
    its own shards; the results are agreed by the caller."""
    model.unshard()
    params = []
    mismatched = []
    for fsdp_param in group.fsdp_params:
        name = harness.param_name(fsdp_param)
        unsharded = fsdp_param.unsharded_param.detach()
        params.append((name, tuple(unsharded.shape), unsharded.dtype))
        want = harness.param_value(unsharded.shape, model.seeds[name], device).to(unsharded.dtype)
        if not torch.equal(unsharded, want):
            mismatched.append(name)
    out: dict[str, Any] = {"ag_exact": not mismatched, "ag_mismatched": mismatched}
    if not with_rs:
        model.reshard()
        return out
    harness.set_random_grads(group, harness.grad_seed(rank, CHECK_STEP))
    harness.reduce_scatter(group)
    worst, bad = 0.0, []
    for i, (fsdp_param, (name, shape, dtype)) in enumerate(zip(group.fsdp_params, params)):
        grad = fsdp_param.sharded_param.grad
        if grad is None:
            bad.append(f"{name}: no sharded grad")
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        full = sum(
            harness.random_grad(shape, dtype, harness.grad_seed(r, CHECK_STEP) + i, device).float()
            for r in range(world)
        )
        chunks = torch.chunk(full / world, world, dim=0)
        want = chunks[rank] if rank < len(chunks) else full.new_empty((0, *shape[1:]))
        if tuple(local.shape) != tuple(want.shape):
            bad.append(f"{name}: shard shape {tuple(local.shape)} != {tuple(want.shape)}")
            continue
        if want.numel():
            err = (local.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)
            worst = max(worst, float(err))
    model.zero_grad(set_to_none=True)
    out.update(rs_max_rel_err=worst, rs_problems=bad, rs_ok=not bad and worst <= RS_REL_TOL)
    return out


def _phase(res: dict, key: str, fn: Callable[[], Any], tag: str) -> bool:
    """``res[key] = fn()``, or ``{"error": ...}`` when it raised on any rank
    (collective: every rank learns every rank's error). True when all succeeded."""
    err, out = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - recorded; the benchmark goes on
        out = harness.error_info(e)
        err = out["error"]
        print(f"[rank {dist.get_rank()}] {tag} {key} FAILED: {err}", flush=True)
    agreed = harness.agree_errors(err)
    if agreed and err is None:
        out = {"error": f"failed on another rank: {agreed}"}
    res[key] = out
    return agreed is None


def run_variant(
    spec: harness.LayerSpec, mode: str, rnd: int, device: torch.device, cfg: BenchConfig
) -> dict[str, Any]:
    """One (layer, mode, round) on a fresh model; never raises (errors recorded)."""
    from torchtitan_tide import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    tag = f"{spec.name} {mode} round {rnd}"
    t0 = time.perf_counter()
    res: dict[str, Any] = {"round": rnd}
    built: dict[str, Any] = {}
    mode_spec = MODES[mode]

    def apply() -> dict[str, Any]:
        taken: dict[str, int | None] = {}

        def apply_mode(model) -> None:
            built["model"] = model
            taken["bytes"] = harness.device_bytes_taken(
                lambda: comm.apply(model, mode_spec.comm_mode, **mode_spec.options), device
            )
            built["applied"] = True

        _, built["group"] = harness.build_fsdp_layer(spec, device, before_init=apply_mode)
        return {"device_bytes": taken["bytes"]}

    if _phase(res, "apply", apply, tag):
        model, group = built["model"], built["group"]
        ag_ok = _phase(res, "ag", lambda: measure_ag(model, device, cfg.iters), tag)
        rs_ok = ag_ok and _phase(
            res, "rs", lambda: measure_rs(model, group, device, cfg.iters, rank), tag
        )
        if not ag_ok:
            res["rs"] = {"error": "skipped: the all-gather failed"}
        if rnd == 1 and ag_ok:
            if device.type == "cuda":
                _phase(
                    res, "profile", lambda: profile_variant(model, group, device, rank, rs_ok), tag
                )
                _phase(
                    res, "memory", lambda: memory_variant(model, group, device, rank, rs_ok), tag
                )
            _phase(
                res, "check", lambda: check_variant(model, group, device, world, rank, rs_ok), tag
            )
            checks: list[dict | None] = [None] * world
            dist.all_gather_object(checks, res["check"])  # rank 0 reports every rank's
            res["check_all_ranks"] = checks
    if built.get("applied"):
        _phase(res, "remove", lambda: comm.remove(built["model"]), tag)
    built.clear()
    model = group = None  # drop the last references, then FSDP's reference cycles
    gc.collect()
    harness.sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------- summary


def _ms(round_result: dict, op: str) -> float | None:
    return (round_result.get(op) or {}).get("median_ms")


def _errors(rounds: Sequence[dict]) -> str | None:
    errs = []
    for r in rounds:
        for key in ("apply", "ag", "rs", "profile", "memory", "check", "remove"):
            part = r.get(key)
            if isinstance(part, dict) and (err := part.get("error")):
                errs.append(f"r{r.get('round')} {key}: {common.short_error(err)}")
    return "; ".join(errs) or None


def _all_ranks_check(r1: dict) -> tuple[bool | None, float | None]:
    checks = r1.get("check_all_ranks") or ([r1["check"]] if r1.get("check") else [])
    checks = [c for c in checks if c and "error" not in c]
    if not checks:
        return None, None
    exact = all(c.get("ag_exact") for c in checks)
    errs = [c["rs_max_rel_err"] for c in checks if c.get("rs_max_rel_err") is not None]
    rs_bad = any(c.get("rs_problems") for c in checks)
    return exact, (float("inf") if rs_bad else (max(errs) if errs else None))


def variant_row(
    layer: str, mode: str, rounds: Sequence[dict], spec: harness.LayerSpec, world: int
) -> dict[str, Any]:
    """One table row of a (layer, mode) from its per-round results."""
    row: dict[str, Any] = {"layer": layer, "mode": mode}
    for op, nbytes in (("ag", 2 * spec.numel()), ("rs", 4 * spec.numel())):
        meds = [_ms(r, op) for r in rounds]
        row[f"{op}_r1_ms"] = meds[0] if meds else None
        row[f"{op}_r2_ms"] = meds[1] if len(meds) > 1 else None
        row[f"{op}_ms"] = common.min_or_none(meds)
        row[f"{op}_GiBps"] = common.bus_gibps(nbytes, world, row[f"{op}_ms"])
    r1 = next((r for r in rounds if r.get("round") == 1), {})
    profile = r1.get("profile") if isinstance(r1.get("profile"), dict) else {}
    memory = r1.get("memory") if isinstance(r1.get("memory"), dict) else {}
    for op in ("ag", "rs"):
        prof = (profile or {}).get(op) or {}
        row[f"{op}_kernel_ms"] = prof.get("kernel_ms")
        row[f"{op}_sm_ms"] = prof.get("kernel_sm_weighted_ms")
        row[f"{op}_memcpy_ms"] = prof.get("memcpy_ms")
        mem = (memory or {}).get(op) or {}
        row[f"{op}_peak_mib"] = mem["peak_allocated"] / MIB if "peak_allocated" in mem else None
        row[f"{op}_reserved_mib"] = mem["peak_reserved"] / MIB if "peak_reserved" in mem else None
    apply_bytes = (r1.get("apply") or {}).get("device_bytes")
    row["apply_mib"] = apply_bytes / MIB if apply_bytes is not None else None
    row["ag_exact"], row["rs_rel_err"] = _all_ranks_check(r1)
    row["error"] = _errors(rounds)
    return row


def table_rows(results: dict) -> list[dict[str, Any]]:
    """Rows (layer-major, modes in ``common.MODE_ORDER``) with speed-ups vs fsdp2."""
    cfg = results["config"]
    specs = layer_specs(cfg["small"])
    world = results["metadata"]["world_size"]
    rows = []
    for layer in cfg["layers"]:
        by_mode = results.get("variants", {}).get(layer, {})
        modes = [m for m in common.MODE_ORDER if m in by_mode] + sorted(
            m for m in by_mode if m not in common.MODE_ORDER
        )
        layer_rows = [
            variant_row(layer, m, by_mode[m]["rounds"], specs[layer], world) for m in modes
        ]
        base = next((r for r in layer_rows if r["mode"] == "fsdp2"), {})
        for row in layer_rows:
            for op in ("ag", "rs"):
                b, v = base.get(f"{op}_ms"), row.get(f"{op}_ms")
                row[f"{op}_speedup"] = b / v if (b and v) else None
        rows.extend(layer_rows)
    return rows


def headline(results: dict, rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Per layer: AG ms, RS ms, RS SM-weighted ms and RS peak MiB by mode."""
    out = []
    for layer in results["config"]["layers"]:
        sub = [r for r in rows if r["layer"] == layer]
        for key, metric in (
            ("ag_ms", "AG ms"),
            ("rs_ms", "RS ms"),
            ("rs_sm_ms", "RS SM-weighted ms"),
            ("rs_peak_mib", "RS peak MiB"),
        ):
            values = {r["mode"]: r.get(key) for r in sub}
            if any(v is not None for v in values.values()):
                out.append(common.headline_row(f"collectives {layer}", metric, values))
    return out


def kernel_notes(results: dict) -> str:
    """Markdown list: the top kernels of every round-1 profile."""
    lines = []
    for layer, by_mode in results.get("variants", {}).items():
        for mode, v in by_mode.items():
            r1 = next((r for r in v["rounds"] if r.get("round") == 1), {})
            profile = r1.get("profile")
            if not isinstance(profile, dict) or "error" in profile:
                continue
            for op, summary in profile.items():
                top = ", ".join(
                    f"`{k['name'][:60]}` {k['ms']:.3f} ms ({k.get('ctas')} CTAs)"
                    for k in summary.get("kernels", [])[:4]
                )
                lines.append(
                    f"- {layer} {mode} {op}: memcpy {summary.get('memcpy_ms', 0):.3f} ms; "
                    f"{top or 'no kernels'}"
                )
    return "\n".join(lines)


def write_outputs(results: dict, final: bool) -> str:
    """Tables and headline into ``results``, then ``<stem>.json`` / ``.md`` (and
    ``.png`` when ``final``). Returns the Markdown."""
    rows = table_rows(results)
    results["tables"] = [
        {"title": "Times (median per round, best of two)", "columns": TIME_COLUMNS, "rows": rows},
        {"title": "Device time, memory, correctness (round 1)", "columns": RESOURCE_COLUMNS,
         "rows": rows},
    ]  # fmt: skip
    results["headline"] = headline(results, rows)
    meta, cfg = results["metadata"], results["config"]
    launches = "; ".join(
        f"{'+'.join(launch['modes'])}{' ' + str(launch['env']) if launch['env'] else ''}"
        f"{': ' + launch['error'] if launch.get('error') else ''}"
        for launch in results.get("launches", [])
    )
    notes = (
        f"{meta['machine']} ({meta['hostname']}), torch {meta['torch']}, NCCL {meta['nccl']}, "
        f"CUDA {meta['cuda']}, commit {meta['commit']}, world {meta['world_size']}, "
        f"{meta['date']}; iters {cfg['iters']}, warm-up {WARMUP}, status {results['status']}. "
        f"Spawns: {launches or '-'}.\n\n"
        "AG: `module.unshard()`; RS: `post_backward()` + `finalize_backward()` of the FSDP "
        "group on fresh random bf16 gradients; CUDA events behind a ~10 ms sleep kernel "
        "(device time), median per round, best of two interleaved rounds. GiB/s = bytes x "
        "(world-1)/world / time with AG bytes = bf16 layer bytes and RS bytes = fp32 layer "
        "bytes (what FSDP2 sends) for every mode. Kernel / SM-weighted (duration x min(1, "
        "CTAs/SMs)) / copy-engine (memcpy rows) ms: torch profiler, per step, round 1, "
        "rank 0. Peak MiB: allocator peak above the level before one op (AG includes the "
        "unsharded parameters it leaves); apply MiB: device memory `comm.apply` took. AG "
        "exact: unsharded params bitwise equal to the bf16 cast of the fp32 master on every "
        "rank; RS max rel err: sharded .grad vs the fp32 mean of all ranks' bf16 gradients "
        f"(max error / max |reference|, pass <= {RS_REL_TOL:g}); stock FSDP2 is held to "
        "the same references.\n"
    )
    if kernels := kernel_notes(results):
        notes += "\n## Top kernels per variant (round-1 profile, per step)\n\n" + kernels + "\n"
    charts = []
    if final:
        labels = [f"{r['layer']} {r['mode']}" for r in rows]
        for key, title, unit in (
            ("ag_ms", "all-gather, best median", "ms"),
            ("rs_ms", "reduce-scatter, best median", "ms"),
            ("rs_sm_ms", "reduce-scatter SM-weighted kernel time", "ms"),
        ):
            if any(r.get(key) is not None for r in rows):
                charts.append(common.BarChart(title, labels, [r.get(key) for r in rows], unit))
    return common.write_result(
        results["config"]["stem"],
        results,
        "FSDP group collectives by comm mode",
        notes,
        charts,
    )


# ---------------------------------------------------------------- processes


def _worker(rank: int, world: int, cfg: BenchConfig) -> None:
    device = torch.device("cuda", rank) if cfg.device_type == "cuda" else torch.device("cpu")
    specs = layer_specs(cfg.small)
    results = json.loads(Path(cfg.stem + ".json").read_text()) if rank == 0 else {}
    for rnd in range(1, ROUNDS + 1):
        for layer in cfg.layers:
            for mode in cfg.modes:
                res = run_variant(specs[layer], mode, rnd, device, cfg)
                if rank != 0:
                    continue
                variants = results.setdefault("variants", {}).setdefault(layer, {})
                variants.setdefault(mode, {"rounds": []})["rounds"].append(res)
                print(
                    f"{layer} {mode} round {rnd}: AG {_ms(res, 'ag')} ms, RS {_ms(res, 'rs')} "
                    f"ms{' ERROR ' + str(_errors([res])) if _errors([res]) else ''}",
                    flush=True,
                )
                harness.save_quietly(write_outputs, results)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_out_dir(ap)
    ap.add_argument("--world", type=int, default=None, help="processes (default: min(2, GPUs))")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--modes", default=None, help=f"comma list of {sorted(MODES)}")
    ap.add_argument("--layers", default=",".join(harness.FULL_LAYERS))
    ap.add_argument("--small", action="store_true", help="tiny shapes on the GPUs (tests)")
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="CPU gloo run with tiny shapes (fsdp2, tide): checks the script, not a measurement",
    )
    args = ap.parse_args(argv)
    modes = tuple((args.modes or ",".join(CPU_MODES if args.smoke_cpu else MODES)).split(","))
    layers = tuple(args.layers.split(","))
    bad = [m for m in modes if m not in MODES] + [x for x in layers if x not in harness.FULL_LAYERS]
    if bad:
        ap.error(
            f"unknown mode/layer {bad}; modes {sorted(MODES)}, layers {list(harness.FULL_LAYERS)}"
        )
    if args.smoke_cpu:
        if set(modes) - set(CPU_MODES):
            ap.error(f"--smoke-cpu runs on gloo: modes {CPU_MODES} only")
        device_type, world, machine, name = "cpu", args.world or 2, "cpu smoke", "collectives_smoke"
    else:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_type, world, machine = "cuda", args.world or min(2, n_gpus), None
        name = "collectives_small" if args.small else "collectives"
        if world < 2 or n_gpus < world:
            print(f"needs >= 2 CUDA GPUs and --world <= {n_gpus} (got {world})", file=sys.stderr)
            return 2
    small = args.small or args.smoke_cpu
    meta = common.metadata(world, machine=machine)
    stem = str(common.result_stem(args.out_dir, name, meta))
    results: dict[str, Any] = {
        "kind": "collectives",
        "metadata": meta,
        "config": {
            "iters": args.iters,
            "warmup": WARMUP,
            "rounds": ROUNDS,
            "profile_steps": PROFILE_STEPS,
            "layers": list(layers),
            "modes": list(modes),
            "mode_specs": {m: MODES[m].__dict__ for m in modes},
            "layer_numel": {x: layer_specs(small)[x].numel() for x in layers},
            "small": small,
            "device_type": device_type,
            "stem": stem,
        },
        "status": "partial",
        "launches": [],
        "variants": {},
    }
    return harness.run_benchmark(
        results,
        _worker,
        world,
        device_type,
        lambda launch: BenchConfig(args.iters, layers, launch.modes, small, device_type, stem),
        write_outputs,
    )


if __name__ == "__main__":
    sys.exit(main())
