"""Tests of the benchmark suite (issue 5): bench_collectives, bench_interference,
bench_step's profiling, report.py and the shared helpers in common.py / harness.py.

CPU: chrome-trace parsing and SM-weighted time on a hand-written trace
(``data/trace_snippet.json``), reference layer shapes, tables / headlines / files
from recorded sample results (``data/*.json``), the report over a results folder,
and ``bench_collectives --smoke-cpu`` on 2 gloo ranks. GPU (``gpu`` mark, 2 GPUs):
every benchmark at a small size into a tmp folder.
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
DATA = Path(__file__).resolve().parent / "data"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_collectives
import bench_interference
import bench_step
import common
import gemms
import harness
import report

SMS = 132  # H200
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def _data(name: str) -> dict:
    return json.loads((DATA / name).read_text())


# ---------------------------------------------------------------- traces


def test_sm_weighted_arithmetic():
    assert common.grid_ctas({"args": {"grid": [4, 2, 3]}}) == 24
    assert common.grid_ctas({"args": {}}) is None
    assert common.sm_weighted_us(100.0, 16, SMS) == pytest.approx(100 * 16 / 132)
    assert common.sm_weighted_us(100.0, 264, SMS) == 100.0  # a full wave and more: whole GPU
    assert common.sm_weighted_us(100.0, None, SMS) == 100.0  # unknown grid: whole GPU


def test_trace_labels_and_device_summary():
    events = common.load_chrome_trace(DATA / "trace_snippet.json")
    labeled = common.label_by_range(events)
    names = {label: [row["name"][:20] for row in rows] for label, rows in _group(labeled).items()}
    # the split kernel starts after bench::rs began but was launched inside bench::ag;
    # the memcpy's launch is not in the trace: it falls back to its start time (in bench::ag)
    assert names == {
        "barrier": ["ncclDevKernel_AllRed"],
        "ag": ["void at::native::mul", "Memcpy PtoP (Device ", "ncclDevKernel_AllGat",
               "void at::native::spl"],
        "rs": ["void at::native::(an", "ncclDevKernel_Reduce"],
    }  # fmt: skip
    ag = common.summarize_device_events([r for lab, r in labeled if lab == "ag"], SMS)
    assert ag["kernel_ms"] == pytest.approx((40 + 100 + 20) / 1e3)
    assert ag["kernel_sm_weighted_ms"] == pytest.approx((40 + 100 * 16 / 132 + 20 * 66 / 132) / 1e3)
    assert ag["nccl_kernel_ms"] == pytest.approx(0.1)
    assert ag["nccl_kernel_sm_weighted_ms"] == pytest.approx(100 * 16 / 132 / 1e3)
    assert ag["memcpy_ms"] == pytest.approx(0.05)  # copy-engine time, not kernel time
    assert ag["kernels"][0]["name"].startswith("ncclDevKernel_AllGather") and (
        ag["kernels"][0]["ctas"] == 16
    )
    rs = common.summarize_device_events([r for lab, r in labeled if lab == "rs"], SMS, steps=2)
    assert rs["kernel_ms"] == pytest.approx(0.23 / 2)
    assert rs["kernel_sm_weighted_ms"] == pytest.approx((30 + 200 * 24 / 132) / 1e3 / 2)


def _group(labeled):
    out: dict[str, list] = {}
    for label, row in labeled:
        out.setdefault(label, []).append(row)
    return out


def test_layout_conversion_by_name_and_launching_op(tmp_path):
    events = common.load_chrome_trace(DATA / "trace_snippet.json")
    layout = common.layout_conversion(events)
    # all_gather_copy_in runs as a generic multi_tensor_apply kernel: found by its CPU op
    assert layout["all_gather_copy_in_ms"] == pytest.approx(0.04)
    assert layout["split_with_sizes_copy_ms"] == pytest.approx(0.02)
    assert layout["chunk_cat_ms"] == pytest.approx(0.03)
    assert layout["total_ms"] == pytest.approx(0.09) and layout["rows"] == 3
    # gzip-compressed traces (torch.profiler writes them for *.json.gz)
    gz = tmp_path / "rank1_trace.json.gz"
    with gzip.open(gz, "wt") as f:
        f.write((DATA / "trace_snippet.json").read_text())
    assert len(common.load_chrome_trace(gz)) == len(events)
    shutil.copy(DATA / "trace_snippet.json", tmp_path / "rank0_trace.json")
    summary = bench_step.layout_from_traces([tmp_path / "rank0_trace.json", gz], step_ms=0.9)
    assert summary["total_ms"] == pytest.approx(0.09)
    assert summary["share_pct"] == pytest.approx(10.0)
    assert summary["nccl_kernel_ms"] == pytest.approx((3 + 100 + 200) / 1e3)
    assert sorted(summary["per_rank"]) == ["rank0", "rank1"]
    assert summary["rs_kernel_ms"] == pytest.approx(0.23)  # no SM count: not weighted
    assert summary["rs_kernel_sm_weighted_ms"] is None
    assert bench_step.layout_from_traces([], step_ms=1.0) == {"error": "no profiler trace found"}


def test_reduce_kernels_inside_fsdp_reduce_range():
    """Kernels launched inside FSDP2's post_backward_reduce range count (chunk_cat and
    the reduce-scatter); the all-gather's kernels and copies outside it do not."""
    events = common.load_chrome_trace(DATA / "trace_snippet.json")
    reduce = common.reduce_kernels(events, SMS, steps=2)
    assert reduce["rows"] == 2
    assert reduce["kernel_ms"] == pytest.approx((30 + 200) / 1e3 / 2)
    assert reduce["kernel_sm_weighted_ms"] == pytest.approx((30 + 200 * 24 / 132) / 1e3 / 2)
    assert reduce["memcpy_ms"] == 0.0
    outside = [e for e in events if not str(e.get("name", "")).startswith("FSDP::")]
    assert common.reduce_kernels(outside, SMS)["rows"] == 0


