"""TIDE on the parallelism layouts of TorchTitan jobs, against stock FSDP2 (CPU, gloo).

Each test is one layout, built by TorchTitan 0.2.2's own parallelize functions and
checked by ``_layouts.run_layout``: local gradient shards after every backward and
losses of 3 SGD steps against stock FSDP2 on an identical copy, NaN-poisoned TIDE
outputs, and TIDE-AG / TIDE-RS counted on the process group of the expected mesh
dimension (or FSDP2's path with its logged reason). ``2nodes``: ``[tide]
local_world_size`` makes TIDE treat the data-parallel group as two nodes (its
cross-node point-to-point phase runs).

Tolerance: bitwise where two ranks add up a gradient (one fp32 addition per element,
in any order). Where four ranks add (dp_shard 4), TIDE-RS sums in its own order
(node-local rows, then across nodes) and the backend in another, so the gradient
shards agree to 1e-5 relative; those layouts keep fp32 parameters, since a bf16 cast
of parameters that differ by one fp32 ulp after SGD can round apart by a bf16 ulp.
"""

from __future__ import annotations

import pytest
from _harness import spawn
from _layouts import Layout, run_layout

pytestmark = pytest.mark.slow

NODES = pytest.mark.parametrize("nodes", ["1node", "2nodes"])


def dp_layout(nodes: str, **kw) -> tuple[int, Layout]:
    """Data parallel only: one node of 2 ranks (bitwise, bf16 parameters as TorchTitan's
    default), or 4 ranks as 2 nodes x 2 (fp32 parameters, 1e-5: see module doc)."""
    if nodes == "1node":
        return 2, Layout(**kw)
    return 4, Layout(param_dtype="float32", tolerance=1e-5, tide={"local_world_size": 2}, **kw)


def two_nodes(nodes: str, lws: int = 1) -> dict:
    return {"local_world_size": lws} if nodes == "2nodes" else {}


@NODES
def test_tp(nodes):
    """dp_shard 2 x tp 2: FSDP over the strided ``fsdp`` sub-group {0, 2} / {1, 3}."""
    spawn(run_layout, 4, Layout(dp_shard=2, tp=2, tide=two_nodes(nodes)))


@NODES
def test_hsdp(nodes):
    """dp_replicate 2 x dp_shard 2: TIDE-AG and TIDE-RS on the shard dim, FSDP2's
    all-reduce across the replicas."""
    spawn(run_layout, 4, Layout(dp_replicate=2, dp_shard=2, tide=two_nodes(nodes)))


@NODES
def test_ep(nodes):
    """Qwen3 MoE, dp_shard 4 x ep 2: dense groups over 4 ranks, routed experts over
    ``efsdp`` (2 ranks). 4 ranks add: fp32 parameters, 1e-5."""
    layout = Layout(
        model="qwen3_moe", dp_shard=4, ep=2, param_dtype="float32", tolerance=1e-5,
        tide=two_nodes(nodes),
    )  # fmt: skip
    spawn(run_layout, 4, layout)


@NODES
def test_pp(nodes):
    """pp 2 (Interleaved1F1B: 2 model parts per rank) x dp_shard 2; ``comm.apply``
    per model part, as ``pipeline_llm`` calls the train spec's parallelize_fn."""
    layout = Layout(pp=2, dp_shard=2, pp_schedule="Interleaved1F1B", tide=two_nodes(nodes))
    spawn(run_layout, 4, layout)


@NODES
def test_multi_root(nodes):
    """``fully_shard`` on embedding, blocks, norm and output but not the model: 5 roots."""
    spawn(run_layout, *dp_layout(nodes, parallelize="multi_root"))


@NODES
def test_compile(nodes):
    """TorchTitan's ``apply_compile`` (per-block ``torch.compile``, backend aot_eager)."""
    spawn(run_layout, *dp_layout(nodes, compile=True))


@NODES
def test_ac_full(nodes):
    spawn(run_layout, *dp_layout(nodes, ac="full"))


@NODES
def test_ac_selective(nodes):
    """Selective AC, per-op policy (saves mm outputs, recomputes the rest)."""
    spawn(run_layout, *dp_layout(nodes, ac="selective", selective_ac_option="op"))


def test_fallback_cpu_offload():
    """``enable_cpu_offload``: every group takes FSDP2's path, logged."""
    layout = Layout(cpu_offload=True, fsdp2_groups={"*": "FSDP2 path (CPU offload"})
    spawn(run_layout, 2, layout)


def test_fallback_shard_dim1():
    """EP with efsdp x ep > experts: TorchTitan shards the routed experts on dim 1
    (``Shard(1)``): that group takes FSDP2's path, logged; the dense groups TIDE."""
    layout = Layout(
        model="qwen3_moe", dp_shard=4, ep=2, num_experts=2, param_dtype="float32",
        tolerance=1e-5, fsdp2_groups={"layers.0.moe.experts": "Shard(1) placement",
                                      "layers.1.moe.experts": "Shard(1) placement"},
    )  # fmt: skip
    spawn(run_layout, 4, layout)
