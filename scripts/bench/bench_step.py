"""Training-step benchmark: the same config under every comm mode, side by side.

Runs ``./run_train.sh --config CONFIG --tide.comm MODE`` for each mode (default all
three: ``fsdp2``, ``symm_mem``, ``tide``; the launcher sets what a mode needs, e.g.
``NCCL_CTA_POLICY=2`` for ``symm_mem``),
``--rounds`` times interleaved (round 1: all modes, round 2: all modes), reads each
run's ``metrics.jsonl`` and reports per mode: median step time after ``--warmup``
steps (TorchTitan's end-to-end step timer), tokens/s, MFU, peak reserved memory,
first/last loss, the ratio to ``fsdp2``, and the share of step time spent in FSDP2's
layout-conversion kernels (``chunk_cat``, ``split_with_sizes_copy``,
``all_gather_copy_in``) in one profiled step.

Profiling (``--profile auto``: on with CUDA; TorchTitan 0.2.2 cannot profile on CPU):
the round-1 run of each mode profiles its last step through TorchTitan's
``[profiling]`` options (profiler warm-up on the step before), and those two steps are
left out of its median. The per-rank chrome traces are parsed, not kept.

The profiled step is also broken down on its compute stream (``step_breakdown.py``):
compute, optimizer, exposed communication (first all-gather, last reduce-scatters,
waits in between), host-bound idle and other idle, summing to the profiled step.

Every mode's row carries ``floor_ms`` and ``gap_to_floor_pct`` (best step vs floor) when
a compute floor of the config exists: ``--floor-json``, else the newest
``*_floor_<config>.json`` (``bench_floor.py``) under ``--out-dir``.

``--fsdp-at-world-size-1`` (one GPU, ``CUDA_VISIBLE_DEVICES`` of one device) runs each
mode with ``TIDE_FSDP_AT_WORLD_SIZE_1=1``: FSDP2 over a one-rank mesh, i.e. one rank's
compute of a multi-GPU step of the config (``torchtitan_tide/world1_fsdp.py``); a run whose
log lacks TorchTitan's "Applied FSDP" line is an error.

Writes ``<date>_<machine>_<commit>_step_<config>.{json,md,png}`` (``step_world1_<config>``
for a one-rank run, ``step_world1_fsdp_<config>`` with ``--fsdp-at-world-size-1``):

    python scripts/bench/bench_step.py --out-dir bench/results \\
        [--config h200x2_llama70b_4layers] [--modes fsdp2,symm_mem,tide] [--steps 15] \\
        [--rounds 2] [--profile auto|on|off] [--floor-json FILE] [--fsdp-at-world-size-1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
import gpu_clock
import step_breakdown
from common import find_floor, load_floor

from torchtitan_tide.world1_fsdp import ENV as WORLD1_FSDP_ENV

REPO = Path(__file__).resolve().parents[2]
TRACE_FOLDER = "profile_traces"
PROFILED_STEPS = 2  # the profiler's warm-up step and its active (last) step
TOP_KERNELS = 25  # per rank: the profiled step's kernels with the most device time
FSDP_APPLIED_LINE = "Applied FSDP to the"  # TorchTitan's log line (and models/wan22's)

COLUMNS_AFTER_ROUNDS = [
    ("best_step_ms", "best step ms"),
    ("speedup_vs_fsdp2", "speed-up vs fsdp2"),
    ("floor_ms", "floor ms"),
    ("gap_to_floor_pct", "gap to floor %"),
    ("tokens_per_s", "tokens/s"),
    ("mfu_pct", "MFU %"),
    ("peak_reserved_gib", "peak GiB"),
    ("peak_mem_delta_gib", "peak vs fsdp2 GiB"),
    ("layout_ms", "layout-conversion ms/step"),
    ("layout_share_pct", "layout share %"),
    ("rs_kernel_ms", "reduce SM kernel ms/step"),
    ("rs_kernel_sm_weighted_ms", "reduce SM-weighted ms/step"),
    ("sm_mhz_median", "SM MHz (busy, median)"),
    ("power_w_median", "W (busy, median)"),
    ("first_loss", "first loss"),
    ("last_loss", "last loss"),
    ("error", "error"),
]


def profile_args(steps: int) -> list[str]:
    """TorchTitan overrides that profile the last of ``steps`` steps (warm-up: the one before)."""
    return [
        "--profiling.enable_profiling",
        "--profiling.save_traces_folder",
        TRACE_FOLDER,
        "--profiling.profile_freq",
        str(steps),
        "--profiling.profiler_warmup",
        "1",
        "--profiling.profiler_active",
        "1",
    ]


def run_once(
    config: str,
    mode: str,
    steps: int,
    dump_folder: Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> int:
    """One training run; returns its exit code (output in ``log_path``). ``mode`` is
    a comm mode, optionally with ``[tide]`` overrides: ``tide+rs_ctas=0+slot_reuse=false``;
    ``env``: variables added to this process's environment."""
    comm_mode, *overrides = mode.split("+")
    for item in overrides:
        key, _, value = item.partition("=")
        extra_args = [*extra_args, f"--tide.{key}", value] if value not in ("true", "false") else [
            *extra_args, f"--tide.{key}" if value == "true" else f"--tide.no-{key}"]  # fmt: skip
    cmd = [
        str(REPO / "run_train.sh"),
        "--config",
        config,
        "--tide.comm",
        comm_mode,
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(dump_folder),
        "--metrics.log_freq",
        "1",
        *extra_args,
    ]
    with open(log_path, "w") as log:
        return subprocess.call(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )


