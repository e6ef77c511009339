"""TIDE on the parallelism layouts of TorchTitan jobs, against stock FSDP2 (CPU, gloo).

Each test is one layout, built by TorchTitan 0.2.2's own parallelize functions and
checked by ``_layouts.run_layout`` in one spawn: a stock FSDP2 copy and TIDE copies
with ``[tide] local_world_size`` 0 (detected: one node) and 1 or 2 (TIDE treats the
data-parallel group as 2 nodes: its cross-node point-to-point phase runs), trained in
lockstep for 3 SGD steps on fresh random tokens. After every backward each parameter's
local gradient shard and the loss are compared with stock's; TIDE's outputs are
NaN-poisoned; TIDE-AG / TIDE-RS calls are counted per FSDP group on the process group of
the expected mesh dimension (or FSDP2's path, with its logged reason, is asserted).

Tolerance: bitwise where two ranks add up a gradient (one fp32 addition per element,
in any order). Where four ranks add (the EP layouts' dense groups, dp_shard 4), TIDE-RS sums in
its own order (node-local rows, then across nodes) and gloo in another, so the gradient
shards agree to 1e-5 relative; those layouts keep fp32 parameters, since a bf16 cast of
parameters one fp32 ulp apart after SGD can round a bf16 ulp apart.

Cost on 2 shared CPU cores: 1-13 s a test (compile, with aot_eager, is the longest;
inductor takes ~70 s, so it is not used), ~85 s for the file plus a one-time ~20 s
import of TorchTitan in the test process, which the forked workers inherit. No test
passes 20 s, so none is marked ``slow``.
"""

from __future__ import annotations

import pytest
from _harness import spawn
from _layouts import Layout, run_layout


def test_tp():
    """dp_shard 2 x tp 2: FSDP over the strided ``fsdp`` sub-groups {0, 2} and {1, 3}."""
    spawn(run_layout, 4, Layout(dp_shard=2, tp=2))


def test_hsdp():
    """dp_replicate 2 x dp_shard 2: TIDE-AG and TIDE-RS on the shard dim, FSDP2's
    all-reduce across the replicas."""
    spawn(run_layout, 4, Layout(dp_replicate=2, dp_shard=2))


@pytest.mark.parametrize("accumulate", ["no_sync", "no_all_reduce"])
def test_hsdp_accumulate(accumulate):
    """HSDP with 2 microbatches a step: without sync (one reduce at the last), or with
    the reduce-scatter every microbatch and FSDP2's all-reduce only at the last."""
    spawn(run_layout, 4, Layout(dp_replicate=2, dp_shard=2, microbatches=2, accumulate=accumulate))


def test_ep():
    """Qwen3 MoE, dp_shard 4 x ep 2: dense groups over 4 ranks (1 x 4 and 2 x 2 nodes),
    routed experts over ``efsdp`` (2 ranks). 4 ranks add: fp32 parameters, 1e-5."""
    layout = Layout(
        model="qwen3_moe", dp_shard=4, ep=2, param_dtype="float32", tolerance=1e-5,
        local_world_sizes=(0, 2),
    )  # fmt: skip
    spawn(run_layout, 4, layout)


def test_pp():
    """pp 2 (Interleaved1F1B: 2 model parts per rank) x dp_shard 2; ``comm.apply`` per
    model part, as ``pipeline_llm`` calls the train spec's parallelize_fn per part."""
    spawn(run_layout, 4, Layout(pp=2, dp_shard=2, pp_schedule="Interleaved1F1B"))


def test_multi_root():
    """``fully_shard`` on embedding, blocks, norm and output but not the model: 5 roots."""
    spawn(run_layout, 2, Layout(parallelize="multi_root"))


def test_compile():
    """TorchTitan's ``apply_compile`` (per-block ``torch.compile``, backend aot_eager)."""
    spawn(run_layout, 2, Layout(compile=True))


def test_ac_full():
    spawn(run_layout, 2, Layout(ac="full"))


def test_ac_selective():
    """Selective AC, per-op policy (saves mm outputs, recomputes the rest)."""
    spawn(run_layout, 2, Layout(ac="selective", selective_ac_option="op"))


def test_replicate():
    """torch's FSDP2-based ``replicate()`` over dp_replicate 2 (no shard dim): nothing
    to all-gather; every group takes FSDP2's path, logged."""
    layout = Layout(
        parallelize="replicate",
        dp_replicate=2,
        dp_shard=1,
        fsdp2_groups={"*": "replicate-only mesh"},
    )
    spawn(run_layout, 2, layout)


def test_fallback_cpu_offload():
    """``enable_cpu_offload``: every group takes FSDP2's path, logged."""
    layout = Layout(cpu_offload=True, fsdp2_groups={"*": "CPU offload"})
    spawn(run_layout, 2, layout)


def test_fallback_ag_extension():
    """A parameter with FSDP2's all-gather extension (float8 training weights have one):
    its group (``layers.0``) takes FSDP2's path, logged; the other groups TIDE."""
    layout = Layout(
        ag_extension=("layers.0.feed_forward.w1.weight",),
        fsdp2_groups={"layers.0": "custom fsdp_pre_all_gather extension"},
    )
    spawn(run_layout, 2, layout)


def test_fallback_shard_dim1():
    """EP with efsdp x ep > experts: TorchTitan shards the routed experts on dim 1
    (``Shard(1)``): those groups take FSDP2's path, logged; the dense groups TIDE."""
    layout = Layout(
        model="qwen3_moe", dp_shard=4, ep=2, num_experts=2, param_dtype="float32",
        tolerance=1e-5, local_world_sizes=(2,),
        fsdp2_groups={f"layers.{i}.moe.experts": "Shard(1) placement" for i in range(2)},
    )  # fmt: skip
    spawn(run_layout, 4, layout)
