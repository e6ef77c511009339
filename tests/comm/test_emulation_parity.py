"""TIDE's multi-node path against stock FSDP2 on ONE GPU: emulated nodes
(tests/comm/_emulation.py, docs/design/2026-12-02-emulation.md).

N processes on GPU 0, each its own node to NCCL (``NCCL_HOSTID``, sockets on loopback)
and to TIDE (its own launcher node), train a Llama-shaped model and the Qwen3 MoE model
built by TorchTitan's parallelize functions (``_layouts.run_layout``: bf16 parameters,
fp32 reduce; a stock FSDP2 copy and TIDE copies with ``local_world_size`` detected and 1)
in lockstep. After every backward each local gradient shard, after every all-gather
(forward and backward) each unsharded parameter, and the losses equal stock's: bitwise on
2 nodes (one fp32 addition per element); on 4 nodes TIDE-RS adds in its own order, so
1e-5 relative as the CPU tests (tests/comm/test_parity_cpu.py), with the parameters
re-synchronized after each step (then the all-gathers are compared bitwise). TIDE's
outputs are NaN-poisoned; every FSDP group must have run TIDE-AG on the point-to-point
transport and TIDE-RS as N nodes x 1 (counted per call), and the log must say so
(``transport=p2p (auto: N nodes x 1``, the TIDE-RS first-reduce line). NCCL's own INIT
log must show the communicators as N nodes.

``one_node``: 2 processes on GPU 0 that NCCL sees as ONE node (needs NCCL >= 2.30 in
torch's place: scripts/gpu/check.sh's ``emulation`` stage swaps it in; skipped
otherwise), TIDE still 2 nodes x 1 (its cross-node path over NCCL's same-GPU transport).

The same checks on CPU (gloo, each forked rank its own launcher node): the CPU stand-in
that runs where no GPU is.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 -m pytest -q -m "gpu and emulation" tests/comm/test_emulation_parity.py
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from _emulation import launcher_node_env, nccl_comms, nccl_versions, spawn_emulated
from _emulation import log_tail as nccl_log_tail
from _harness import spawn
from _layouts import Layout, run_layout

from torchtitan_tide.comm.transports.windows.nccl_rma import multi_rank_gpu_missing_reason


def gpu_emulation(test):
    """Marks of the GPU tests: ``gpu``, ``emulation``, skipped without CUDA."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(pytest.mark.emulation(needs_cuda(test)))


# bf16 parameters, fp32 reduce (Layout's job config: mixed_precision_reduce float32).
# Detected (0: one rank per launcher node) and forced (1) layouts, TIDE-AG over p2p.
LLAMA = Layout(
    model="llama3", param_dtype="bfloat16", ranks_per_node=1, local_world_sizes=(0, 1),
    expect_transport="P2PTransport", steps=3,
)  # fmt: skip
QWEN3_MOE = replace(LLAMA, model="qwen3_moe", num_experts=4)


def layouts_for(nodes: int, tide: dict | None = None) -> list[Layout]:
    """The layouts of one emulated run: bitwise on 2 nodes, 1e-5 re-synchronized beyond."""
    exact = nodes == 2
    return [
        replace(
            layout, tolerance=0.0 if exact else 1e-5, resync_params=not exact, tide=dict(tide or {})
        )
        for layout in (LLAMA, QWEN3_MOE)
    ]


def _deterministic() -> None:
    # The stock and TIDE copies run the same kernels on the same GPU: deterministic ones,
    # so that any difference is TIDE's (MoE's index backward, embedding backward).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _parity(
    rank: int, world_size: int, layouts: list[Layout], nodes: int, cuda: bool = True
) -> None:
    """Every layout against stock FSDP2 (``run_layout``), then TIDE's log lines."""
    _deterministic()
    for layout in layouts:
        device = torch.device("cuda", 0) if cuda else None
        rec = run_layout(rank, world_size, layout, device=device)
        log = "\n".join(rec.logs)
        shape = f"{nodes} nodes x 1"
        first_reduce = [m for m in rec.logs if "TIDE-RS" in m and "first reduce" in m]
        assert first_reduce and all(shape in m for m in first_reduce), log
        if rank == 0:  # install's decisions are logged by global rank 0
            transport = (
                f"transport=windows (auto: {shape}: NCCL windows, one-sided puts across nodes"
                if layout.expect_transport == "WindowTransport"
                else f"transport=p2p (auto: {shape}: no node-local peers, point-to-point over "
            )  # fmt: skip
            for line in (
                transport,
                f"{shape} ({nodes} node(s) with 1 consecutive group ranks each)",  # detected
                f"{shape} (option local_world_size)",  # forced
            ):
                assert line in log, f"{layout.model}: no {line!r} in:\n{log}"
            assert "transport=copy_engine" not in log, log