def summarize_run(records: list[dict], warmup: int, profiled_steps: int = 0) -> dict:
    """Median step figures of one run's metrics records: steps after ``warmup`` and
    before the last ``profiled_steps`` (slowed by the profiler)."""
    last = max(r["step"] for r in records)
    timed = [r for r in records if warmup < r["step"] <= last - profiled_steps] or records
    return {
        "steps": len(records),
        "timed_steps": [r["step"] for r in timed],
        "step_ms": 1000 * common.median([r["time_metrics/end_to_end(s)"] for r in timed]),
        "tokens_per_s": common.median([r["throughput(tps)"] for r in timed]),
        "mfu_pct": common.median([r["mfu(%)"] for r in timed]),
        "peak_reserved_gib": max(r["memory/max_reserved(GiB)"] for r in records),
        "first_loss": records[0]["loss_metrics/global_avg_loss"],
        "last_loss": records[-1]["loss_metrics/global_avg_loss"],
    }


BREAKDOWN_COLUMNS = [
    ("bd_step_ms", "profiled step ms"),
    ("bd_compute_ms", "compute ms"),
    ("bd_optimizer_ms", "optimizer ms"),
    ("bd_exposed_comm_ms", "exposed comm ms"),
    ("bd_host_bound_ms", "host-bound idle ms"),
    ("bd_other_idle_ms", "other idle ms"),
    ("bd_exposed_first_ms", "exposed: first AG ms"),
    ("bd_exposed_between_ms", "exposed: between ms"),
    ("bd_exposed_last_ms", "exposed: last RS ms"),
    ("bd_comm_busy_ms", "comm streams busy ms"),
    ("bd_comm_hidden_ms", "comm hidden under compute ms"),
]