# ---------------------------------------------------------------- reference layers, launches


def test_reference_layer_sizes():
    full = harness.FULL_LAYERS
    assert full["llama70b"].numel() == 855_654_400  # as bench_ag's Llama-3.1-70B layer
    # (30,532,122,624 - 2 x 151936 x 2048 embeddings - 2048 final norm) / 48 layers
    assert full["qwen3_30b_a3b"].numel() == 623_120_640
    assert full["qwen3_30b_a3b"].params["moe_experts_w1"] == (128, 768, 2048)
    assert full["wan22_a14b"].numel() == 351_394_304
    assert full["wan22_a14b"].params["modulation"] == (1, 6, 5120)
    assert list(harness.SMALL_LAYERS) == list(full)
    for name, spec in harness.SMALL_LAYERS.items():
        assert list(spec.params) == list(full[name].params)


def test_param_block_values_reproducible():
    spec = harness.SMALL_LAYERS["wan22_a14b"]
    block = harness.ParamBlock(spec, torch.device("cpu"))
    assert sum(p.numel() for p in block.parameters()) == spec.numel()
    for name, p in block.named_parameters():
        again = harness.param_value(p.shape, block.seeds[name], torch.device("cpu"))
        assert torch.equal(p.detach(), again) and p.std() > 0
    g = harness.random_grad((4, 5), torch.bfloat16, 7, torch.device("cpu"))
    assert g.dtype == torch.bfloat16 and torch.equal(
        g, harness.random_grad((4, 5), torch.bfloat16, 7, torch.device("cpu"))
    )
    assert harness.grad_seed(0, 1) != harness.grad_seed(1, 0)


def test_group_launches():
    launches = harness.group_launches(["fsdp2", "symm_mem", "tide", "tide_ag"])
    assert launches == [
        harness.Launch(("fsdp2", "tide", "tide_ag"), ()),
        harness.Launch(("symm_mem",), (("NCCL_CTA_POLICY", "2"),)),
    ]


# ---------------------------------------------------------------- recorded results


def _collectives(tmp_path: Path, date: str = "2026-12-01T10:00:00Z", commit: str = "abc1234"):
    results = _data("collectives_raw.json")
    results["metadata"].update(date=date, commit=commit)
    results["config"]["stem"] = str(
        common.result_stem(tmp_path, "collectives", results["metadata"])
    )
    return results


