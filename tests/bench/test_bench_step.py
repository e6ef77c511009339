"""bench_step's arithmetic on recorded metrics (no training)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_step


def record(step: int, seconds: float, loss: float, peak: float) -> dict:
    return {"step": step, "time_metrics/end_to_end(s)": seconds, "throughput(tps)": 8192 / seconds,
            "mfu(%)": 40.0, "memory/max_reserved(GiB)": peak, "loss_metrics/global_avg_loss": loss}


def test_summarize_skips_warmup_and_takes_medians():
    records = [record(s, 2.0 if s <= 2 else 0.5 + 0.01 * s, 10.0 - s, 70.0 + s) for s in range(1, 8)]
    summary = bench_step.summarize_run(records, warmup=2)
    assert summary["steps"] == 7
    assert abs(summary["step_ms"] - 550.0) < 1e-9  # median of steps 3..7 = step 5
    assert summary["peak_reserved_gib"] == 77.0
    assert (summary["first_loss"], summary["last_loss"]) == (9.0, 3.0)


def test_compare_reports_best_round_and_ratios():
    runs = {
        "fsdp2": [{"step_ms": 510.0, "tokens_per_s": 1.0, "mfu_pct": 1.0, "peak_reserved_gib": 80.0,
                   "first_loss": 12.0, "last_loss": 5.7},
                  {"step_ms": 500.0, "tokens_per_s": 2.0, "mfu_pct": 1.0, "peak_reserved_gib": 80.0,
                   "first_loss": 12.0, "last_loss": 5.7}],
        "tide": [{"step_ms": 400.0, "tokens_per_s": 3.0, "mfu_pct": 1.0, "peak_reserved_gib": 78.0,
                  "first_loss": 12.0, "last_loss": 5.7},
                 {"error": "round 2: exit 1"}],
    }
    rows = {row["mode"]: row for row in bench_step.compare(runs)}
    assert rows["fsdp2"]["best_step_ms"] == 500.0 and rows["fsdp2"]["speedup_vs_fsdp2"] == 1.0
    assert rows["tide"]["speedup_vs_fsdp2"] == 500.0 / 400.0
    assert rows["tide"]["peak_mem_delta_gib"] == -2.0
    assert rows["tide"]["error"] == "round 2: exit 1"
    assert rows["tide"]["r2_step_ms"] is None