def _check_nccl_nodes(
    log_dir: str, nodes_of: Callable[[int], int], what: str
) -> list[tuple[int, int, int]]:
    comms = nccl_comms(log_dir)
    assert comms, f"no communicator line in NCCL's INIT log:\n{nccl_log_tail(log_dir)}"
    wrong = [c for c in comms if c[1] != nodes_of(c[0])]
    assert not wrong, f"{what}: NCCL built (ranks, nodes, local ranks) {wrong}"
    return comms


@gpu_emulation
@pytest.mark.parametrize("nodes", [2, 4], ids=["2x1", "4x1"])
def test_emulated_nodes_parity(tmp_path, nodes):
    """N emulated nodes x 1 rank (NCCL_HOSTID): TIDE's cross-node path vs stock FSDP2."""
    spawn_emulated(_parity, nodes, layouts_for(nodes), nodes, mode="nodes",
                   timeout_s=150, nccl_log_dir=str(tmp_path))  # fmt: skip
    # Every communicator (world, FSDP groups, p2p pairs) is one node per rank to NCCL.
    _check_nccl_nodes(str(tmp_path), lambda ranks: ranks, "NCCL_HOSTID per process")


# The one-node test's TIDE runs: ([tide] keys, the TIDE-AG transport class every group
# must use). Under "auto" NCCL >= 2.30 sees host RMA within this one node and takes the
# NCCL windows (docs/design/2026-12-04-windows.md), so each transport is named here.
ONE_NODE_RUNS = [
    ({"cross_node_transport": "p2p"}, "P2PTransport"),
    ({"cross_node_transport": "nccl_one_sided"}, "WindowTransport"),
]


@gpu_emulation
@pytest.mark.one_node
@pytest.mark.parametrize(
    "tide, ag_transport", ONE_NODE_RUNS, ids=[o["cross_node_transport"] for o, _ in ONE_NODE_RUNS]
)
def test_one_node_parity(tmp_path, tide, ag_transport):
    """2 ranks on GPU 0 that NCCL sees as ONE node (NCCL_MULTI_RANK_GPU_ENABLE=1), TIDE
    as 2 nodes x 1: its cross-node path over NCCL's same-GPU transport."""
    reason = multi_rank_gpu_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    layouts = [replace(layout, expect_transport=ag_transport) for layout in layouts_for(2, tide)]
    spawn_emulated(_parity, 2, layouts, 2, mode="one_node", timeout_s=150,
                   nccl_log_dir=str(tmp_path))  # fmt: skip
    _check_nccl_nodes(str(tmp_path), lambda ranks: 1, "NCCL_MULTI_RANK_GPU_ENABLE")
    versions = nccl_versions(str(tmp_path))  # NCCL's own word, not torch.cuda.nccl.version()
    numbers = [tuple(int(x) for x in v.split("+")[0].split(".")) for v in versions]
    assert numbers and min(numbers) >= (2, 30), versions


def _parity_cpu(rank: int, world_size: int, layouts: list[Layout], nodes: int) -> None:
    os.environ.update(launcher_node_env(rank))  # each rank its own launcher node, as above
    _parity(rank, world_size, layouts, nodes, cuda=False)


@pytest.mark.parametrize("nodes", [2, 4], ids=["2x1", "4x1"])
def test_nodes_parity_cpu(nodes):
    """The emulated-node checks on CPU (gloo point-to-point): the stand-in where no GPU is."""
    spawn(_parity_cpu, nodes, layouts_for(nodes), nodes)