def test_collectives_rows_headline_and_files(tmp_path):
    results = _collectives(tmp_path)
    rows = {r["mode"]: r for r in bench_collectives.table_rows(results)}
    assert list(rows) == ["fsdp2", "symm_mem", "tide"]
    fsdp2, symm, tide = rows["fsdp2"], rows["symm_mem"], rows["tide"]
    assert (fsdp2["ag_r1_ms"], fsdp2["ag_r2_ms"], fsdp2["ag_ms"]) == (5.40, 5.38, 5.38)
    assert fsdp2["rs_ms"] == 10.20 and fsdp2["ag_speedup"] == pytest.approx(1.0)
    assert tide["ag_speedup"] == pytest.approx(5.38 / 3.95)
    assert tide["rs_speedup"] == pytest.approx(10.20 / 7.00)
    nbytes = harness.FULL_LAYERS["llama70b"].numel()
    assert tide["ag_GiBps"] == pytest.approx(2 * nbytes / 2 / 3.95e-3 / 2**30)
    assert tide["rs_GiBps"] == pytest.approx(4 * nbytes / 2 / 7.00e-3 / 2**30)
    assert (tide["rs_kernel_ms"], tide["rs_sm_ms"], tide["rs_memcpy_ms"]) == (0.9, 0.1, 5.5)
    assert tide["apply_mib"] == 1800 and fsdp2["apply_mib"] == 0
    assert fsdp2["rs_peak_mib"] == 4896 and fsdp2["ag_exact"] is True and fsdp2["rs_rel_err"] == 0
    assert symm["ag_ms"] is None and symm["error"].startswith("r1 apply: NotImplementedError")
    assert fsdp2["error"] is None

    text = bench_collectives.write_outputs(results, final=True)
    stem = Path(results["config"]["stem"])
    written = json.loads(stem.with_suffix(".json").read_text())
    assert written["kind"] == "collectives" and tuple(written["metadata"]) == common.METADATA_KEYS
    assert written["tables"][0]["title"].startswith("Times")
    head = {(h["benchmark"], h["metric"]): h for h in written["headline"]}
    assert head[("collectives llama70b", "RS ms")]["values"] == {
        "fsdp2": 10.20,
        "symm_mem": None,
        "tide": 7.00,
    }
    assert "| llama70b | tide | 3.950 | 4.020 | 3.950 |" in text
    assert "`tide_rs_accumulate_fp32`" in text  # top kernels listed
    if _has_matplotlib():
        assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_interference_overlap_and_burst():
    # GEMMs (start, end) from the origin; the collective ended at 3.0 ms
    assert bench_interference.overlapped([(0, 1), (1, 2.5), (2.5, 4.0)], 3.0) == [1, 1.5]
    assert bench_interference.burst_length(6.0, 0.25) == 38  # ceil(1.5 x 24) + 2
    assert bench_interference.burst_length(0.01, 1.4) == bench_interference.MIN_BURST
    assert bench_interference.burst_length(1e6, 0.1) == bench_interference.MAX_BURST


def test_interference_grouped_gemm_is_every_experts_matmul():
    cpu = torch.device("cpu")
    gemm = gemms.build_gemm(bench_interference.SMALL_GEMMS["grouped_experts"], cpu, 0)
    assert isinstance(gemm, gemms.GroupedGemm)
    gemm()
    experts, rows = gemm.w.shape[0], gemm.a.shape[0] // gemm.w.shape[0]
    want = torch.cat([gemm.a[e * rows:(e + 1) * rows].float() @ gemm.w[e].float().T
                      for e in range(experts)])  # fmt: skip
    assert gemm.out.shape == want.shape and want.abs().max() > 1  # random operands, not zeros
    torch.testing.assert_close(gemm.out.float(), want, rtol=2e-2, atol=0.5)
    assert isinstance(gemms.build_gemm((8, 8, 8), cpu, 0), gemms.Gemm)
    assert bench_interference.gemm_label("grouped_experts", (128, 512, 768, 2048)) == (
        "grouped_experts (128 x 512, 768, 2048)"
    )


