"""bench_step's arithmetic on recorded metrics, floors and traces (no training)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_step


def record(step: int, seconds: float, loss: float, peak: float) -> dict:
    return {
        "step": step,
        "time_metrics/end_to_end(s)": seconds,
        "throughput(tps)": 8192 / seconds,
        "mfu(%)": 40.0,
        "memory/max_reserved(GiB)": peak,
        "loss_metrics/global_avg_loss": loss,
    }


def test_summarize_skips_warmup_and_takes_medians():
    records = [
        record(s, 2.0 if s <= 2 else 0.5 + 0.01 * s, 10.0 - s, 70.0 + s) for s in range(1, 8)
    ]
    summary = bench_step.summarize_run(records, warmup=2)
    assert summary["steps"] == 7
    assert abs(summary["step_ms"] - 550.0) < 1e-9  # median of steps 3..7 = step 5
    assert summary["peak_reserved_gib"] == 77.0
    assert (summary["first_loss"], summary["last_loss"]) == (9.0, 3.0)


def test_compare_reports_best_round_and_ratios():
    runs = {
        "fsdp2": [
            {
                "step_ms": 510.0,
                "tokens_per_s": 1.0,
                "mfu_pct": 1.0,
                "peak_reserved_gib": 80.0,
                "first_loss": 12.0,
                "last_loss": 5.7,
            },
            {
                "step_ms": 500.0,
                "tokens_per_s": 2.0,
                "mfu_pct": 1.0,
                "peak_reserved_gib": 80.0,
                "first_loss": 12.0,
                "last_loss": 5.7,
            },
        ],
        "tide": [
            {
                "step_ms": 400.0,
                "tokens_per_s": 3.0,
                "mfu_pct": 1.0,
                "peak_reserved_gib": 78.0,
                "first_loss": 12.0,
                "last_loss": 5.7,
            },
            {"error": "round 2: exit 1"},
        ],
    }
    rows = {row["mode"]: row for row in bench_step.compare(runs)}
    assert rows["fsdp2"]["best_step_ms"] == 500.0 and rows["fsdp2"]["speedup_vs_fsdp2"] == 1.0
    assert rows["tide"]["speedup_vs_fsdp2"] == 500.0 / 400.0
    assert rows["tide"]["peak_mem_delta_gib"] == -2.0
    assert rows["tide"]["error"] == "round 2: exit 1"
    assert rows["tide"]["r2_step_ms"] is None


def write_floor(path: Path, floor_ms, date: str, world_size: int = 2) -> Path:
    path.write_text(json.dumps({"kind": "floor", "floor_ms": floor_ms, "config": "cfg",
                                "world_size": world_size,
                                "metadata": {"date": date, "commit": "abc", "machine": "m"}}))  # fmt: skip
    return path


def test_newest_floor_is_found_and_gives_the_gap(tmp_path):
    assert bench_step.find_floor(tmp_path, "cfg") is None
    write_floor(tmp_path / "2026-12-02_m_aaa_floor_cfg.json", 300.0, "2026-12-01T09:00:00Z")
    newest = write_floor(
        tmp_path / "2026-12-01_m_bbb_floor_cfg.json", 400.0, "2026-12-01T10:00:00Z"
    )
    write_floor(tmp_path / "2026-12-03_m_ccc_floor_other.json", 1.0, "2026-12-03T10:00:00Z")
    assert bench_step.find_floor(tmp_path, "cfg") == newest
    floor = bench_step.load_floor(newest)
    assert (floor["floor_ms"], floor["file"], floor["world_size"]) == (400.0, newest.name, 2)
    runs = {"fsdp2": [{"step_ms": 500.0, "tokens_per_s": 1.0, "mfu_pct": 1.0,
                       "peak_reserved_gib": 80.0, "first_loss": 12.0, "last_loss": 5.7}],
            "tide": [{"error": "round 1: exit 1"}]}  # fmt: skip
    rows = {row["mode"]: row for row in bench_step.compare(runs, floor_ms=400.0)}
    assert rows["fsdp2"]["floor_ms"] == 400.0 and rows["fsdp2"]["gap_to_floor_pct"] == 25.0
    assert rows["tide"]["floor_ms"] == 400.0 and "gap_to_floor_pct" not in rows["tide"]
    assert "floor_ms" not in bench_step.compare(runs)[0]


def test_a_file_without_floor_ms_is_a_named_error(tmp_path):
    bad = write_floor(tmp_path / "x_floor_cfg.json", None, "2026-12-01T10:00:00Z")
    with pytest.raises(ValueError, match="x_floor_cfg.json: no top-level floor_ms"):
        bench_step.load_floor(bad)


def test_breakdown_and_floor_reach_rows_json_and_markdown(tmp_path, repo):
    shutil.copy(repo / "tests/bench/data/trace_snippet.json", tmp_path / "rank0_trace.json")
    layout, breakdown = bench_step.profile_from_traces([tmp_path / "rank0_trace.json"], 1.0)
    assert layout["total_ms"] > 0 and breakdown["per_rank"]["rank0"]["window"] == "device span"
    parts = ("compute_ms", "optimizer_ms", "exposed_comm_ms", "host_bound_ms", "other_idle_ms")
    assert sum(breakdown[k] for k in parts) == pytest.approx(breakdown["step_ms"])
    run = {"step_ms": 2.0, "tokens_per_s": 1.0, "mfu_pct": 1.0, "peak_reserved_gib": 1.0,
           "first_loss": 2.0, "last_loss": 1.0, "layout": layout, "breakdown": breakdown}  # fmt: skip
    meta = {"machine": "m", "torch": "t", "nccl": None, "commit": "abc", "date": "2026-12-01"}
    args = {"config": "cfg", "rounds": 1, "steps": 4, "warmup": 1}
    floor = {"floor_ms": 1.6, "file": "f_floor_cfg.json"}
    text = bench_step.write_outputs(tmp_path / "out", meta, args, {"tide": [run]}, True, floor)
    saved = json.loads((tmp_path / "out.json").read_text())
    (row,) = saved["rows"]
    assert row["bd_step_ms"] == pytest.approx(breakdown["step_ms"])
    assert row["bd_exposed_comm_ms"] == pytest.approx(breakdown["exposed_comm_ms"])
    assert (
        row["gap_to_floor_pct"] == pytest.approx(25.0) and saved["floor"]["file"] == floor["file"]
    )
    assert "## Step breakdown of the profiled step" in text and "gap to floor %" in text
    assert "Floor: 1.6 ms from f_floor_cfg.json" in text


def test_the_best_runs_clock_reaches_its_row():
    """nvidia-smi's busy SM clock and power of the best run are row columns (the GPU is
    power-capped: a step time is read beside its clock); a run without samples has none."""
    base = {"tokens_per_s": 1.0, "mfu_pct": 1.0, "peak_reserved_gib": 80.0, "first_loss": 12.0,
            "last_loss": 5.7}  # fmt: skip
    clock = {"samples": 9, "sm_mhz_median": 1740.0, "sm_mhz_min": 1500.0, "sm_mhz_max": 1980.0,
             "temp_c_max": 66.0, "power_w_median": 690.0}  # fmt: skip
    runs = {
        "fsdp2": [
            {**base, "step_ms": 510.0, "clock": None},
            {**base, "step_ms": 500.0, "clock": clock},
        ],
        "tide": [{**base, "step_ms": 400.0, "clock": None}],
    }
    rows = {r["mode"]: r for r in bench_step.compare(runs)}
    assert rows["fsdp2"]["sm_mhz_median"] == 1740.0 and rows["fsdp2"]["power_w_median"] == 690.0
    assert "sm_mhz_median" not in rows["tide"]
