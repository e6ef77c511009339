"""scripts/bench/rs_wire_error.py: the pure parts (bytes from the plan, gradient draws).
The benchmark itself runs in minutes on CPU (docs/design/2026-12-02-rs-wire.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import rs_wire_error


def test_wire_bytes_from_the_plan():
    # 13 rows over 4 ranks pad to 4 rows of 7; a 1-D 5 pads to 2; (N - 1) = 1 peer node.
    layer = {"w": (13, 7), "b": (5,)}
    assert rs_wire_error.wire_bytes(layer, nodes=2, local=2) == {
        "shard_numel": 4 * 7 + 2, "fp32_bytes": 30 * 4, "bf16_bytes": 30 * 2,
    }  # fmt: skip
    three_peers = rs_wire_error.wire_bytes(layer, nodes=4, local=1)
    assert three_peers["bf16_bytes"] * 2 == three_peers["fp32_bytes"] == 3 * 30 * 4


@pytest.mark.parametrize("distribution", list(rs_wire_error.DISTRIBUTIONS))
def test_gradient_draws(distribution):
    """bf16, reproducible per (seed, rank), different across ranks, scaled."""
    draw = rs_wire_error.make_grad
    a = draw(distribution, (64, 32), 1e-3, seed=7, rank=0)
    assert a.dtype == torch.bfloat16 and a.shape == (64, 32)
    assert torch.equal(a, draw(distribution, (64, 32), 1e-3, seed=7, rank=0))
    assert not torch.equal(a, draw(distribution, (64, 32), 1e-3, seed=7, rank=1))
    assert 1e-5 < a.float().abs().median().item() < 1e-1
    with pytest.raises(ValueError, match="unknown distribution"):
        draw("uniform", (4,), 1.0, seed=0, rank=0)
