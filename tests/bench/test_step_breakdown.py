"""step_breakdown on hand-written traces: every category with its exact expected value."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import step_breakdown as sb

HOST, DEV = {"pid": 1, "tid": 1}, 0


def launch(corr: int, ts: float, dur: float = 1.0, name: str = "cudaLaunchKernel") -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, **HOST, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}  # fmt: skip


def row(corr: int | None, stream: int, ts: float, dur: float, name: str = "gemm",
        cat: str = "kernel") -> dict:  # fmt: skip
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": DEV, "tid": stream, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def host(name: str, ts: float, dur: float, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "cat": cat, "name": name, **HOST, "ts": ts, "dur": dur}


def step_trace() -> list[dict]:
    """One step, window [0, 1000) us; compute stream 7, all-gathers on 20, RS on 21."""
    return [
        host("ProfilerStep#7", 0, 1000),
        # first all-gather (a copy-engine copy), then the first compute kernel, launched
        # early (host-bound until 55, then a wait the AG ends at 150: exposed first)
        launch(1, 10, 5, "cudaMemcpyAsync"), row(1, 20, 20, 130, "Memcpy PtoP", "gpu_memcpy"),
        launch(2, 50, 5), row(2, 7, 160, 140),
        launch(3, 60, 2), row(3, 7, 300, 100),
        # host-bound gap [400, 445) + 5 us of launch latency (other)
        launch(4, 440, 5), row(4, 7, 450, 50),
        # a wait the second all-gather ends (exposed between): [500, 560)
        launch(5, 300, 2, "cuLaunchKernelEx"), row(5, 20, 420, 120, "ncclDevKernel_AllGather"),
        launch(6, 446, 2), row(6, 7, 560, 40),
        launch(7, 449, 1), row(7, 7, 600, 100),  # last backward kernel
        # the last reduce-scatter ends at 760 inside the gap before the clip (exposed last)
        launch(8, 452, 1), row(8, 21, 650, 110, "ncclDevKernel_ReduceScatter_Sum_f32"),
        host("aten::_foreach_norm", 600, 10, "cpu_op"),
        launch(9, 602, 1), row(9, 7, 780, 20, "multi_tensor_apply_kernel L2Norm"),
        host("Optimizer.step#AdamW.step", 620, 80),
        launch(10, 630, 1), row(10, 7, 800, 100, "fused_adamw"),
        # logging after the optimizer: host-bound [900, 945), 5 us other, tail host-bound
        launch(11, 940, 5), row(11, 7, 950, 10, "copy"),
        row(None, 7, 1010, 10),  # after the window: ignored
    ]  # fmt: skip


def test_every_category_of_a_step():
    bd = sb.step_breakdown(step_trace())
    expect = {
        "step_ms": 1.0, "compute_ms": 0.440, "optimizer_ms": 0.120, "exposed_comm_ms": 0.245,
        "host_bound_ms": 0.185, "other_idle_ms": 0.010, "exposed_first_ms": 0.105,
        "exposed_between_ms": 0.060, "exposed_last_ms": 0.080, "comm_busy_ms": 0.360,
        "comm_hidden_ms": 0.100,
    }  # fmt: skip
    for key, value in expect.items():
        assert bd[key] == pytest.approx(value, abs=1e-12), key
    assert sum(bd[k] for k in sb.PARTS) == pytest.approx(bd["step_ms"], abs=1e-12)
    assert (bd["window"], bd["compute_stream"], bd["gaps"]) == ("ProfilerStep#7", "0:7", 6)


def test_last_profiler_step_is_the_window():
    events = [host("ProfilerStep#6", -500, 400), *step_trace()]
    assert sb.step_breakdown(events)["window"] == "ProfilerStep#7"


def test_device_span_without_step_range_and_unlaunched_rows_count_as_queued():
    events = [
        row(None, 7, 0, 10),
        row(None, 7, 30, 10),
        row(None, 9, 5, 20, "Memcpy", "gpu_memcpy"),
    ]
    bd = sb.step_breakdown(events)
    assert bd["window"] == "device span" and bd["step_ms"] == pytest.approx(0.040)
    assert bd["compute_ms"] == pytest.approx(0.020)
    assert bd["exposed_comm_ms"] == bd["exposed_between_ms"] == pytest.approx(0.020)
    assert bd["host_bound_ms"] == bd["other_idle_ms"] == 0.0


def test_wait_without_a_collective_ending_is_other_idle():
    events = [host("ProfilerStep#1", 0, 100), launch(1, 0), row(1, 7, 10, 10),
              launch(2, 5), row(2, 7, 50, 10), row(None, 9, 0, 100, "Memcpy", "gpu_memcpy")]  # fmt: skip
    bd = sb.step_breakdown(events)
    # head gap [0, 10): host until 1, wait 9 with the copy still running -> other
    assert bd["host_bound_ms"] == pytest.approx(0.001 + 0.040)  # + tail [60, 100)
    assert bd["other_idle_ms"] == pytest.approx(0.009 + 0.030)
    assert bd["exposed_comm_ms"] == 0.0
    assert bd["comm_hidden_ms"] == pytest.approx(0.020)


def test_compute_stream_ignores_nccl_kernels_and_can_be_forced():
    events = [host("ProfilerStep#1", 0, 100), row(None, 7, 0, 10),
              row(None, 8, 0, 90, "ncclDevKernel_AllGather")]  # fmt: skip
    assert sb.step_breakdown(events)["compute_stream"] == "0:7"
    forced = sb.step_breakdown(events, stream=(0, 8))
    assert forced["compute_ms"] == pytest.approx(0.090) and forced["comm_busy_ms"] == pytest.approx(
        0.010
    )


def test_recorded_snippet_sums_to_its_span(repo):
    events = json.loads((repo / "tests/bench/data/trace_snippet.json").read_text())["traceEvents"]
    bd = sb.step_breakdown(events)
    assert bd["compute_stream"] == "0:7" and bd["window"] == "device span"
    assert sum(bd[k] for k in sb.PARTS) == pytest.approx(bd["step_ms"])


def test_no_compute_kernel_is_an_error():
    with pytest.raises(ValueError, match="no compute kernel"):
        sb.step_breakdown([host("ProfilerStep#1", 0, 10)])


def test_mean_over_ranks():
    mean = sb.mean_breakdown({"rank0": {"step_ms": 1.0, "window": "x"}, "rank1": {"step_ms": 3.0}})
    assert mean == {"step_ms": 2.0}


@pytest.mark.gpu
def test_gpu_breakdown_of_a_real_one_gpu_step(tmp_path, repo):
    """bench_step on ONE GPU (no FSDP): TorchTitan's profiled trace parses, the step
    window and optimizer phase are found, the parts sum to the profiled step."""
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu}
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts/bench/bench_step.py"), "--config", "debug_model",
         "--steps", "4", "--warmup", "1", "--rounds", "1", "--modes", "fsdp2", "--out-dir",
         str(tmp_path), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=420, cwd=repo, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_step_world1_debug_model.json")
    res = json.loads(js.read_text())
    breakdown = res["runs"]["fsdp2"][0]["breakdown"]
    assert "error" not in breakdown, breakdown
    (rank,) = breakdown["per_rank"].values()
    assert rank["window"].startswith("ProfilerStep#")
    assert sum(rank[k] for k in sb.PARTS) == pytest.approx(rank["step_ms"], rel=1e-9)
    assert rank["compute_ms"] > 0 and rank["optimizer_ms"] > 0
    assert "## Step breakdown of the profiled step" in js.with_suffix(".md").read_text()
