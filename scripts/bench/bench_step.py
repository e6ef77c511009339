"""Training-step benchmark: the same config under every comm mode, side by side.

Runs ``./run_train.sh --config CONFIG --tide.comm MODE`` for each mode, ``--rounds``
times interleaved (round 1: all modes, round 2: all modes), reads each run's
``metrics.jsonl`` and reports per mode: median step time after ``--warmup`` steps
(TorchTitan's end-to-end step timer), tokens/s, MFU, peak reserved memory, first/last
loss, and the ratio to ``fsdp2``. Writes ``<date>_<machine>_<commit>_step_<config>.{json,md,png}``.

    python scripts/bench/bench_step.py --out-dir bench/results \\
        [--config h200x2_llama70b_4layers] [--modes fsdp2,tide] [--steps 15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

REPO = Path(__file__).resolve().parents[2]


def run_once(config: str, mode: str, steps: int, dump_folder: Path, log_path: Path) -> int:
    """One training run; returns its exit code (output in ``log_path``)."""
    cmd = [str(REPO / "run_train.sh"), "--config", config, "--tide.comm", mode,
           "--training.steps", str(steps), "--job.dump_folder", str(dump_folder),
           "--metrics.log_freq", "1"]
    with open(log_path, "w") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def summarize_run(records: list[dict], warmup: int) -> dict:
    """Median step figures of one run's metrics records (steps after ``warmup``)."""
    timed = [r for r in records if r["step"] > warmup] or records
    return {
        "steps": len(records),
        "step_ms": 1000 * common.median([r["time_metrics/end_to_end(s)"] for r in timed]),
        "tokens_per_s": common.median([r["throughput(tps)"] for r in timed]),
        "mfu_pct": common.median([r["mfu(%)"] for r in timed]),
        "peak_reserved_gib": max(r["memory/max_reserved(GiB)"] for r in records),
        "first_loss": records[0]["loss_metrics/global_avg_loss"],
        "last_loss": records[-1]["loss_metrics/global_avg_loss"],
    }


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per mode: both rounds' medians, the best, and ratios to fsdp2's best."""
    rows = []
    for mode, per_round in runs.items():
        ok = [r for r in per_round if "error" not in r]
        row = {"mode": mode, "error": "; ".join(r["error"] for r in per_round if "error" in r) or None}
        for i, result in enumerate(per_round, start=1):
            row[f"r{i}_step_ms"] = result.get("step_ms")
        if ok:
            best = min(ok, key=lambda r: r["step_ms"])
            row.update(best_step_ms=best["step_ms"], tokens_per_s=best["tokens_per_s"],
                       mfu_pct=best["mfu_pct"], peak_reserved_gib=max(r["peak_reserved_gib"] for r in ok),
                       first_loss=best["first_loss"], last_loss=best["last_loss"])
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "fsdp2" and r.get("best_step_ms")), None)
    for row in rows:
        if base and row.get("best_step_ms"):
            row["speedup_vs_fsdp2"] = base["best_step_ms"] / row["best_step_ms"]
            row["peak_mem_delta_gib"] = row["peak_reserved_gib"] - base["peak_reserved_gib"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--config", default="h200x2_llama70b_4layers")
    parser.add_argument("--modes", default="fsdp2,tide")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log-dir", default=os.environ.get("OUT") or tempfile.gettempdir())
    args = parser.parse_args()

    import torch

    modes = args.modes.split(",")
    world = torch.cuda.device_count() if torch.cuda.is_available() else int(os.environ.get("NGPU", 2))
    meta = common.metadata(world)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(1, args.rounds + 1):
        for mode in modes:
            with tempfile.TemporaryDirectory() as dump:
                log = Path(args.log_dir) / f"step_{args.config}_{mode}_r{round_index}.log"
                code = run_once(args.config, mode, args.steps, Path(dump), log)
                metrics = Path(dump) / "metrics.jsonl"
                if code != 0 or not metrics.exists():
                    runs[mode].append({"error": f"round {round_index}: exit {code}, see {log.name}"})
                    continue
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
                runs[mode].append(summarize_run(records, args.warmup))
            print(f"[bench_step] round {round_index} {mode}: {runs[mode][-1]}", flush=True)

    rows = compare(runs)
    stem = common.result_stem(args.out_dir, f"step_{args.config}", meta)
    common.write_json(stem.with_suffix(".json"), {"metadata": meta, "args": vars(args), "runs": runs, "rows": rows})
    columns = [("mode", "mode")] + [(f"r{i}_step_ms", f"round {i} step ms") for i in range(1, args.rounds + 1)] + [
        ("best_step_ms", "best step ms"), ("speedup_vs_fsdp2", "speed-up vs fsdp2"),
        ("tokens_per_s", "tokens/s"), ("mfu_pct", "MFU %"), ("peak_reserved_gib", "peak GiB"),
        ("peak_mem_delta_gib", "peak vs fsdp2 GiB"), ("first_loss", "first loss"),
        ("last_loss", "last loss"), ("error", "error")]
    notes = (f"\n{meta['machine']}, torch {meta['torch']}, NCCL {meta['nccl']}, commit {meta['commit']}, "
             f"{meta['date']}. Config `{args.config}`, {args.steps} steps per run, median of steps after "
             f"{args.warmup}, TorchTitan's end-to-end step timer; modes interleaved over {args.rounds} rounds; "
             "best = fastest round.\n")
    text = common.write_markdown_table(stem.with_suffix(".md"), rows, columns,
                                       title=f"Training step: {args.config}", extra=notes)
    labels = [r["mode"] for r in rows]
    common.write_bar_png(stem.with_suffix(".png"), [
        common.BarChart(title="step time (ms, best round)", labels=labels,
                        values=[r.get("best_step_ms") for r in rows], ylabel="ms"),
        common.BarChart(title="peak reserved memory (GiB)", labels=labels,
                        values=[r.get("peak_reserved_gib") for r in rows], ylabel="GiB"),
    ], title=f"{args.config} on {meta['machine']}")
    print(text)
    if any(row.get("error") for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