def test_interference_rows_and_files(tmp_path):
    results = _data("interference_raw.json")
    results["config"]["stem"] = str(tmp_path / "2026-12-01_nvidia-h200-x-2_abc1234_interference")
    rows = bench_interference.table_rows(results)
    by = {(r["gemm"].split(" ")[0], r["op"], r["mode"]): r for r in rows}
    rs = by[("single_wave", "rs", "fsdp2")]
    assert rs["gemm"] == "single_wave (1024, 4096, 8192)"
    assert rs["alone_ms"] == pytest.approx(0.18)
    assert rs["beside_ms"] == pytest.approx(0.18 * (1 + 1.20))  # median of 121% and 119%
    assert rs["slowdown_pct"] == pytest.approx(120.0)
    assert rs["samples"] == 24 and rs["coll_alone_ms"] == 10.2
    assert by[("large", "ag", "tide")]["slowdown_pct"] == pytest.approx(8.0)
    assert by[("single_wave", "ag", "symm_mem")]["error"].startswith("r1: NotImplementedError")
    assert by[("single_wave", "ag", "symm_mem")]["slowdown_pct"] is None
    bench_interference.write_outputs(results, final=True)
    written = json.loads((tmp_path / (Path(results["config"]["stem"]).name + ".json")).read_text())
    assert written["kind"] == "interference"
    metrics = {(h["benchmark"], h["metric"]) for h in written["headline"]}
    assert ("interference single_wave", "GEMM slowdown % beside reduce-scatter") in metrics


def test_step_profiled_steps_left_out():
    records = [
        {"step": s, "time_metrics/end_to_end(s)": 0.5 if s < 9 else 5.0, "throughput(tps)": 1.0,
         "mfu(%)": 1.0, "memory/max_reserved(GiB)": 1.0, "loss_metrics/global_avg_loss": 1.0}
        for s in range(1, 11)
    ]  # fmt: skip
    summary = bench_step.summarize_run(records, warmup=2, profiled_steps=2)
    assert summary["timed_steps"] == [3, 4, 5, 6, 7, 8] and summary["step_ms"] == 500.0
    args = bench_step.profile_args(15)
    assert args[args.index("--profiling.profile_freq") + 1] == "15"
    assert "--profiling.enable_profiling" in args


def test_step_compare_layout_and_headline(tmp_path):
    runs = _data("step_runs.json")
    rows = {r["mode"]: r for r in bench_step.compare(runs)}
    assert rows["fsdp2"]["layout_ms"] == pytest.approx(19.6)
    assert rows["fsdp2"]["layout_share_pct"] == pytest.approx(100 * 19.6 / 505.6)
    assert rows["fsdp2"]["chunk_cat"] == 11.0 and rows["tide"]["layout_ms"] == 0.0
    assert rows["symm_mem"]["error"].startswith("round 2: exit 1")
    assert rows["tide"]["speedup_vs_fsdp2"] == pytest.approx(505.6 / 470.2)
    meta = {**_data("collectives_raw.json")["metadata"]}
    stem = common.result_stem(tmp_path, "step_h200x2_llama70b_4layers", meta)
    args = {"config": "h200x2_llama70b_4layers", "rounds": 2, "steps": 15, "warmup": 5}
    text = bench_step.write_outputs(stem, meta, args, runs, profiled=True)
    assert "| fsdp2 | 505.600 | 506.000 | 505.600 | 1.000 |" in text
    written = json.loads(stem.with_suffix(".json").read_text())
    assert written["kind"] == "step"
    metrics = [h["metric"] for h in written["headline"]]
    assert metrics == [
        "step ms (best round)",
        "tokens/s",
        "peak reserved GiB",
        "layout-conversion share %",
    ]


# ---------------------------------------------------------------- report


