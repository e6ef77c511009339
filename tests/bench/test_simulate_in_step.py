"""The simulator's in-step compute level (inputs.in_step_compute) on hand-made result
files: the model's kernels in a profiled step against the same kernels in a profiled
trace; a 2-GPU step's level is applied, a one-GPU step's only reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan_tide.simulator import inputs

CONFIG = "h200x2_wan22_a14b_20layers"
GEMM, ATTN = "nvjet_gemm", "flash_bprop"
CAST = "bfloat16_copy_kernel"  # launched more often in an FSDP step: not the model's own work


def _kernel(name: str, ms: float, count: int) -> dict:
    return {"name": name, "ms": ms, "sm_weighted_ms": ms, "count": count}


def _trace(folder: Path, stem: str, date: str, kernels: list[dict] | None) -> None:
    data = {"metadata": {"date": date, "machine": "NVIDIA H200 x 1"}, "fwd_bwd_ms": 100.0,
            "profiled_iteration": None if kernels is None else
            {"kernel_ms": 100.0, "memcpy_ms": 0.0, "memset_ms": 0.0, "kernels": kernels}}  # fmt: skip
    (folder / f"{stem}_trace_{CONFIG}.json").write_text(json.dumps(data))


def _step(folder: Path, name: str, date: str, world: int, ranks: list[list[dict]]) -> None:
    per_rank = {f"rank{i}": {"kernels": k} for i, k in enumerate(ranks)}
    data = {"metadata": {"date": date, "world_size": world},
            "rows": [{"mode": "fsdp2", "best_step_ms": 120.0, "bd_step_ms": 120.0,
                      "bd_compute_ms": 110.0}],
            "runs": {"fsdp2": [{"layout": {"per_rank": per_rank}}]}}  # fmt: skip
    (folder / name).write_text(json.dumps(data))


TRACE_KERNELS = [_kernel(ATTN, 50.0, 40), _kernel(GEMM, 40.0, 280), _kernel(CAST, 2.0, 16)]


def test_nothing_measured_says_so(tmp_path):
    level, applied, source = inputs.in_step_compute(tmp_path, CONFIG)
    assert level is None and not applied and source.startswith("not measured")


def test_one_gpu_step_is_reported_against_the_newest_trace_not_applied(tmp_path):
    _trace(tmp_path, "2026-12-03_nvidia-h200-x-1_aaa", "2026-12-03T09:00:00Z",
           [_kernel(ATTN, 10.0, 40)])  # older (e.g. timed on zero gradients): not the pair  # fmt: skip
    _trace(tmp_path, "2026-12-04_nvidia-h200-x-1_bbb", "2026-12-04T09:00:00Z", TRACE_KERNELS)
    step = [_kernel(ATTN, 55.0, 40), _kernel(GEMM, 44.0, 280), _kernel(CAST, 30.0, 97)]
    _step(tmp_path, f"2026-12-03_nvidia-h200-x-1_aaa_step_world1_fsdp_{CONFIG}.json",
          "2026-12-03T09:05:00Z", 1, [step])  # fmt: skip
    level, applied, source = inputs.in_step_compute(tmp_path, CONFIG)
    assert level == pytest.approx(99.0 / 90.0)  # the cast (97 vs 16 launches) is left out
    assert not applied and "not applied" in source and "bbb_trace" in source
    assert "2 kernels" in source and "90% of the trace's kernel time" in source


def test_two_gpu_step_level_is_applied_to_the_compute(tmp_path):
    _trace(tmp_path, "2026-12-03_nvidia-h200-x-1_aaa", "2026-12-03T09:00:00Z", TRACE_KERNELS)
    ranks = [[_kernel(ATTN, 55.0, 40), _kernel(GEMM, 44.0, 280)],
             [_kernel(ATTN, 57.0, 40), _kernel(GEMM, 46.0, 280)]]  # fmt: skip
    _step(tmp_path, f"2026-12-05_nvidia-h200-x-2_ccc_step_{CONFIG}.json",
          "2026-12-05T09:00:00Z", 2, ranks)  # fmt: skip
    level, applied, source = inputs.in_step_compute(tmp_path, CONFIG)
    assert level == pytest.approx((99.0 / 90.0 + 103.0 / 90.0) / 2)  # mean over ranks
    assert applied and "2 ranks" in source and "applied" in source


def test_a_trace_without_profiled_kernels_gives_no_level(tmp_path):
    _trace(tmp_path, "2026-12-03_nvidia-h200-x-1_aaa", "2026-12-03T09:00:00Z", None)
    _step(tmp_path, f"2026-12-03_nvidia-h200-x-1_aaa_step_world1_fsdp_{CONFIG}.json",
          "2026-12-03T09:05:00Z", 1, [[_kernel(ATTN, 55.0, 40)]])  # fmt: skip
    level, applied, source = inputs.in_step_compute(tmp_path, CONFIG)
    assert level is None and not applied and "no profiled trace" in source


def test_with_compute_level_scales_groups_and_root():
    base = inputs.Inputs(
        compute={"layers.0": inputs.GroupCompute(2.0, 4.0)}, root_fwd_ms=1.0, root_bwd_ms=3.0,
        optimizer_ms_per_shard_elem=0.0, host_ms=5.0, transport_gibps={}, layout_ns={},
        shape_class="large", in_step_level=1.5,
    )  # fmt: skip
    scaled = inputs.with_compute_level(base, 1.5)
    assert scaled.compute["layers.0"] == inputs.GroupCompute(3.0, 6.0)
    assert (scaled.root_fwd_ms, scaled.root_bwd_ms, scaled.host_ms) == (1.5, 4.5, 5.0)


def test_build_inputs_applies_an_applied_level_and_reports_the_other(monkeypatch):
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = load_config_model(CONFIG)
    monkeypatch.setattr(inputs, "in_step_compute", lambda *a: (None, False, "not measured"))
    plain = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
    monkeypatch.setattr(inputs, "in_step_compute", lambda *a: (1.25, True, "2-GPU step"))
    applied = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
    monkeypatch.setattr(inputs, "in_step_compute", lambda *a: (1.25, False, "one-GPU step"))
    reported = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
    group = next(iter(plain.compute))
    assert applied.compute[group].bwd_ms == pytest.approx(1.25 * plain.compute[group].bwd_ms)
    assert applied.root_fwd_ms == pytest.approx(1.25 * plain.root_fwd_ms)
    assert applied.in_step_level is None and "in-step level (applied)" in applied.sources["compute"]
    assert reported.compute == plain.compute and reported.in_step_level == 1.25
