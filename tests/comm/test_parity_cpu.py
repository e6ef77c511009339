"""TIDE (AG + RS) vs stock FSDP2 on CPU/gloo, every element written.

Two ranks: bitwise (one fp32 addition per element, whatever the order). More
ranks: TIDE-RS adds in its own order, so within 1e-5 relative; TIDE-AG alone
(``reduce_scatter="fsdp2"``) stays bitwise.
"""

import functools

import pytest
from _harness import Scenario, run_parity, spawn

SCENARIOS_2 = [
    Scenario(reshard_after_forward=True, bf16=False, prefetch=False, grad_accum=1),
    Scenario(reshard_after_forward=False, bf16=True, prefetch=True, grad_accum=2),
    Scenario(reshard_after_forward=True, bf16=True, prefetch=True, grad_accum=1),
    Scenario(reshard_after_forward=False, bf16=False, prefetch=False, grad_accum=2),
]
SCENARIOS_4 = [
    Scenario(reshard_after_forward=True, bf16=True, prefetch=True, grad_accum=2, steps=2),
    Scenario(reshard_after_forward=False, bf16=False, prefetch=False, grad_accum=1, steps=2),
]


@pytest.mark.parametrize("local_world_size", [2, 1], ids=["1x2", "2x1"])
def test_parity_world2(local_world_size):
    spawn(run_parity, 2, SCENARIOS_2, {"local_world_size": local_world_size})


@pytest.mark.parametrize(
    "local_world_size,pacing",
    [(4, 0), (2, 0), (2, 1), (1, 3)],
    ids=["1x4", "2x2", "2x2-paced", "4x1"],
)
def test_parity_world4(local_world_size, pacing):
    spawn(
        functools.partial(run_parity, tolerance=1e-5),
        4,
        SCENARIOS_4,
        {"local_world_size": local_world_size, "pacing": pacing},
    )


@pytest.mark.parametrize("local_world_size", [2, 1], ids=["2x2", "4x1"])
def test_parity_world4_ag_only_bitwise(local_world_size):
    spawn(
        run_parity,
        4,
        SCENARIOS_4[:1],
        {"local_world_size": local_world_size, "reduce_scatter": "fsdp2"},
    )


def test_parity_reshard_after_forward_int():
    """reshard_after_forward=2 on 4 ranks: forward all-gathers take TIDE, the
    backward ones run on FSDP's post-forward mesh and take FSDP2's path."""
    spawn(
        functools.partial(run_parity, tolerance=1e-5),
        4,
        [Scenario(reshard_after_forward=2, bf16=True, steps=2)],
        {"local_world_size": 2},
    )
