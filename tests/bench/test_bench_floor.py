"""bench_floor: its arithmetic, its config checks, and whole runs at a tiny size on CPU
(debug_model end to end; the Wan2.2 path with its own data, loss and full AC). GPU
(``gpu`` mark, one GPU is enough): debug_model on CUDA with CUDA-event timing."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_floor

TINY_LLAMA = ["--config", "debug_model", "--training.seq_len", "64",
              "--training.local_batch_size", "1"]  # fmt: skip
TINY_WAN = ["--config", "h200x2_wan22_a14b_20layers", "--model.flavor", "debugmodel",
            "--wan22.latent_frames", "2", "--wan22.latent_height", "4", "--wan22.latent_width",
            "4", "--training.mixed_precision_param", "float32"]  # fmt: skip


def run_floor(tmp_path: Path, *args: str, timeout: int = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_floor.py"), "--out-dir", str(tmp_path), "--iters",
         "1", "--warmup", "1", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*_floor_*.json")
    return {"path": path, **json.loads(path.read_text())}


def test_shard_rows_is_rank0_chunk():
    assert [bench_floor.shard_rows(n, 2) for n in (1, 2, 3, 8)] == [1, 1, 2, 4]
    assert bench_floor.shard_rows(1, 8) == 1  # Wan's (1, 6, dim) modulation: rank 0 holds it
    assert len(torch.arange(7).chunk(3)[0]) == bench_floor.shard_rows(7, 3)


def test_auto_iters_targets_the_time_budget():
    assert bench_floor.auto_iters([400.0, 410.0], 3.0) == 7
    assert bench_floor.auto_iters([8000.0], 3.0) == bench_floor.MIN_ITERS
    assert bench_floor.auto_iters([0.01], 3.0) == bench_floor.MAX_ITERS


def test_summary_takes_the_lowest_round_per_part():
    rounds = [
        {"round": 1, "floor_ms": 16.0, **{v: {"median_ms": m} for v, m in
                                          zip(bench_floor.VARIANTS, (10.0, 4.0, 2.0, 1.0))}},
        {"round": 2, "floor_ms": 17.0, **{v: {"median_ms": m} for v, m in
                                          zip(bench_floor.VARIANTS, (12.0, 3.0, 2.0, 0.5))}},
    ]  # fmt: skip
    s = bench_floor.summarize(rounds)
    assert (s["fwd_bwd_ms"], s["adamw_ms"], s["clip_ms"], s["cast_ms"]) == (10.0, 3.0, 2.0, 0.5)
    assert s["floor_ms"] == 15.0 and s["floor_with_cast_ms"] == 15.5
    assert (s["floor_min_ms"], s["floor_max_ms"]) == (16.0, 17.0)


@pytest.mark.parametrize(
    ("override", "match"),
    [(["--compile.enable"], "compile.enable"),
     (["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree")],
)  # fmt: skip
def test_unmodeled_options_are_named_errors(override, match):
    job_config = bench_floor.load_job_config("debug_model", override)
    with pytest.raises(bench_floor.FloorConfigError, match=match):
        bench_floor.check_supported(job_config)


def test_floor_debug_model_cpu(tmp_path):
    res = run_floor(tmp_path, *TINY_LLAMA, "--device", "cpu")
    assert res["path"].name.endswith(
        "_cpu_" + res["metadata"]["commit"] + "_floor_debug_model.json"
    )
    assert res["kind"] == "floor" and res["world_size"] == 2 and res["device"] == "cpu"
    parts = [res[f"{v}_ms"] for v in bench_floor.FLOOR_PARTS]
    assert all(ms > 0 for ms in parts) and res["cast_ms"] > 0
    assert res["floor_ms"] == pytest.approx(sum(parts))
    assert res["floor_with_cast_ms"] == pytest.approx(res["floor_ms"] + res["cast_ms"])
    assert [r["round"] for r in res["rounds"]] == [1, 2]  # every variant timed twice
    work = res["work"]
    assert work["params"] == 6_163_712 and work["input_shape"] == [1, 64]
    # rank 0's dim-0 shards: ceil(rows / 2) of every parameter, just over half the model
    assert work["params"] / 2 <= work["shard_params"] < work["params"] / 2 + 10_000
    assert res["path"].with_suffix(".md").read_text().count("floor (fwd_bwd + adamw + clip)") == 1


def test_floor_wan22_cpu_uses_its_data_and_full_ac():
    """In-process (no second interpreter start): the Wan2.2 spec's data, loss and AC."""
    job_config = bench_floor.load_job_config(TINY_WAN[1], TINY_WAN[2:])
    bench_floor.check_supported(job_config)
    cpu = torch.device("cpu")
    with bench_floor.one_rank_process_group():
        work, about = bench_floor.build_work(job_config, 4, cpu)
        rounds = bench_floor.measure(work, cpu, rounds=1, warmup=1, iters=1, target_s=0.0)
    assert (about["model"], about["activation_checkpoint"]) == ("wan22", "full")
    assert type(work.model.layers["0"]).__name__ == "CheckpointWrapper"
    assert about["input_shape"] == [1, 16, 2, 4, 4] and about["label_elements"] == 16 * 2 * 4 * 4
    assert set(work.extra_inputs) == {"timesteps", "text_emb"}
    assert work.inputs.std() > 0.5  # noised synthetic latents, never zeros
    assert math.isclose(about["shard_params"] / about["params"], 0.25, rel_tol=0.05)
    assert bench_floor.summarize(rounds)["floor_ms"] > 0
    assert all(p.grad is not None for p in work.model.parameters())  # backward reached all
    # init_weights zeroes the output head (and biases): left so, every gradient above the
    # head would be zero and backward would be timed on zeros
    assert "head.head.weight" in about["zero_params_filled"]
    assert "layers.*.ffn.0.bias" in bench_floor.name_patterns(about["zero_params_filled"])
    assert all(p.grad.any() for p in work.model.parameters())


@pytest.mark.parametrize("config", ["h200x2_llama70b_4layers", "h200x2_qwen3_30b_a3b_4layers"])
def test_language_models_have_no_all_zero_parameter(config):
    """Their traces before the fill stay valid (checked on the debug flavors' init code)."""
    job_config = bench_floor.load_job_config(config, ["--model.flavor", "debugmodel"])
    with bench_floor.one_rank_process_group():
        built = bench_floor.build_model(job_config, torch.device("cpu"))
    assert built.zero_filled == [] and sum(p.numel() for p in built.model.parameters()) > 0


def test_fill_zero_parameters_fills_only_all_zero_tensors():
    layer = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(layer.bias)
    weight = layer.weight.detach().clone()
    assert bench_floor.fill_zero_parameters(layer, std=1e-4, seed=0) == ["bias"]
    assert torch.equal(layer.weight, weight) and layer.bias.all()
    assert 0 < layer.bias.abs().max() < 1e-3  # normal(0, 1e-4): the size of AdamW's first step


@pytest.mark.gpu
def test_gpu_floor_debug_model(tmp_path):
    res = run_floor(tmp_path, "--config", "debug_model", "--device", "cuda")
    assert res["device"].startswith("cuda") and res["peak_allocated_gib"] > 0
    assert all(res[f"{v}_ms"] > 0 for v in bench_floor.VARIANTS)
    assert res["floor_ms"] == pytest.approx(res["fwd_bwd_ms"] + res["adamw_ms"] + res["clip_ms"])