def _results_dir(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    bench_collectives.write_outputs(_collectives(out), final=True)
    old = _collectives(out, date="2026-11-29T10:00:00Z", commit="0ld0000")
    bench_collectives.write_outputs(old, final=False)  # older: must not be chosen
    smoke = _collectives(out)
    smoke["config"]["stem"] += "_smoke"
    bench_collectives.write_outputs(smoke, final=False)  # smoke runs stay out
    inter = _data("interference_raw.json")
    inter["config"]["stem"] = str(common.result_stem(out, "interference", inter["metadata"]))
    bench_interference.write_outputs(inter, final=True)
    meta = _data("collectives_raw.json")["metadata"]
    args = {"config": "h200x2_llama70b_4layers", "rounds": 2, "steps": 15, "warmup": 5}
    stem = common.result_stem(out, "step_h200x2_llama70b_4layers", meta)
    bench_step.write_outputs(stem, meta, args, _data("step_runs.json"), profiled=True)
    for name in (
        "2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_qwen3_30b_a3b_4layers.json",
        "2026-12-01_model_abc1234_projection_llama70b_64gpu.json",
    ):
        shutil.copy(DATA / name, out / name)
    (out / "notes.json").write_text("[1, 2]")  # not a result: ignored
    return out


def test_report_from_results_dir(tmp_path):
    out = _results_dir(tmp_path)
    assert report.main(["--results-dir", str(out)]) == 0
    md = out / "2026-12-01_nvidia-h200-x-2_abc1234_report.md"
    text = md.read_text()
    assert text.startswith("# Benchmark report: NVIDIA H200 x 2, commit abc1234")
    assert "| torch | 2.11.0+cu130 |" in text and "| NCCL | 2.28.9 |" in text
    assert "| GPUs (world size) | 2 |" in text
    header = next(line for line in text.splitlines() if line.startswith("| benchmark | metric"))
    assert header.endswith("| fsdp2 | symm_mem | tide | symm_mem / fsdp2 | tide / fsdp2 |")
    step_row = next(line for line in text.splitlines() if "step ms (best round)" in line)
    assert "step h200x2_llama70b_4layers" in step_row and f"{470.2 / 505.6:.3f}" in step_row
    assert "step h200x2_qwen3_30b_a3b_4layers" in text  # file without "kind": inferred
    assert "## Projections (model estimates, not measurements)" in text
    projection = text.split("## Projections")[1]
    assert "| llama70b | 64 | tide | 760.000 | 0.400 |" in projection
    headline = text.split("## Headline")[1].split("\n## ")[0]
    assert "projection" not in headline and "760" not in headline  # measured figures only
    assert "![collectives](2026-12-01_nvidia-h200-x-2_abc1234_collectives.png)" in text or (
        not _has_matplotlib()
    )
    sources = text.split("## Sources")[1]
    assert "0ld0000" not in sources and "_smoke" not in sources
    assert "2026-12-01_nvidia-h200-x-2_abc1234_interference.json" in sources
    if _has_matplotlib():
        assert (out / "2026-12-01_nvidia-h200-x-2_abc1234_report.png").read_bytes()[:4] == (
            b"\x89PNG"
        )
        assert "![headline: step time per mode](2026-12-01_nvidia-h200-x-2_abc1234_report.png)" in text


def test_report_given_files_and_empty(tmp_path, capsys):
    out = _results_dir(tmp_path)
    legacy = out / "2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_qwen3_30b_a3b_4layers.json"
    dest = tmp_path / "rep"
    assert report.main([str(legacy), "--out-dir", str(dest)]) == 0
    (md,) = dest.glob("*_report.md")
    assert md.name == "2026-11-30_nvidia-h200-x-2_7334fb3_report.md"
    assert "| step h200x2_qwen3_30b_a3b_4layers | step ms (best round) | lower |" in md.read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main(["--results-dir", str(empty)]) == 1
    # Two given results of one (kind, name): each benchmark label names its commit.
    old = json.loads(legacy.read_text())
    old["metadata"]["commit"] = "0ld0000"
    twin = out / "2026-11-29_nvidia-h200-x-2_0ld0000_step_h200x2_qwen3_30b_a3b_4layers.json"
    twin.write_text(json.dumps(old))
    both = tmp_path / "both"
    assert report.main([str(legacy), str(twin), "--out-dir", str(both)]) == 0
    (md,) = both.glob("*_report.md")
    text = md.read_text()
    for commit in ("7334fb3", "0ld0000"):
        assert f"| step h200x2_qwen3_30b_a3b_4layers @{commit} | step ms (best round) |" in text


def test_report_generic_projection_tables():
    data = {"kind": "projection", "rows": [{"a": 1, "b": {"nested": 1}}, {"a": 2, "c": "x"}]}
    (table,) = report.generic_tables(data)
    assert table["columns"] == [("a", "a"), ("c", "c")]  # nested values left out


# ---------------------------------------------------------------- whole scripts


@pytest.mark.slow
def test_collectives_smoke_cpu(tmp_path):
    """bench_collectives on 2 CPU gloo ranks, tiny Wan2.2 block (uneven dim-0 shards)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_collectives.py"), "--smoke-cpu", "--iters", "1",
         "--layers", "wan22_a14b", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_collectives_smoke.json")
    res = json.loads(js.read_text())
    assert res["kind"] == "collectives" and res["status"] == "complete"
    assert tuple(res["metadata"]) == common.METADATA_KEYS
    assert res["launches"] == [{"modes": ["fsdp2", "tide"], "env": {}, "error": None,
                                "wall_s": res["launches"][0]["wall_s"]}]  # fmt: skip
    rows = {r["mode"]: r for r in res["tables"][0]["rows"]}
    for mode in ("fsdp2", "tide"):
        assert rows[mode]["error"] is None, rows[mode]["error"]
        assert rows[mode]["ag_ms"] > 0 and rows[mode]["rs_ms"] > 0
        assert rows[mode]["ag_exact"] is True and rows[mode]["rs_rel_err"] <= 1e-5
    assert "| wan22_a14b | tide |" in proc.stdout


def _run_gpu(*args: str, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        check=False,
    )  # fmt: skip


@pytest.mark.gpu
@two_gpus
def test_gpu_collectives_small(tmp_path):
    proc = _run_gpu(str(BENCH / "bench_collectives.py"), "--small", "--iters", "3", "--modes",
                    "fsdp2,symm_mem,tide", "--layers", "llama70b", "--out-dir",
                    str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_collectives_small.json")
    rows = {r["mode"]: r for r in json.loads(js.read_text())["tables"][0]["rows"]}
    for mode in ("fsdp2", "symm_mem", "tide"):
        row = rows[mode]
        assert row["error"] is None, row["error"]
        assert row["ag_exact"] is True and row["rs_rel_err"] <= 1e-5
        assert row["ag_peak_mib"] is not None and row["rs_kernel_ms"] is not None
    assert rows["fsdp2"]["rs_kernel_ms"] > 0 and rows["fsdp2"]["ag_kernel_ms"] > 0


@pytest.mark.gpu
@two_gpus
def test_gpu_interference_small(tmp_path):
    proc = _run_gpu(str(BENCH / "bench_interference.py"), "--small", "--reps", "2",
                    "--modes", "fsdp2,symm_mem", "--out-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_interference_small.json")
    rows = json.loads(js.read_text())["tables"][0]["rows"]
    assert rows and all(r["error"] is None for r in rows), rows
    assert all(r["alone_ms"] and r["coll_alone_ms"] for r in rows)
    assert {r["mode"] for r in rows} == {"fsdp2", "symm_mem"}
    grouped = [r for r in rows if r["gemm"].startswith("grouped_experts")]
    assert grouped and all(r["slowdown_pct"] is not None and r["beside_ms"] for r in grouped)


@pytest.mark.gpu
def test_gpu_accumulate_small(tmp_path):
    proc = _run_gpu(str(BENCH / "bench_accumulate.py"), "--numel", str(3 * 2**20 + 5),
                    "--iters", "2", "--out-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_accumulate.json")
    rows = json.loads(js.read_text())["tables"][0]["rows"]
    assert all(r["error"] is None and r["best_ms"] > 0 for r in rows), rows
    assert sum("(default)" in r["variant"] for r in rows) == 1


@pytest.mark.gpu
@two_gpus
def test_gpu_step_profiled(tmp_path):
    proc = _run_gpu(str(BENCH / "bench_step.py"), "--config", "debug_model", "--steps", "4",
                    "--warmup", "1", "--rounds", "1", "--modes", "fsdp2", "--out-dir",
                    str(tmp_path), "--log-dir", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_step_debug_model.json")
    res = json.loads(js.read_text())
    (row,) = res["rows"]
    assert row["best_step_ms"] > 0
    layout = res["runs"]["fsdp2"][0]["layout"]
    assert "error" not in layout, layout
    assert layout["chunk_cat_ms"] > 0 and layout["split_with_sizes_copy_ms"] > 0
    assert row["layout_share_pct"] > 0
    # the reduce's kernels include chunk_cat (found through FSDP2's reduce range)
    assert row["rs_kernel_ms"] >= layout["chunk_cat_ms"] > 0
    assert 0 < row["rs_kernel_sm_weighted_ms"] <= row["rs_kernel_ms"]
    # the step breakdown of the profiled step sums to it (2 ranks: collectives on side streams)
    parts = [row[f"bd_{k}"] for k in ("compute_ms", "optimizer_ms", "exposed_comm_ms",
                                      "host_bound_ms", "other_idle_ms")]  # fmt: skip
    assert sum(parts) == pytest.approx(row["bd_step_ms"], rel=1e-9)
    assert row["bd_compute_ms"] > 0 and row["bd_optimizer_ms"] > 0 and row["bd_comm_busy_ms"] > 0


def test_results_json_is_self_describing():
    """Every new result kind carries what report.py reads (schema check on fixtures)."""
    results = copy.deepcopy(_data("collectives_raw.json"))
    results["config"]["stem"] = "/nonexistent/x"
    rows = bench_collectives.table_rows(results)
    heads = bench_collectives.headline(results, rows)
    for h in heads:
        assert set(h) == {"benchmark", "metric", "better", "values"}
        assert h["better"] in ("lower", "higher")
    with pytest.raises(ValueError):
        common.headline_row("b", "m", {}, better="sideways")


def test_report_step_floors_and_headings(tmp_path):
    """Floors: the step rows' floor_ms, else the newest *_floor_<config>.json, else none;
    twin results get their commit in the heading; no empty status."""
    out = _results_dir(tmp_path)
    step = next(r for f in sorted(out.glob("*_step_h200x2_llama70b_4layers.json"))
                if (r := report.load_result(f)) is not None)
    assert report.step_floor(step) is None
    (out / "2026-12-01_h200_aaa_floor_h200x2_llama70b_4layers.json").write_text('{"floor_ms": 430.0}')
    (out / "2026-12-02_h200_bbb_floor_h200x2_llama70b_4layers.json").write_text('{"floor_ms": 431.5}')
    floor = report.step_floor(step)
    assert (floor.low, floor.source) == (431.5, "2026-12-02_h200_bbb_floor_h200x2_llama70b_4layers.json")
    data = json.loads(step.path.read_text())
    data["rows"][0]["floor_ms"] = 425.0
    with_rows = report.Result(step.path, data, "step", step.name)
    assert report.step_floor(with_rows).low == 425.0
    wan = report.Result(step.path, {"args": {"config": "h200x2_wan22_a14b_20layers"}}, "step",
                        "step_h200x2_wan22_a14b_20layers")
    assert report.step_floor(wan) is None
    (panel,) = report.step_panels([step])
    assert panel["modes"][0] == "fsdp2" and panel["title"] == "Llama-3.1-70B, 4 layers"
    assert panel["ms"][panel["modes"].index("tide")] == 470.2

    legacy = out / "2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_qwen3_30b_a3b_4layers.json"
    old = json.loads(legacy.read_text())
    old["metadata"]["commit"] = "0ld0000"
    twin = out / "2026-11-29_nvidia-h200-x-2_0ld0000_step_h200x2_qwen3_30b_a3b_4layers.json"
    twin.write_text(json.dumps(old))
    assert report.main([str(legacy), str(twin), "--out-dir", str(tmp_path / "both")]) == 0
    (md,) = (tmp_path / "both").glob("*_report.md")
    headings = [line for line in md.read_text().splitlines() if line.startswith("## ")]
    assert len(headings) == len(set(headings)), headings
    assert "## Training step: `step_h200x2_qwen3_30b_a3b_4layers` @0ld0000" in headings
    assert "status -" not in md.read_text()
