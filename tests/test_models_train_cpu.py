"""The tiny Qwen3-MoE and Wan2.2 configs train on 2 gloo ranks under every comm mode that
exists (fsdp2, tide): loss finite and falling, and TIDE's losses equal stock FSDP2's."""

import math

import pytest
from train_helpers import losses, train

pytestmark = pytest.mark.slow

CASES = {
    # config: (steps, required fall of the mean loss, first 3 steps vs last 3)
    "qwen3_moe_debug": (12, 0.5),
    "wan22_debug": (20, 0.03),
}


@pytest.mark.parametrize("config", sorted(CASES))
def test_tiny_model_trains_in_every_mode(tmp_path, config):
    steps, required_fall = CASES[config]
    curves = {
        mode: losses(train(tmp_path / mode, "--training.steps", str(steps), "--tide.comm", mode,
                           config=config))
        for mode in ("fsdp2", "tide")
    }
    for mode, curve in curves.items():
        values = [curve[s] for s in range(1, steps + 1)]
        assert all(math.isfinite(v) for v in values), (mode, values)
        first, last = sum(values[:3]) / 3, sum(values[-3:]) / 3
        assert last < first - required_fall, (mode, values)
    assert curves["tide"] == curves["fsdp2"]
