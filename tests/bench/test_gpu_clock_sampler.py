"""scripts/bench/gpu_clock.py: nvidia-smi samples beside a timed window."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import gpu_clock


def _line(seconds: float, mhz: int, temp: int, watts: float, util: int = 100) -> str:
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(seconds)))
    return f"{stamp}.{int(1000 * (seconds % 1)):03d}, {mhz}, {temp}, {watts}, {util}"


def test_parse_and_summarize_only_the_window(tmp_path, monkeypatch):
    t0 = 1_800_000_000.0
    lines = [
        _line(t0 + i, mhz, 60 + i, 600.0 + i) for i, mhz in enumerate([1980, 1740, 1755, 1500])
    ]
    lines += [_line(t0 + 2.2, 345, 60, 80.0, util=0)]  # idle: out with busy_only
    lines += ["2026/12/03 10:00:00.000, [N/A], [N/A], [N/A], [N/A]", "cut"]
    assert gpu_clock.parse_sample(lines[0])[:2] == (t0, 1980.0)
    assert gpu_clock.parse_sample(lines[-1]) is None and gpu_clock.parse_sample(lines[-2]) is None
    sampler = gpu_clock.ClockSampler.__new__(gpu_clock.ClockSampler)
    sampler._proc, sampler._path = object(), tmp_path / "clocks.csv"
    sampler._path.write_text("\n".join(lines))
    assert sampler.window(t0 + 1, t0 + 2.5)["samples"] == 3
    assert sampler.window(t0 + 1, t0 + 2.5, busy_only=True) == {
        "samples": 2, "sm_mhz_median": 1747.5, "sm_mhz_min": 1740.0, "sm_mhz_max": 1755.0,
        "temp_c_max": 62.0, "power_w_median": 601.5,
    }  # fmt: skip
    assert sampler.window(t0 + 10, t0 + 11) is None


def test_gpu_index_from_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_clock.gpu_index() == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1b")
    assert gpu_clock.gpu_index() == "0"


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch):
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)
    sampler = gpu_clock.ClockSampler("0")
    assert sampler.window(0, time.time()) is None
    sampler.stop()


@pytest.mark.gpu
def test_busy_samples_beside_real_gpu_work():
    """On the GPU machine: nvidia-smi's samples of a 3 s matmul loop are busy ones, with a
    clock, a temperature and a power draw."""
    import shutil

    import torch

    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs CUDA and nvidia-smi")
    sampler = gpu_clock.ClockSampler(gpu_clock.gpu_index())
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        started = time.time()
        while time.time() - started < 3.0:
            for _ in range(20):
                a = torch.nn.functional.normalize(a @ a, dim=-1)
            torch.cuda.synchronize()
        busy = sampler.window(started, time.time(), busy_only=True)
    finally:
        sampler.stop()
    assert busy is not None and busy["samples"] >= 3, busy
    assert busy["sm_mhz_median"] > 500 and busy["power_w_median"] > 0 and busy["temp_c_max"] > 0
