"""bench_trace: per-FSDP-group fwd/bwd marks on the debug model (CPU, tiny shapes), the
groups named as the FSDP group model (torchtitan_tide/fsdp_groups.py) names them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
TINY = ["--config", "debug_model", "--training.seq_len", "32", "--training.local_batch_size", "1"]


def run_trace(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """bench_trace.py on the tiny debug model, results under ``tmp_path``."""
    return subprocess.run(
        [sys.executable, str(BENCH / "bench_trace.py"), *args, "--out-dir", str(tmp_path), *TINY],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip


def test_trace_debug_model_on_cpu(tmp_path):
    proc = run_trace(tmp_path, "--device", "cpu", "--iters", "1", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_trace_debug_model.json")
    result = json.loads(path.read_text())
    names = [g["group"] for g in result["groups"]]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm+output"]
    assert all(g["fwd_ms"] > 0 and g["bwd_ms"] > 0 for g in result["groups"])
    assert [g["reshard_after_forward"] for g in result["groups"]][-1] is False
    total = sum(g["fwd_ms"] + g["bwd_ms"] for g in result["groups"])
    parts = total + result["root_fwd_ms"] + result["root_bwd_ms"]
    assert abs(parts - result["fwd_bwd_ms"]) < 1e-6 * max(1.0, result["fwd_bwd_ms"])
    assert result["root_bwd_ms"] >= 0 and result["adamw_ms"] > 0
    assert path.stat().st_size < 20_000  # compact: no chrome trace
    assert result["heat_s"] == 0 and result["heat_iters"] == 0 and result["clock"] is None


def test_trace_world1_precision_on_cpu(tmp_path):
    """--precision world1: what the one-GPU trainer runs (fp32 weights, forward under
    autocast), written as trace_world1_<config>; refused with a world size other than 1."""
    base = ["--device", "cpu", "--iters", "1", "--warmup", "0", "--precision", "world1"]
    bad = run_trace(tmp_path, *base, "--world-size", "2")
    assert bad.returncode != 0 and "--world-size 1" in bad.stderr
    proc = run_trace(tmp_path, *base, "--world-size", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(tmp_path.glob("*_trace_debug_model.json"))
    (path,) = tmp_path.glob("*_trace_world1_debug_model.json")
    result = json.loads(path.read_text())
    assert result["precision"] == "world1" and result["world_size"] == 1
    assert result["work"]["param_dtype"] == "float32 (autocast)"
    assert all(g["fwd_ms"] > 0 and g["bwd_ms"] > 0 for g in result["groups"])


def test_an_optimizer_that_does_not_fit_keeps_the_trace():
    """bench_trace.time_optimizer: out of memory in AdamW gives None and the error, so the
    layer trace measured before it is still written (a world-1 Wan2.2 trace on one H200)."""
    import torch

    sys.path.insert(0, str(BENCH))
    import bench_trace

    calls: list[str] = []

    class Work:
        def adamw(self):
            calls.append("adamw")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 MiB.\nmore")

        def clip(self):
            calls.append("clip")

    timed, error = bench_trace.time_optimizer(Work(), torch.device("cpu"), 1)
    assert timed == {"adamw": None, "clip": None}
    assert error == "out of memory: CUDA out of memory. Tried to allocate 100.00 MiB."
    assert calls == ["adamw"]


def test_kernels_on_cpu_are_named_as_ignored_and_heat_runs_first(tmp_path):
    """--kernels profiles CUDA kernels; on CPU the run says it ignored the option.
    --heat-s runs fwd+bwd before the timed iterations and says so."""
    proc = run_trace(tmp_path, "--device", "cpu", "--iters", "1", "--warmup", "0",
                     "--kernels", "5", "--heat-s", "0.5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--kernels ignored on cpu" in proc.stdout
    (path,) = tmp_path.glob("*_trace_debug_model.json")
    result = json.loads(path.read_text())
    assert result["profiled_iteration"] is None
    assert result["heat_s"] == 0.5 and result["heat_iters"] >= 1  # heated before timing
    assert "Heated 0.5 s" in path.with_suffix(".md").read_text()


@pytest.mark.gpu
def test_kernels_of_a_profiled_iteration_on_gpu(tmp_path):
    """--kernels on CUDA: one more profiled fwd+bwd, its kernel time and the top kernels
    by name, in the time range of the timed iterations."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    proc = run_trace(tmp_path, "--iters", "2", "--warmup", "1", "--kernels", "5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_trace_debug_model.json")
    result = json.loads(path.read_text())
    prof = result["profiled_iteration"]
    assert len(prof["kernels"]) == 5 and all(
        k["ms"] > 0 and k["count"] > 0 for k in prof["kernels"]
    )
    assert 0 < prof["kernel_ms"] < 20 * result["fwd_bwd_ms"] + 50
    if result["clock"] is not None:  # nvidia-smi sampled the timed iterations
        assert result["clock"]["samples"] >= 1 and result["clock"]["sm_mhz_median"] > 0