def profile_from_traces(
    trace_paths: Sequence[Path], step_ms: float | None, sm_count: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(layout, breakdown) of the per-rank traces, each trace read once: layout as
    :func:`layout_from_traces`; breakdown: ``step_breakdown.step_breakdown`` per rank
    (``per_rank``) and its mean over ranks (top-level keys); ``{"error": ...}`` for a
    part that failed."""
    per_rank, breakdowns = {}, {}
    for path in sorted(trace_paths):
        events = common.load_chrome_trace(path)
        rank = path.name.split("_")[0]
        per_rank[rank] = _layout_of(events, sm_count)
        try:
            breakdowns[rank] = step_breakdown.step_breakdown(events)
        except ValueError as e:
            breakdowns[rank] = {"error": str(e)}
    if not per_rank:
        err = {"error": "no profiler trace found"}
        return err, dict(err)
    keys = [k for k in next(iter(per_rank.values())) if k not in ("rows", "kernels")]
    mean = {
        k: None if any(r[k] is None for r in per_rank.values())
        else sum(r[k] for r in per_rank.values()) / len(per_rank)
        for k in keys
    }  # fmt: skip
    mean["share_pct"] = 100 * mean["total_ms"] / step_ms if step_ms else None
    failed = [f"{rank}: {b['error']}" for rank, b in breakdowns.items() if "error" in b]
    breakdown = (
        {"error": "; ".join(failed)}
        if failed
        else {**step_breakdown.mean_breakdown(breakdowns), "per_rank": breakdowns}
    )
    return {**mean, "per_rank": per_rank}, breakdown


def _layout_of(events: list[dict], sm_count: int) -> dict[str, Any]:
    layout = common.layout_conversion(events)
    device = common.summarize_device_events(
        common.device_events(events), sm_count=0, top=TOP_KERNELS
    )
    layout.update(
        nccl_kernel_ms=device["nccl_kernel_ms"],
        memcpy_ms=device["memcpy_ms"],
        kernel_ms=device["kernel_ms"],
        kernels=device["kernels"],
    )
    reduce = common.reduce_kernels(events, sm_count)
    layout.update(
        rs_kernel_ms=reduce["kernel_ms"],
        rs_kernel_sm_weighted_ms=reduce["kernel_sm_weighted_ms"],
    )
    return layout


def layout_from_traces(
    trace_paths: Sequence[Path], step_ms: float | None, sm_count: int = 0
) -> dict[str, Any]:
    """Layout-conversion time of the profiled step (``common.layout_conversion``) per
    rank trace and their mean; ``share_pct`` = mean ms / ``step_ms`` (the run's
    unprofiled median). Also all kernels' ms, NCCL kernel and memcpy ms, the
    ``TOP_KERNELS`` kernels by time per rank (``per_rank[r]["kernels"]``), and the gradient reduce's
    kernel time (``rs_kernel_ms``, SM-weighted with ``sm_count`` > 0:
    ``common.reduce_kernels``) from the same traces."""
    return profile_from_traces(trace_paths, step_ms, sm_count)[0]


def _sm_count() -> int:
    """SMs of GPU 0, asked in a child process: this process keeps no CUDA context
    (it would hold GPU memory while the measured runs train); 0 when that fails."""
    code = "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return int(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return 0


def find_traces(dump_folder: Path) -> list[Path]:
    """Per-rank chrome traces TorchTitan wrote under ``dump_folder`` (json or json.gz)."""
    folder = dump_folder / TRACE_FOLDER
    return sorted(folder.glob("**/rank*_trace.json")) + sorted(
        folder.glob("**/rank*_trace.json.gz")
    )


def compare(runs: dict[str, list[dict]], floor_ms: float | None = None) -> list[dict]:
    """One row per mode: each round's median, the best, ratios to fsdp2's best, the
    layout-conversion figures and step breakdown (``bd_*``) of the profiled run, and,
    with ``floor_ms``, ``floor_ms`` and ``gap_to_floor_pct`` = 100 (best / floor - 1)."""
    rows = []
    for mode, per_round in runs.items():
        ok = [r for r in per_round if "error" not in r]
        row = {
            "mode": mode,
            "error": "; ".join(r["error"] for r in per_round if "error" in r) or None,
        }
        for i, result in enumerate(per_round, start=1):
            row[f"r{i}_step_ms"] = result.get("step_ms")
        if ok:
            best = min(ok, key=lambda r: r["step_ms"])
            row.update(
                best_step_ms=best["step_ms"],
                tokens_per_s=best["tokens_per_s"],
                mfu_pct=best["mfu_pct"],
                peak_reserved_gib=max(r["peak_reserved_gib"] for r in ok),
                first_loss=best["first_loss"],
                last_loss=best["last_loss"],
            )
            if clock := best.get("clock"):
                row.update(
                    sm_mhz_median=clock["sm_mhz_median"], power_w_median=clock["power_w_median"]
                )
        layout = next((r["layout"] for r in ok if "total_ms" in r.get("layout", {})), None)
        if layout:
            row.update(layout_ms=layout["total_ms"], layout_share_pct=layout["share_pct"])
            row.update(
                rs_kernel_ms=layout.get("rs_kernel_ms"),
                rs_kernel_sm_weighted_ms=layout.get("rs_kernel_sm_weighted_ms"),
            )
            row.update({k: layout.get(f"{k}_ms") for k in common.LAYOUT_KERNELS})
        breakdown = next((r["breakdown"] for r in ok if "step_ms" in r.get("breakdown", {})), None)
        if breakdown:
            row.update({key: breakdown.get(key[3:]) for key, _ in BREAKDOWN_COLUMNS})
        if floor_ms:
            row["floor_ms"] = floor_ms
            if row.get("best_step_ms"):
                row["gap_to_floor_pct"] = 100 * (row["best_step_ms"] / floor_ms - 1)
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "fsdp2" and r.get("best_step_ms")), None)
    for row in rows:
        if base and row.get("best_step_ms"):
            row["speedup_vs_fsdp2"] = base["best_step_ms"] / row["best_step_ms"]
            row["peak_mem_delta_gib"] = row["peak_reserved_gib"] - base["peak_reserved_gib"]
    return rows


def columns(rounds: int) -> list[tuple[str, str]]:
    return (
        [("mode", "mode")]
        + [(f"r{i}_step_ms", f"round {i} step ms") for i in range(1, rounds + 1)]
        + COLUMNS_AFTER_ROUNDS
    )


def headline(config: str, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Step ms, peak GiB and layout-conversion share by mode."""
    out = []
    for key, metric, better in (
        ("best_step_ms", "step ms (best round)", "lower"),
        ("tokens_per_s", "tokens/s", "higher"),
        ("peak_reserved_gib", "peak reserved GiB", "lower"),
        ("layout_share_pct", "layout-conversion share %", "lower"),
        ("rs_kernel_ms", "reduce SM kernel ms/step", "lower"),
    ):
        values = {r["mode"]: r.get(key) for r in rows}
        if any(v is not None for v in values.values()):
            out.append(common.headline_row(f"step {config}", metric, values, better))
    return out


def write_outputs(
    stem: Path,
    meta: Mapping[str, Any],
    args: Mapping[str, Any],
    runs: dict,
    profiled: bool,
    floor: Mapping[str, Any] | None = None,
) -> str:
    """``<stem>.json`` / ``.md`` / ``.png`` of a finished benchmark (``args``: the
    command line as a dict; ``floor``: :func:`load_floor` of the config's compute
    floor, or None); returns the Markdown."""
    rows = compare(runs, floor["floor_ms"] if floor else None)
    config, rounds = args["config"], args["rounds"]
    results = {
        "kind": "step",
        "metadata": dict(meta),
        "args": dict(args),
        "runs": runs,
        "rows": rows,
        "floor": dict(floor) if floor else None,
        "tables": [{"title": "Comm modes side by side", "columns": columns(rounds), "rows": rows}],
        "headline": headline(config, rows),
    }
    if any(r.get("bd_step_ms") is not None for r in rows):
        results["tables"].append(
            {
                "title": "Step breakdown of the profiled step (compute stream, mean over ranks)",
                "columns": [("mode", "mode"), *BREAKDOWN_COLUMNS],
                "rows": rows,
            }
        )
    notes = (
        f"{meta['machine']}, torch {meta['torch']}, NCCL {meta['nccl']}, commit "
        f"{meta['commit']}, {meta['date']}. Config `{config}`, {args['steps']} steps per run, "
        f"median of steps after {args['warmup']}, TorchTitan's end-to-end step timer; modes "
        f"interleaved over {rounds} rounds; best = fastest round. Layout conversion: device "
        "time of chunk_cat + split_with_sizes_copy + all_gather_copy_in kernels in the last "
        "step of each mode's round-1 run (profiled, mean over ranks; that step and the one "
        "before are left out of the median), share = that / the run's median step."
        + ("" if profiled else " Not profiled in this run.")
        + (
            " SM MHz / W: nvidia-smi on rank 0's GPU while the run's GPU was busy (>= 50% "
            "utilization), median (the GPU is power-capped: clocks follow the work)."
            if any(r.get("sm_mhz_median") is not None for r in rows)
            else ""
        )
        + (
            f" One process with {WORLD1_FSDP_ENV}=1: FSDP2 over a one-rank mesh, one rank's "
            "compute of the config's multi-GPU step (whole-model shards: optimizer, clip and "
            "layout copies on the whole model's numel; collectives without a peer)."
            if args.get("fsdp_at_world_size_1")
            else ""
        )
        + (
            f" Floor: {floor['floor_ms']:.1f} ms from {floor['file']} (bench_floor.py: the "
            "per-GPU work on one GPU, no communication); gap = best step / floor - 1."
            if floor
            else " No compute floor for this config (run bench_floor.py)."
        )
        + (
            " Breakdown: the profiled step on its compute stream (compute, optimizer, "
            "exposed communication, host-bound and other idle sum to the profiled step; "
            "docs/design/2026-12-01-compute-floor.md)."
            if any(r.get("bd_step_ms") is not None for r in rows)
            else ""
        )
        + "\n"
    )
    labels = [r["mode"] for r in rows]
    charts = [
        common.BarChart(
            "step time (ms, best round)", labels, [r.get("best_step_ms") for r in rows], "ms"
        ),
        common.BarChart(
            "peak reserved memory (GiB)", labels, [r.get("peak_reserved_gib") for r in rows], "GiB"
        ),
    ]
    if any(r.get("layout_share_pct") is not None for r in rows):
        charts.append(
            common.BarChart(
                "layout-conversion share of step (%)",
                labels,
                [r.get("layout_share_pct") for r in rows],
                "%",
            )
        )
    return common.write_result(stem, results, f"Training step: {config}", notes, charts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_out_dir(parser)
    parser.add_argument("--config", default=common.STEP_CONFIG)
    parser.add_argument("--modes", default="fsdp2,symm_mem,tide")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--log-dir", default=os.environ.get("OUT") or tempfile.gettempdir())
    parser.add_argument("--floor-json", default=None,
                        help="bench_floor.py result of the config (default: the newest "
                             "*_floor_<config>.json under --out-dir)")  # fmt: skip
    parser.add_argument("--fsdp-at-world-size-1", action="store_true",
                        help="one GPU: FSDP2 over a one-rank mesh (one rank's work of the "
                             "config's multi-GPU step; TIDE_FSDP_AT_WORLD_SIZE_1)")  # fmt: skip
    args = parser.parse_args(argv)
    floor_path = args.floor_json or find_floor(args.out_dir, Path(args.config).stem)
    floor = load_floor(floor_path) if floor_path else None
    print(f"[bench_step] compute floor: {floor or 'none found under ' + args.out_dir}", flush=True)

    import torch

    modes = args.modes.split(",")
    cuda = torch.cuda.is_available()
    world = torch.cuda.device_count() if cuda else int(os.environ.get("NGPU", "2"))
    profile = args.profile == "on" or (args.profile == "auto" and cuda)
    sm_count = _sm_count() if profile and cuda else 0
    meta = common.metadata(world)
    run_env: dict[str, str] = {}
    if args.fsdp_at_world_size_1:
        if world != 1:
            parser.error(f"--fsdp-at-world-size-1 needs one device; this machine shows {world} "
                         "(set CUDA_VISIBLE_DEVICES to one GPU)")  # fmt: skip
        run_env[WORLD1_FSDP_ENV] = "1"
    if floor and floor["world_size"] not in (None, world):
        print(f"[bench_step] WARNING: {floor['file']} is the floor of a {floor['world_size']}-rank "
              f"step, this run has {world} ranks: floor not used", flush=True)  # fmt: skip
        floor = None
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    # nvidia-smi beside each run (the first visible GPU: rank 0's); no CUDA context here
    sampler = gpu_clock.ClockSampler(gpu_clock.gpu_index()) if cuda else None
    for round_index in range(1, args.rounds + 1):
        for mode in modes:
            profiled = profile and round_index == 1 and args.steps >= PROFILED_STEPS
            with tempfile.TemporaryDirectory() as dump:
                log = Path(args.log_dir) / f"step_{args.config}_{mode}_r{round_index}.log"
                extra = profile_args(args.steps) if profiled else []
                started = time.time()
                code = run_once(args.config, mode, args.steps, Path(dump), log, extra, run_env)
                clock = sampler.window(started, time.time(), busy_only=True) if sampler else None
                metrics = Path(dump) / "metrics.jsonl"
                if code != 0 or not metrics.exists():
                    runs[mode].append(
                        {"error": f"round {round_index}: exit {code}, see {log.name}"}
                    )
                    continue
                if run_env and FSDP_APPLIED_LINE not in log.read_text(errors="replace"):
                    runs[mode].append({"error": f"round {round_index}: FSDP2 was not applied "
                                                f"({FSDP_APPLIED_LINE!r} not in {log.name})"})  # fmt: skip
                    continue
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
                records = [r for r in records if "step" in r]  # not the run header
                summary = summarize_run(records, args.warmup, PROFILED_STEPS if profiled else 0)
                summary["clock"] = clock
                if profiled:
                    try:
                        traces = find_traces(Path(dump))
                        summary["layout"], summary["breakdown"] = profile_from_traces(
                            traces, summary["step_ms"], sm_count
                        )
                    except Exception as e:  # noqa: BLE001 - a bad trace must not lose the run
                        summary["layout"] = {"error": f"{type(e).__name__}: {e}"}
                runs[mode].append(summary)
            shown = {k: v for k, v in runs[mode][-1].items() if k not in ("layout", "breakdown")}
            print(f"[bench_step] round {round_index} {mode}: {shown}", flush=True)

    if sampler:
        sampler.stop()
    # a one-rank run (the one-GPU trainer) is no comparison of comm modes: its own name, so
    # report.py's newest-per-name choice never shows it as the config's multi-GPU step
    name = f"step_world1_{args.config}" if world == 1 else f"step_{args.config}"
    if args.fsdp_at_world_size_1:
        name = f"step_world1_fsdp_{args.config}"
    stem = common.result_stem(args.out_dir, name, meta)
    common.announce_results(stem, write_outputs(stem, meta, vars(args), runs, profile, floor))
    if any(row.get("error") for row in compare(runs)):
        sys.exit(1)


if __name__ == "__main__":
    main()
